"""``dpvision train --method dp-randp``: Phases II and III in one DP-SGD run with one ledger."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dpvision.accounting import PrivacyLedger
from dpvision.config import resolve
from dpvision.errors import DPVisionError
from dpvision.models.encoder import read_encoder
from dpvision.runs.train import run_training
from dpvision.training.pretrain import pretrain
from dpvision.training.pretrain_options import PretrainOptions

STEPS = 12
SIDE = 12


def _write_npz(path: Path, n_train: int = 300, n_test: int = 90) -> Path:
    """Three classes, one random process each (the classifier must tell them apart)."""
    from dpvision.data.synthetic import generate

    kinds = ("dead-leaves-squares", "spectral", "dead-leaves-oriented")
    labels = np.arange(n_train + n_test) % 3
    images = np.empty((n_train + n_test, SIDE, SIDE, 1), np.uint8)
    for label, kind in enumerate(kinds):
        chosen = labels == label
        images[chosen] = generate(kind, int(chosen.sum()), size=SIDE, channels=1, seed=7)
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
    folder = tmp_path_factory.mktemp("randp")
    options = PretrainOptions.from_dict(
        {
            "model": "mlp-16",
            "synthetic": "dead-leaves-mixed",
            "size": SIDE,
            "channels": 1,
            "num_images": 256,
            "batch_size": 64,
            "steps": 20,
        }
    )
    pretrain(options, folder / "enc.pt", quiet=True)
    return {"data": _write_npz(folder / "bars.npz"), "encoder": folder / "enc.pt"}


def _config(files: dict[str, Path], *sets: str, epsilon: float = 2.0):  # type: ignore[no-untyped-def]
    learner = {
        "model": "mlp-16",
        "batch_size": 60,
        "physical_batch_size": 32,
        "steps": STEPS,
        "learning_rate": 0.5,
        "phase2_learning_rate": 2.0,
        "ema_decay": 0.9,
        "checkpoint_every": 1,
        "encoder": str(files["encoder"]),
    }
    items = [f"learner.{k}={json.dumps(v)}" for k, v in learner.items()]
    return resolve(
        overrides={
            "dataset": f"npz:{files['data']}",
            "num_classes": 10,
            "method": "dp-randp",
            "epsilon": epsilon,
            "accountant": "rdp",  # fast; the split and the ledger do not depend on it
            "secret_seed": 31,  # runs compared below replay the same secret randomness
        },
        sets=items + list(sets),
    )


def _ledger_of_one_composition(result: dict[str, object]) -> PrivacyLedger:
    ledger = PrivacyLedger()
    ledger.record(
        noise_multiplier=float(result["noise_multiplier"]),  # type: ignore[arg-type]
        sample_rate=float(result["sample_rate"]),  # type: ignore[arg-type]
        count=STEPS,
        released="DP-SGD clipped gradient sum",
        l2_sensitivity=1.0,
    )
    return ledger


@pytest.mark.parametrize("phase2_steps", [0, 5, STEPS])
def test_ledger_is_one_poisson_gaussian_composition_over_all_steps(
    files: dict[str, Path], phase2_steps: int
) -> None:
    result = run_training(_config(files, f"learner.phase2_steps={phase2_steps}"), quiet=True)
    expected = _ledger_of_one_composition(result)
    assert result["privacy_ledger"] == expected.to_dict()["entries"]
    assert result["steps"] == STEPS
    assert result["phase2_steps"] == phase2_steps
    assert result["phase3_steps"] == STEPS - phase2_steps
    assert result["epsilon"] == pytest.approx(expected.epsilon(1e-5, "rdp"), rel=1e-12)
    assert result["epsilon"] <= 2.0
    if phase2_steps:
        assert 0 < result["phase2_epsilon"] <= result["epsilon"]
    else:
        assert result["phase2_epsilon"] == 0.0


def _checkpointed(
    files: dict[str, Path], tmp_path: Path, name: str, *sets: str
) -> dict[str, object]:
    path = tmp_path / name
    run_training(_config(files, *sets), quiet=True, checkpoint=path)
    payload: dict[str, object] = torch.load(path, weights_only=False)
    return payload


def test_phase_two_trains_only_the_head_and_phase_three_everything(
    files: dict[str, Path], tmp_path: Path
) -> None:
    _, encoder = read_encoder(files["encoder"])
    probe = _checkpointed(files, tmp_path, "probe.ckpt", f"learner.phase2_steps={STEPS}")
    model = probe["model"]
    assert isinstance(model, dict)
    for name, value in encoder.items():  # linear probing only: the body never moves
        assert torch.equal(model[name], value), name
    full = _checkpointed(files, tmp_path, "full.ckpt", "learner.phase2_steps=4")
    model = full["model"]
    assert isinstance(model, dict)
    for name, value in encoder.items():  # Phase III moved the body
        assert not torch.equal(model[name], value), name
    ema = full["ema"]
    assert isinstance(ema, dict)
    assert ema["step"] == STEPS


def test_phase_two_uses_its_own_learning_rate(files: dict[str, Path], tmp_path: Path) -> None:
    slow = _checkpointed(
        files,
        tmp_path,
        "a.ckpt",
        f"learner.phase2_steps={STEPS}",
        "learner.phase2_learning_rate=1e-9",
        "epsilon=inf",
    )
    model = slow["model"]
    assert isinstance(model, dict)
    head = [k for k in model if k.startswith("layers.3")]
    assert head
    # With a tiny learning rate the zero-mean start of the head barely moves.
    fast = _checkpointed(files, tmp_path, "b.ckpt", f"learner.phase2_steps={STEPS}", "epsilon=inf")
    fast_model = fast["model"]
    assert isinstance(fast_model, dict)
    moved_slow = sum(float((model[k] - fast_model[k]).abs().sum()) for k in head)
    assert moved_slow > 0.01


def test_phase2_fraction_picks_the_most_steps_within_the_share(files: dict[str, Path]) -> None:
    from dpvision.training.options import DPSGDOptions
    from dpvision.training.transfer import phase2_steps_for

    config = _config(files, "learner.phase2_fraction=0.5")
    options = DPSGDOptions.from_dict(config.learner)
    sigma, q = 1.2, 0.2
    n1 = phase2_steps_for(
        options, sigma, q, 200, PrivacyLedger(), delta=config.delta, accountant=config.accountant
    )

    def epsilon(count: int) -> float:
        ledger = PrivacyLedger()
        ledger.record(noise_multiplier=sigma, sample_rate=q, count=count, released="x")
        return ledger.epsilon(1e-5, "rdp")

    total = epsilon(200)
    assert 0 < n1 < 200
    assert epsilon(n1) <= 0.5 * total < epsilon(n1 + 1)

    result = run_training(config, quiet=True)
    assert result["phase2_epsilon_fraction"] <= 0.5
    assert result["phase2_steps"] + result["phase3_steps"] == STEPS
    one = run_training(_config(files, "learner.phase2_fraction=1"), quiet=True)
    assert one["phase2_steps"] == STEPS
    assert one["phase2_epsilon_fraction"] == pytest.approx(1.0)


def test_resume_across_the_phase_boundary_is_exact(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(files, "learner.phase2_steps=4")
    reference = tmp_path / "reference.ckpt"
    run_training(config, quiet=True, checkpoint=reference)

    from dpvision.training import DPSGDStep

    original = DPSGDStep.__call__
    calls = {"n": 0}

    def interrupted(self: DPSGDStep, batches):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 8:  # in Phase III, after the switch at step 4
            raise KeyboardInterrupt
        return original(self, batches)

    monkeypatch.setattr(DPSGDStep, "__call__", interrupted)
    resumed = tmp_path / "resumed.ckpt"
    with pytest.raises(KeyboardInterrupt):
        run_training(config, quiet=True, checkpoint=resumed)
    monkeypatch.setattr(DPSGDStep, "__call__", original)
    result = run_training(config, quiet=True, checkpoint=resumed)
    a = torch.load(reference, weights_only=False)
    assert a["config"]["learner"]["encoder_sha256"]  # the encoder's bytes are in the fingerprint
    b = torch.load(resumed, weights_only=False)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["ledger"] == b["ledger"]
    assert result["privacy_ledger"][0]["count"] == STEPS


def test_three_phases_from_the_pretrain_table(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))
    learner = {
        "model": "mlp-16",
        "batch_size": 60,
        "steps": 6,
        "phase2_steps": 2,
        "learning_rate": 0.5,
    }
    config = resolve(
        overrides={
            "dataset": f"npz:{files['data']}",
            "num_classes": 10,
            "method": "dp-randp",
            "epsilon": 3.0,
            "accountant": "rdp",
            "secret_seed": 31,  # the two runs replay the same secret randomness
        },
        sets=[f"learner.{k}={json.dumps(v)}" for k, v in learner.items()]
        + ["pretrain.steps=5", "pretrain.num_images=128", "pretrain.batch_size=32"],
    )
    first = run_training(config, quiet=True)
    assert first["pretrain"]["cached"] is False
    assert Path(first["encoder"]).parent == tmp_path / "cache" / "encoders"
    second = run_training(config, quiet=True)
    assert second["pretrain"]["cached"] is True
    assert second["test_accuracy"] == first["test_accuracy"]


@pytest.mark.parametrize(
    ("method", "sets", "message"),
    [
        ("dp-sgd", ["learner.encoder='x.pt'"], "belong to --method dp-randp"),
        ("dp-sgd", ["pretrain.steps=3"], r"\[pretrain\] table is for --method dp-randp"),
        ("dp-randp", ["pretrain.model='wrn-16-4'"], "comes from the run"),
        ("dp-randp", ["learner.normalization='dataset'"], "encoder's"),
        ("dp-randp", ["learner.phase2_fraction=1.5"], r"must be in \[0, 1\]"),
        (
            "dp-randp",
            ["learner.phase2_fraction=0.5", "learner.phase2_steps=3"],
            "only one of",
        ),
    ],
)
def test_bad_configurations_are_one_line_errors(method: str, sets: list[str], message: str) -> None:
    with pytest.raises(DPVisionError, match=message):
        resolve(overrides={"method": method}, sets=sets)


def test_encoder_mismatches_are_one_line_errors(files: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(DPVisionError, match=r"learner\.model = 'mlp-16'"):
        run_training(_config(files, "learner.model='mlp-8'"), quiet=True)
    with pytest.raises(DPVisionError, match="not found"):
        run_training(_config(files, f"learner.encoder='{tmp_path / 'none.pt'}'"), quiet=True)
    with pytest.raises(DPVisionError, match="exceeds the run's"):
        run_training(_config(files, "learner.phase2_steps=99"), quiet=True)
    other = tmp_path / "other.npz"
    rng = np.random.default_rng(1)
    np.savez(
        other,
        x_train=rng.integers(0, 255, (80, 10, 10, 1), dtype=np.uint8),
        y_train=rng.integers(0, 2, 80),
        x_test=rng.integers(0, 255, (20, 10, 10, 1), dtype=np.uint8),
        y_test=rng.integers(0, 2, 20),
    )
    with pytest.raises(DPVisionError, match="takes images of shape"):
        run_training(_config(files, f"dataset='npz:{other}'"), quiet=True)


def test_command_line_phase2_fraction(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dpvision.cli import main

    out = tmp_path / "result.json"
    config = _config(files)
    sets = [f"--set=learner.{k}={json.dumps(v)}" for k, v in config.learner.items()]
    argv = ["train", "--dataset", config.dataset, "--set", "num_classes=10"]
    argv += ["--method", "dp-randp", "--epsilon", "2"]
    argv += ["--accountant", "rdp"]
    code = main([*argv, *sets, "--phase2-fraction", "0.4", "--json", str(out), "--quiet"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["config"]["learner"]["phase2_fraction"] == 0.4
    assert result["phase2_epsilon_fraction"] <= 0.4
    assert "Phase II (head)" in capsys.readouterr().out
    assert main([*argv, "--phase2-fraction", "2", "--quiet"]) == 2
    assert "phase2_fraction must be in [0, 1]" in capsys.readouterr().err
