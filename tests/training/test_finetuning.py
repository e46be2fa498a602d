"""Public pre-training, then private fine-tuning: ``dpvision pretrain --objective supervised``
and ``learner.init`` / ``learner.finetune`` / ``public_fraction`` in DP-SGD runs; the
weights' record of their public rows and the check that none is a private row of the run."""

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dpvision.cli import main
from dpvision.config import resolve
from dpvision.data.datasets import load_dataset
from dpvision.data.splits import PUBLIC_SPLIT, public_digests, public_split, training_rows
from dpvision.errors import DPVisionError
from dpvision.models.encoder import read_encoder
from dpvision.models.finetune import trainable_names
from dpvision.models.weights import read_weights
from dpvision.runs.saved import load_model
from dpvision.runs.train import run_training
from dpvision.training.pretrain_options import SupervisedOptions
from dpvision.training.session import Session
from dpvision.training.supervised import check_private_rows, pretrain_supervised

SIDE = 12


def _write_npz(path: Path, n_train: int = 300, n_test: int = 60, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    labels = np.arange(n_train + n_test) % 3
    images = rng.integers(0, 60, (n_train + n_test, SIDE, SIDE, 1)).astype(np.uint8)
    for label in range(3):  # a bright band whose place tells the class
        images[labels == label, 4 * label : 4 * label + 4] += 150
    np.savez(
        path,
        x_train=images[:n_train],
        y_train=labels[:n_train],
        x_test=images[n_train:],
        y_test=labels[n_train:],
    )
    return path


def _options(data: Path, **more: object) -> SupervisedOptions:
    raw = {
        "dataset": f"npz:{data}",
        "num_classes": 3,
        "model": "mlp-16",
        "steps": 10,
        "batch_size": 32,
        "learning_rate": 0.05,
        "public_fraction": 0.2,
        "checkpoint_every": 5,
        **more,
    }
    return SupervisedOptions.from_dict(raw)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("finetune")
    data = _write_npz(folder / "bands.npz")
    summary = pretrain_supervised(_options(data), folder / "enc.pt", quiet=True)
    (folder / "summary.json").write_text(json.dumps(summary))  # the summary is JSON
    return {"data": data, "encoder": folder / "enc.pt", "folder": folder}


def _train_set(files: dict[str, Path]) -> tuple[np.ndarray, np.ndarray]:
    dataset = load_dataset(f"npz:{files['data']}", num_classes=3)
    return dataset.train_images, np.asarray(dataset.train_labels)


def _n_public(files: dict[str, Path], fraction: float = 0.2) -> int:
    return len(public_split(*_train_set(files), fraction)[1])


def _config(files: dict[str, Path], *sets: str, public: float = 0.2):  # type: ignore[no-untyped-def]
    learner = {
        "model": "mlp-16",
        "batch_size": 60,
        "physical_batch_size": 32,
        "steps": 6,
        "learning_rate": 0.5,
        "ema_decay": 0.9,
    }
    items = [f"learner.{k}={json.dumps(v)}" for k, v in learner.items()]
    return resolve(
        overrides={
            "dataset": f"npz:{files['data']}",
            "num_classes": 3,
            "method": "dp-sgd",
            "epsilon": 2.0,
            "accountant": "rdp",
            "public_fraction": public,
        },
        sets=items + list(sets),
    )


def test_pretraining_records_what_it_was_trained_on(files):
    info, state = read_encoder(files["encoder"])
    record = info.metadata
    assert record["objective"] == "supervised"
    assert record["dataset"] == f"npz:{files['data']}"
    assert record["public_fraction"] == 0.2
    assert abs(record["n_images"] - 60) < 4 * (300 * 0.2 * 0.8) ** 0.5  # Binomial(300, 0.2)
    assert record["n_images"] == _n_public(files)
    assert record["private_data"] is False
    assert "public slice" in record["trained_on"]
    assert 0 <= record["test_accuracy"] <= 1
    assert any(key.startswith("layers") for key in state)


def test_pretraining_resumes_to_the_same_weights(files, tmp_path, monkeypatch):
    whole = tmp_path / "whole.pt"
    pretrain_supervised(_options(files["data"]), whole, quiet=True)
    original = Session.save

    def save_then_stop(self, path):  # type: ignore[no-untyped-def]
        original(self, path)
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "save", save_then_stop)
    checkpoint = tmp_path / "run.ckpt"
    with pytest.raises(KeyboardInterrupt):
        pretrain_supervised(_options(files["data"]), tmp_path / "x.pt", checkpoint=checkpoint)
    monkeypatch.setattr(Session, "save", original)
    pretrain_supervised(
        _options(files["data"]), tmp_path / "resumed.pt", checkpoint=checkpoint, quiet=True
    )
    a, b = read_encoder(whole)[1], read_encoder(tmp_path / "resumed.pt")[1]
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(DPVisionError, match="other pre-training options"):
        pretrain_supervised(
            _options(files["data"], learning_rate=0.1), tmp_path / "y.pt", checkpoint=checkpoint
        )


