"""Issue 40: what ``learner.init`` alone does (the head zeroed when the file was trained on
other classes, the inputs normalised as the file records), and the private choice between
scratch and fine-tuning (``dpvision tune --transfer``), its cost in the ledger."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dpvision.accounting import PrivacyLedger
from dpvision.cli import main
from dpvision.config import resolve
from dpvision.errors import DPVisionError
from dpvision.models.encoder import ENCODER_FORMAT
from dpvision.recipes import deep_schedule
from dpvision.runs.network import head_init_for, pixel_statistics
from dpvision.runs.saved import load_model
from dpvision.runs.search import HEAD_LEARNING_RATE_FACTOR, parse_search, transfer_search
from dpvision.runs.train import run_training
from dpvision.training.options import DPSGDOptions
from dpvision.training.pretrain_options import SupervisedOptions
from dpvision.training.supervised import pretrain_supervised

SIDE = 8


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))


def _write_npz(path: Path, shift: int, n_train: int = 400, n_test: int = 80) -> Path:
    """Three classes told apart by which band of rows is bright; ``shift`` moves the bands,
    so two files are two domains with the same shape and the same number of classes."""
    rng = np.random.default_rng(shift)
    labels = np.arange(n_train + n_test) % 3
    images = rng.integers(0, 60, (n_train + n_test, SIDE, SIDE, 1)).astype(np.uint8)
    for label in range(3):
        rows = [(2 * label + shift + r) % SIDE for r in range(2)]
        images[np.ix_(labels == label, rows)] += 150
    np.savez(
        path,
        x_train=images[:n_train],
        y_train=labels[:n_train],
        x_test=images[n_train:],
        y_test=labels[n_train:],
    )
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("transfer")
    public = _write_npz(folder / "public.npz", shift=0)
    private = _write_npz(folder / "private.npz", shift=3)
    options = SupervisedOptions.from_dict(
        {
            "dataset": f"npz:{public}",
            "num_classes": 3,
            "model": "mlp-16",
            "steps": 30,
            "batch_size": 32,
            "learning_rate": 0.1,
        }
    )
    pretrain_supervised(options, folder / "prior.pt", quiet=True)
    return {"public": public, "private": private, "prior": folder / "prior.pt", "dir": folder}


def _config(data: Path, *sets: str, epsilon: float = 2.0):  # type: ignore[no-untyped-def]
    learner = {"model": "mlp-16", "batch_size": 64, "steps": 8, "learning_rate": 0.5}
    items = [f"learner.{k}={json.dumps(v)}" for k, v in learner.items()]
    return resolve(
        overrides={
            "dataset": f"npz:{data}",
            "num_classes": 3,
            "method": "dp-sgd",
            "epsilon": epsilon,
            "accountant": "rdp",
        },
        sets=items + list(sets),
    )


def test_a_prior_from_other_classes_starts_with_a_zero_head_and_its_own_with_the_file(files):
    """``head_init = auto``: the file's head names the classes it was trained on, so it is
    kept for that dataset (a public slice) and zeroed for any other, even when the number
    of classes fits; the ledger is scratch's, entry for entry, either way."""
    prior = f"learner.init={files['prior']}"
    other = run_training(_config(files["private"], prior), quiet=True)
    assert other["init"]["head_init"] == "zero"
    assert other["init"]["head_replaced"]
    scratch = run_training(_config(files["private"]), quiet=True)
    assert other["privacy_ledger"] == scratch["privacy_ledger"]
    same = run_training(
        _config(files["public"], prior, "learner.init_allow_same_dataset=true"), quiet=True
    )
    assert same["init"]["head_init"] == "file"
    assert not same["init"]["head_replaced"]
    kept = run_training(_config(files["private"], prior, 'learner.head_init="keep"'), quiet=True)
    assert kept["init"]["head_init"] == "file"


def test_the_head_decision_reads_the_file_never_the_private_rows(files):
    options = DPSGDOptions.from_dict({"model": "mlp-16", "init": str(files["prior"])})
    public_name = f"npz:{files['public']}"
    assert head_init_for(options, public_name) == "keep"
    assert head_init_for(options, f"npz:{files['private']}") == "zero"
    assert head_init_for(DPSGDOptions.from_dict({"model": "mlp-16"}), public_name) == "auto"


def _encoder(path: Path, mean: float, std: float) -> Path:
    """A dpvision encoder file for mlp-16 on 8×8×1 images recording its input statistics."""
    from dpvision.models.registry import build_network
    from dpvision.models.spec import ModelSpec

    model = build_network(ModelSpec.parse("mlp-16"), (1, SIDE, SIDE), 3, groups=16)
    info = {
        "model": "mlp-16",
        "input_shape": (1, SIDE, SIDE),
        "groups": 16,
        "mean": (mean,),
        "std": (std,),
        "metadata": {"objective": "contrastive", "private_data": False},
    }
    torch.save({"format": ENCODER_FORMAT, "info": info, "state_dict": model.state_dict()}, path)
    return path


