"""Public pre-training, then private fine-tuning: ``dpvision pretrain --objective supervised``
and ``learner.init`` / ``learner.finetune`` / ``public_fraction`` in DP-SGD runs."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dpvision.cli import main
from dpvision.config import resolve
from dpvision.errors import DPVisionError
from dpvision.models.encoder import read_encoder
from dpvision.models.finetune import trainable_names
from dpvision.runs.saved import load_model
from dpvision.runs.train import run_training
from dpvision.training import supervised
from dpvision.training.supervised import SupervisedOptions, pretrain_supervised

SIDE = 12


def _write_npz(path: Path, n_train: int = 300, n_test: int = 60) -> Path:
    rng = np.random.default_rng(0)
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
    pretrain_supervised(_options(data), folder / "enc.pt", quiet=True)
    return {"data": data, "encoder": folder / "enc.pt", "folder": folder}


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
    assert record["n_images"] == 60
    assert record["private_data"] is False
    assert "public slice" in record["trained_on"]
    assert 0 <= record["test_accuracy"] <= 1
    assert any(key.startswith("layers") for key in state)


def test_pretraining_resumes_to_the_same_weights(files, tmp_path, monkeypatch):
    whole = tmp_path / "whole.pt"
    pretrain_supervised(_options(files["data"]), whole, quiet=True)
    original = supervised._Session.save

    def save_then_stop(self, path):  # type: ignore[no-untyped-def]
        original(self, path)
        raise KeyboardInterrupt

    monkeypatch.setattr(supervised._Session, "save", save_then_stop)
    checkpoint = tmp_path / "run.ckpt"
    with pytest.raises(KeyboardInterrupt):
        pretrain_supervised(_options(files["data"]), tmp_path / "x.pt", checkpoint=checkpoint)
    monkeypatch.setattr(supervised._Session, "save", original)
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
    assert tuned["n_train"] == scratch["n_train"] == 240  # the public fifth left out
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


def test_weights_trained_on_the_private_rows_are_refused(files):
    with pytest.raises(DPVisionError, match=r"public_fraction = 0\.2") as error:
        run_training(_config(files, f"learner.init={files['encoder']}", public=0.0), quiet=True)
    assert "\n" not in str(error.value)
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
    assert result["n_train"] == 240
    assert result["epsilon"] <= 1.0
    assert result["num_features"] == 16
    with pytest.raises(DPVisionError, match=r"public_fraction = 0\.2"):
        run_training(resolve(overrides={**config.to_dict(), "public_fraction": 0.0}), quiet=True)


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