@pytest.fixture(scope="module")
def scratch(files: dict[str, Path]) -> dict:
    return run_training(_config(files), quiet=True)


@pytest.mark.parametrize("mode", ["all", "head", "norms+head", "bias+head"])
def test_fine_tuning_ledger_equals_from_scratch_and_frozen_weights_stay(
    files, tmp_path, mode, scratch
):
    tuned = run_training(
        _config(files, f"learner.init={files['encoder']}", f"learner.finetune={mode}"),
        quiet=True,
        save=tmp_path / "model.safetensors",
    )
    assert tuned["privacy_ledger"] == scratch["privacy_ledger"]
    assert tuned["epsilon"] == scratch["epsilon"] <= 2.0
    # the public slice (about a fifth) left out
    assert tuned["n_train"] == scratch["n_train"] == 300 - _n_public(files)
    assert tuned["finetune"] == mode
    assert "(public slice, 20 % of the training set)" in tuned["init"]["trained_on"]
    start = read_encoder(files["encoder"])[1]
    network = load_model(tmp_path / "model.safetensors").network
    assert network is not None
    trained = set(trainable_names(network, mode))
    frozen = [name for name in network.state_dict() if name not in trained]
    assert bool(frozen) == (mode != "all")
    for name in frozen:  # frozen: bit-identical after training (EMA included)
        assert torch.equal(network.state_dict()[name], start[name]), name
    for name in trained:
        assert not torch.equal(network.state_dict()[name], start[name]), name
    if mode == "head":
        assert tuned["num_trained_parameters"] == 16 * 3 + 3


def test_copies_of_the_weights_public_rows_are_left_out_of_a_private_run(files):
    """A run that declares no public rows still leaves out the rows the weights were
    trained on (copies of declared-public examples), without an error that would say
    whether the private data holds one."""
    result = run_training(
        _config(files, f"learner.init={files['encoder']}", public=0.0), quiet=True
    )
    assert result["n_train"] == 300 - _n_public(files)
    result = run_training(
        _config(
            files,
            f"learner.init={files['encoder']}",
            "learner.init_allow_same_dataset=true",
            public=0.0,
        ),
        quiet=True,
    )
    assert result["n_train"] == 300


def _private(images: np.ndarray, labels: np.ndarray, fraction: float) -> np.ndarray:
    """A private run's rows: its training and validation rows, its public slice left out."""
    rows = training_rows(
        images, labels, public_fraction=fraction, validation_fraction=0.1, key=b"s" * 32
    )
    return np.union1d(rows.train, rows.validation)


def _check(files: dict[str, Path], images: np.ndarray, labels: np.ndarray, **more) -> np.ndarray:  # type: ignore[no-untyped-def]
    return check_private_rows(
        read_weights(files["encoder"])[1],  # the record as a run reads it
        f"npz:{files['data']}",
        private_rows=images,
        private_labels=labels,
        what="learner.init enc.pt",
        **more,
    )


def test_the_file_records_the_digests_of_its_public_rows(files):
    images, labels = _train_set(files)
    public = public_split(images, labels, 0.2)[1]
    record = read_weights(files["encoder"])[1]
    stored = record["public_row_digests"]
    assert stored.dtype == torch.int64
    digests = stored.numpy().view(np.uint64)
    assert np.array_equal(digests, np.sort(public_digests(images[public], labels[public])))
    assert record["public_split"] == PUBLIC_SPLIT
    assert record["public_fraction"] == 0.2
    assert record["n_images"] == len(public) == len(digests)
    assert (
        record["public_rows_sha256"] == hashlib.sha256(digests.astype("<u8").tobytes()).hexdigest()
    )
    summary = json.loads((files["folder"] / "summary.json").read_text())
    assert summary["public_rows_sha256"] == record["public_rows_sha256"]
    assert "public_row_digests" not in summary