def test_inputs_are_normalised_as_the_init_file_records(files, tmp_path):
    """``normalization = auto`` with ``learner.init``: the file's statistics, in the run and
    in the model it saves (so ``predict`` sees the same inputs); none without init."""
    encoder = _encoder(tmp_path / "enc.pt", 0.25, 0.5)
    options = DPSGDOptions.from_dict({"model": "mlp-16", "init": str(encoder)})
    assert pixel_statistics(options, "npz:x", 1) == ((0.25,), (0.5,))
    assert pixel_statistics(DPSGDOptions.from_dict({"model": "mlp-16"}), "npz:x", 1) is None
    none = DPSGDOptions.from_dict(
        {"model": "mlp-16", "init": str(encoder), "normalization": "none"}
    )
    assert pixel_statistics(none, "npz:x", 1) is None
    saved = tmp_path / "m.safetensors"
    run_training(_config(files["private"], f"learner.init={encoder}"), quiet=True, save=saved)
    model = load_model(saved)
    assert model.pixel_mean == (0.25,)
    assert model.pixel_std == (0.5,)
    # a pre-trained file on raw pixels records the identity: nothing changes
    plain = DPSGDOptions.from_dict({"model": "mlp-16", "init": str(files["prior"])})
    assert pixel_statistics(plain, "npz:x", 1) is None


def test_options_about_the_init_file_need_one():
    for raw in ({"normalization": "init"}, {"head_init": "zero"}):
        with pytest.raises(DPVisionError, match=r"set learner\.init"):
            DPSGDOptions.from_dict({"model": "mlp-16", **raw})
    assert DPSGDOptions.from_dict({"model": "mlp-16", "init": ""}).init is None


def test_transfer_search_lists_scratch_all_and_head_for_each_other_setting():
    plain = transfer_search("w.pt", 2.0)
    assert plain.candidates() == [
        {"learner.init": "", "learner.finetune": "all"},
        {"learner.init": "w.pt", "learner.finetune": "all"},
        {
            "learner.init": "w.pt",
            "learner.finetune": "head",
            "learner.learning_rate": HEAD_LEARNING_RATE_FACTOR * 2.0,
        },
    ]
    crossed = transfer_search("w.pt", 2.0, parse_search(["learner.learning_rate=1,3"]))
    assert len(crossed.candidates()) == 6
    rates = [c["learner.learning_rate"] for c in crossed.candidates()]
    assert rates == [1, 1, 4.0, 3, 3, 12.0]
    with pytest.raises(DPVisionError, match=r"chooses learner\.finetune itself"):
        transfer_search("w.pt", 1.0, parse_search(["learner.finetune=all,head"]))


def test_a_transfer_search_without_a_rate_leaves_it_to_the_recipe_with_the_head_factor():
    """Review of issue 52: ``tune --transfer`` read the class default (lr 1) before the
    dp-sgd recipe ran, so probing got 4 × 1 while the other candidates got the recipe's
    0.5·B/512, 27× less at N = 301. Unset, every candidate's rate is the recipe's, the
    probing one at the same factor."""
    rows = transfer_search("w.pt", None).candidates()
    assert all("learner.learning_rate" not in row for row in rows)
    full = deep_schedule(301, 1.0, finetune="all")["learning_rate"]
    probe = deep_schedule(301, 1.0, finetune="head")["learning_rate"]
    assert probe == HEAD_LEARNING_RATE_FACTOR * full
    assert deep_schedule(301, 1.0, "adam", "head")["learning_rate"] == 1e-3  # Adam's own