def test_a_private_run_at_the_same_fraction_accepts_the_weights(files):
    images, labels = _train_set(files)
    private = _private(images, labels, 0.2)
    assert len(private) == 300 - _n_public(files)
    assert not _check(files, images[private], labels[private]).any()


def test_a_grown_dataset_keeps_the_weights_public_rows_public(files):
    """100 rows more, spread through the dataset: no private row of the run is one of the
    weights' rows (the split the keyed hash replaced moved most of them)."""
    images, labels = _train_set(files)
    rng = np.random.default_rng(7)
    extra = rng.integers(0, 256, (100, *images.shape[1:])).astype(images.dtype)
    order = rng.permutation(400)
    grown = np.concatenate([images, extra])[order], np.concatenate([labels, labels[:100]])[order]
    private = _private(*grown, 0.2)
    assert not _check(files, grown[0][private], grown[1][private]).any()
    # The old split at 300 -> 400 rows: a permutation of range(N) declared other rows public.
    old = {
        n: set(np.random.default_rng([0x707562]).permutation(n)[: round(0.2 * n)])
        for n in (300, 400)
    }
    assert len(old[300] - old[400]) > 20


def test_a_smaller_public_fraction_leaves_the_weights_rows_out_and_so_do_whole_sets(
    files,
):
    images, labels = _train_set(files)
    now_private = set(public_split(images, labels, 0.2)[1]) - set(
        public_split(images, labels, 0.1)[1]
    )
    assert len(now_private) > 10
    private = _private(images, labels, 0.1)
    mask = _check(files, images[private], labels[private])
    assert set(private[mask]) == now_private  # left out as public: exactly those rows
    assert not _check(files, images[private], labels[private], allow=True).any()
    # Weights trained on a whole training set (not declared public): under another dataset
    # name their rows are left out silently too (issue 48: a refusal here said whether the
    # private data held a copy, and how many); under this run's own name, the record alone
    # refuses them, whatever the rows.
    record = {**read_weights(files["encoder"])[1], "public_fraction": 0.0}
    override = "learner.init_allow_same_dataset = true"
    mask = check_private_rows(
        record, "x", private_rows=images[private], private_labels=labels[private], what="w"
    )
    assert set(private[mask]) == now_private
    messages = set()
    for rows in (private, private[:0], np.setdiff1d(private, list(now_private))):
        with pytest.raises(DPVisionError, match="the dataset this run protects") as error:
            check_private_rows(
                record,
                record["dataset"],
                private_rows=images[rows],
                private_labels=labels[rows],
                what="w",
                override=override,
            )
        messages.add(str(error.value))
    (message,) = messages
    assert "\n" not in message
    assert override in message


def test_the_rows_are_checked_whatever_the_dataset_is_called(files, tmp_path):
    """A copy under another name is the same examples: found by their digests."""
    images, labels = _train_set(files)
    record = read_weights(files["encoder"])[1]
    mask = check_private_rows(
        record, f"npz:{tmp_path}/copy.npz", private_rows=images, private_labels=labels, what="w"
    )
    assert mask.sum() == _n_public(files)
    other = _write_npz(tmp_path / "other.npz", seed=1)
    dataset = load_dataset(f"npz:{other}", num_classes=3)
    assert not check_private_rows(
        record,
        f"npz:{other}",
        private_rows=dataset.train_images,
        private_labels=np.asarray(dataset.train_labels),
        what="w",
    ).any()


def test_a_damaged_record_of_public_rows_is_refused(files):
    images, labels = _train_set(files)
    record = read_weights(files["encoder"])[1]
    for key, value in (
        ("public_row_digests", record["public_row_digests"][1:]),
        ("public_row_digests", record["public_row_digests"] ^ 1),
        ("public_rows_sha256", "0" * 64),
    ):
        damaged = {**record, key: value}
        with pytest.raises(DPVisionError, match="damaged or edited"):
            check_private_rows(
                damaged, "cifar10", private_rows=images[:5], private_labels=labels[:5], what="w"
            )


def test_a_file_without_the_record_is_refused_on_its_dataset(files):
    images, labels = _train_set(files)
    record = read_weights(files["encoder"])[1]
    for key in ("public_row_digests", "public_split"):
        older = {k: v for k, v in record.items() if k != key}
        with pytest.raises(DPVisionError, match="older split"):
            check_private_rows(
                older, f"npz:{files['data']}", private_rows=images, private_labels=labels, what="w"
            )
        check_private_rows(older, "cifar10", private_rows=images, private_labels=labels, what="w")


def test_a_grown_dataset_fine_tunes_from_the_weights(files, tmp_path):
    """End to end: the run's own split of a dataset with 100 more rows keeps the weights'
    rows public."""
    images, labels = _train_set(files)
    test = load_dataset(f"npz:{files['data']}", num_classes=3)
    rng = np.random.default_rng(8)
    extra = rng.integers(0, 256, (100, *images.shape[1:])).astype(images.dtype)
    grown = tmp_path / "grown.npz"
    np.savez(
        grown,
        x_train=np.concatenate([extra[:50], images, extra[50:]]),
        y_train=np.concatenate([labels[:50], labels, labels[50:100]]),
        x_test=test.test_images,
        y_test=np.asarray(test.test_labels),
    )
    config = _config(files, f"learner.init={files['encoder']}")
    result = run_training(
        resolve(overrides={**config.to_dict(), "dataset": f"npz:{grown}"}), quiet=True
    )
    assert result["n_train"] == 400 - len(public_split(*_train_set({"data": grown}), 0.2)[1])
    assert "(public slice, 20 % of the training set)" in result["init"]["trained_on"]


def test_missing_init_file_is_refused_before_work(files, tmp_path):
    with pytest.raises(DPVisionError, match="never downloaded"):
        _config(files, f"learner.init={tmp_path / 'absent.pt'}")
    with pytest.raises(DPVisionError, match="belong to --method dp-sgd"):
        resolve(
            overrides={"dataset": "digits", "method": "dp-randp", "epsilon": 1.0},
            sets=[f"learner.init={files['encoder']}"],
        )


def test_encoder_features_read_a_supervised_file(files):
    from dpvision.models.encoder import load_encoder

    body, info = load_encoder(files["encoder"])
    assert body(torch.zeros(2, 1, SIDE, SIDE)).shape == (2, 16)
    assert info.metadata["objective"] == "supervised"


def test_cli_contract(files, tmp_path, capsys):
    out = tmp_path / "enc.pt"
    code = main(
        [
            "pretrain",
            "--objective",
            "supervised",
            "--dataset",
            f"npz:{files['data']}",
            "--set",
            "num_classes=3",
            "--model",
            "mlp-16",
            "--steps",
            "3",
            "--batch-size",
            "16",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert "no privacy cost" in capsys.readouterr().out
    for mode in ("all", "head"):
        code = main(
            [
                "train",
                "--dataset",
                f"npz:{files['data']}",
                "--method",
                "dp-sgd",
                "--set",
                "num_classes=3",
                "--set",
                "learner.model=mlp-16",
                "--set",
                f"learner.init={out}",
                "--set",
                "learner.init_allow_same_dataset=true",
                "--set",
                f"learner.finetune={mode}",
                "--set",
                "learner.steps=2",
                "--set",
                "learner.batch_size=32",
                "--epsilon",
                "1",
                "--json",
                str(tmp_path / f"{mode}.json"),
            ]
        )
        assert code == 0
        result = json.loads((tmp_path / f"{mode}.json").read_text())
        assert result["finetune"] == mode
        assert result["epsilon"] <= 1
    code = main(["pretrain", "--objective", "supervised", "--synthetic", "spectral", "--out", "x"])
    assert code == 2
    assert "--synthetic is for --objective contrastive" in capsys.readouterr().err


def test_backbone_features_of_the_pretrained_file_feed_dp_ls(files):
    spec = f"backbone:model=mlp-16,weights={files['encoder']}"
    config = resolve(
        overrides={
            "dataset": f"npz:{files['data']}",
            "num_classes": 3,
            "method": "dp-ls",
            "features": spec,
            "epsilon": 1.0,
            "public_fraction": 0.2,
        },
    )
    result = run_training(config, quiet=True)
    assert result["n_train"] == 300 - _n_public(files)
    assert result["epsilon"] <= 1.0
    assert result["num_features"] == 16
    # Declared no public rows: the backbone's rows are left out as public all the same.
    undeclared = run_training(
        resolve(overrides={**config.to_dict(), "public_fraction": 0.0}), quiet=True
    )
    assert undeclared["n_train"] == 300 - _n_public(files)


def _mnist_stand_in(root: Path) -> Path:
    """MNIST's four IDX files with random images (the real ones cannot be downloaded here)."""
    import gzip
    import struct

    folder = root / "mnist"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 300), ("t10k", 50)):
        for kind, array, magic in (
            ("images-idx3", rng.integers(0, 256, (n, 28, 28)), 0x803),
            ("labels-idx1", np.arange(n) % 10, 0x801),
        ):
            header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
            data = gzip.compress(header + array.astype(np.uint8).tobytes(), mtime=0)
            (folder / f"{split}-{kind}-ubyte.gz").write_bytes(data)
    return folder