def test_tune_transfer_accounts_the_whole_search(files, tmp_path, capsys):
    """One command: the choice is private, its ε (every run and the selection) within the
    target, one selection entry in the ledger whose releases are those of the candidates
    (fine-tuning releases what scratch does), and a model that loads."""
    out, saved = tmp_path / "tuned.json", tmp_path / "tuned.safetensors"
    argv = [
        "tune", "--quiet", "--transfer", "--dataset", f"npz:{files['private']}",
        "--set", "num_classes=3", "--method", "dp-sgd", "--set", "learner.model='mlp-16'",
        "--set", "learner.steps=6", "--set", "learner.batch_size=64",
        "--set", f"learner.init={json.dumps(str(files['prior']))}",
        "--mean-runs", "2", "--epsilon", "2", "--json", str(out), "--save", str(saved),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [c["learner.finetune"] for c in result["tuning"]["candidates"]] == [
        "all",
        "all",
        "head",
    ]
    assert result["tuning"]["candidates"][0]["learner.init"] == ""
    assert len(result["privacy_ledger"]) == 1
    assert len(result["privacy_ledger"][0]["candidates"]) == 3
    header = {"format": "dpvision-ledger/1", "neighboring_relation": "add_or_remove_one"}
    ledger = PrivacyLedger.from_dict({**header, "entries": result["privacy_ledger"]})
    assert ledger.epsilon(1e-5, "rdp") == pytest.approx(result["epsilon"], rel=1e-12)
    assert result["epsilon"] <= 2.0
    multipliers = result["tuning"]["noise_multipliers"]
    assert multipliers[0] == multipliers[1]  # same steps, same σ: init changes no release
    assert load_model(saved).num_classes == 3


@pytest.mark.parametrize(
    "argv",
    [
        ["--transfer"],
        ["--transfer", "--method", "dp-ls"],
    ],
)
def test_tune_transfer_without_a_prior_is_one_line(argv, files, tmp_path, capsys):
    out = tmp_path / "r.json"
    dataset = ["--dataset", f"npz:{files['private']}", "--set", "num_classes=3"]
    code = main(["tune", "--quiet", *dataset, "--epsilon", "1", "--json", str(out), *argv])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "--transfer chooses between scratch and fine-tuning" in err[0]
    assert not out.exists()


def _tune_argv(data: Path, prior: Path, out: Path, *more: str) -> list[str]:
    return [
        "tune", "--quiet", "--transfer", "--dataset", f"npz:{data}", "--set", "num_classes=3",
        "--method", "dp-sgd", "--set", "learner.model='mlp-16'", "--set", "learner.steps=3",
        "--set", "learner.batch_size=64", "--set", f"learner.init={json.dumps(str(prior))}",
        "--mean-runs", "3", "--epsilon", "2", "--json", str(out), *more,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "seeds", [2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"{n} secret seeds"
)
def test_every_candidate_leaves_out_the_rows_any_candidates_weights_saw(tmp_path, seeds):
    """A prior pre-trained on a declared-public slice of the very dataset: its rows are left
    out of every candidate, scratch included, so all train on the same rows at the planned
    q, whatever secret coins are drawn (before the fix, a drawn init candidate trained on
    fewer rows than planned and the search stopped, telling that it had been drawn)."""
    data = _write_npz(tmp_path / "data.npz", shift=0)
    options = SupervisedOptions.from_dict(
        {
            "dataset": f"npz:{data}",
            "num_classes": 3,
            "model": "mlp-16",
            "steps": 5,
            "batch_size": 32,
            "learning_rate": 0.1,
            "public_fraction": 0.3,
        }
    )
    pretrain_supervised(options, tmp_path / "prior.pt", quiet=True)
    sizes = set()
    for seed in range(seeds):
        out = tmp_path / f"o{seed}.json"
        assert (
            main(_tune_argv(data, tmp_path / "prior.pt", out, "--set", f"secret_seed={seed}")) == 0
        )
        result = json.loads(out.read_text())
        sizes.add(result["tuning"]["n_train"] + result["tuning"]["n_validation"])
    # the secret split key moves rows between training and validation, never the prior's
    # public slice, which is out of every candidate
    assert len(sizes) == 1
    assert sizes.pop() < 400


def test_weights_trained_on_the_whole_dataset_are_refused_before_any_draw(tmp_path, capsys):
    """The refusal (whose cost would be outside the ledger) comes from the plan, before any
    secret coin, and from the file's record (the dataset it names), never from the rows
    (issue 48): the same one line whatever the draws, no file written."""
    data = _write_npz(tmp_path / "data.npz", shift=0)
    options = SupervisedOptions.from_dict(
        {"dataset": f"npz:{data}", "num_classes": 3, "model": "mlp-16", "steps": 5}
    )
    pretrain_supervised(options, tmp_path / "whole.pt", quiet=True)
    errors = set()
    for seed in range(3):
        out = tmp_path / f"o{seed}.json"
        argv = _tune_argv(data, tmp_path / "whole.pt", out, "--set", f"secret_seed={seed}")
        assert main(argv) == 2
        assert not out.exists()
        errors.add(capsys.readouterr().err.strip())
    assert len(errors) == 1
    assert "the dataset this run protects" in errors.pop()


def test_what_issue_40_changed_changes_the_noise_and_the_checkpoint_identity():
    """A secret_seed never replays an older run's noise on other inputs or rows: runs with
    learner.init (statistics, head) or image_size (rows read at their own size) get another
    secret context, and resized runs another checkpoint identity; other runs keep theirs."""
    from dpvision.config import TrainConfig
    from dpvision.runs.schedule import run_settings

    def context(config: TrainConfig) -> bytes:
        return config.secret_randomness().split_key()

    plain = TrainConfig(method="dp-sgd", secret_seed=3, learner={"model": "mlp-8"})
    init = TrainConfig(method="dp-sgd", secret_seed=3, learner={"model": "mlp-8", "init": "w.pt"})
    resized = TrainConfig(method="dp-sgd", secret_seed=3, image_size=16)
    assert "row_identity" not in run_settings(plain)
    assert run_settings(resized)["row_identity"] == "native"
    assert "init_recipe" in json.dumps(init.secret_randomness().source) or context(init) != context(
        plain
    )
    assert len({context(plain), context(init), context(resized)}) == 3