def test_the_issue_contract_commands(tmp_path, capsys):
    """The spellings other code relies on: pretrain on Fashion-MNIST, fine-tune on MNIST."""
    from dpvision.data.datasets import load_dataset

    try:
        load_dataset("fashion-mnist", download=False)
    except DPVisionError:
        pytest.skip("needs Fashion-MNIST (DPVISION_DATA)")
    encoder = tmp_path / "enc.pt"
    code = main(
        [
            "pretrain",
            "--objective",
            "supervised",
            "--dataset",
            "fashion-mnist",
            "--model",
            "tanh-cnn",
            "--out",
            str(encoder),
            "--steps",
            "3",
        ]
    )
    assert code == 0, capsys.readouterr().err
    mnist = _mnist_stand_in(tmp_path)
    for mode in ("all", "head"):
        out = tmp_path / f"{mode}.json"
        code = main(
            [
                "train",
                "--dataset",
                "mnist",
                "--data-dir",
                str(mnist),
                "--method",
                "dp-sgd",
                "--set",
                "learner.model=tanh-cnn",
                "--set",
                f"learner.init={encoder}",
                "--set",
                f"learner.finetune={mode}",
                "--epsilon",
                "1",
                "--set",
                "learner.steps=2",
                "--set",
                "learner.batch_size=64",
                "--json",
                str(out),
            ]
        )
        assert code == 0, capsys.readouterr().err
        result = json.loads(out.read_text())
        assert result["finetune"] == mode
        assert result["epsilon"] <= 1
        assert result["init"]["trained_on"] == "fashion-mnist (training set)"
        assert result["privacy_ledger"][0]["count"] == 2


def test_whole_set_weights_decide_no_membership_by_a_refusal(files, tmp_path):
    """Issue 48, finding 1: weights pre-trained on a whole dataset A (not declared public),
    then a private run on B with ``learner.init``: B alone ran and B plus one image of A was
    refused ("trained on 1 of this run's 201 private rows"), so the adversary, who reads
    A's row digests in the weight file, decided the membership of any A-row exactly (TPR 1
    at FPR 0). Now both run, with the same lines: over 20 targets of A (members) and 20
    images of neither (non-members), the adversary's refusal test has TPR = FPR = 0."""
    from dpvision.testing import assert_same_outcome

    whole = tmp_path / "whole.pt"
    pretrain_supervised(_options(files["data"], public_fraction=0.0), whole, quiet=True)
    a_images, a_labels = _train_set(files)
    other = load_dataset(f"npz:{_write_npz(tmp_path / 'b.npz', seed=1)}", num_classes=3)
    b_images, b_labels = other.train_images[:100], np.asarray(other.train_labels)[:100]
    stranger = _write_npz(tmp_path / "c.npz", seed=2)
    strangers = load_dataset(f"npz:{stranger}", num_classes=3)
    path = tmp_path / "run.npz"

    def run(data: tuple[np.ndarray, np.ndarray]) -> object:
        np.savez(path, x_train=data[0], y_train=data[1], x_test=b_images, y_test=b_labels)
        config = _config(files, f"learner.init={whole}", "learner.steps=1", public=0.0)
        return run_training(dataclasses.replace(config, dataset=f"npz:{path}"), quiet=True)[
            "n_train"
        ]

    def plus(image: np.ndarray, label: int) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate([b_images, image[None]]), np.append(b_labels, label)

    members = [plus(a_images[i], a_labels[i]) for i in range(20)]
    outsiders = [plus(strangers.train_images[i], strangers.train_labels[i]) for i in range(20)]
    outcome = assert_same_outcome(run, (b_images, b_labels), members + outsiders)
    assert not outcome.refused
    assert run(members[0]) == run((b_images, b_labels)) == 100  # the copy is left out
    assert run(outsiders[0]) == 101
