"""``dpvision train --method dp-sgd``: end to end, checkpoint and resume, bad input.

The data are small synthetic images in the generic ``npz:PATH`` format, written by the tests.
"""

import json
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dpvision.config import resolve
from dpvision.errors import DPVisionError
from dpvision.runs.train import run_training

STEPS = 16
SECRET = 20261126  # replays the runs compared below (never published)


def _write_npz(path: Path, n_train: int = 240, n_test: int = 90, side: int = 28) -> Path:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, n_train + n_test)
    images = (rng.random((n_train + n_test, side, side, 1)) * 60).astype(np.uint8)
    for c in range(3):  # a bright bar whose row depends on the class
        images[labels == c, 4 + 7 * c : 9 + 7 * c, 4:24, 0] += 180
    np.savez(
        path,
        x_train=images[:n_train],
        y_train=labels[:n_train],
        x_test=images[n_train:],
        y_test=labels[n_train:],
    )
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_npz(tmp_path_factory.mktemp("dpsgd") / "bars.npz")


def _sets(**learner: object) -> list[str]:
    options = {
        "batch_size": 32,
        "physical_batch_size": 16,
        "steps": STEPS,
        "learning_rate": 0.5,
        "max_grad_norm": 1.0,
        "augmult": 2,
        "crop_padding": 2,
        "ema_decay": 0.9,
        "checkpoint_every": 1,
        "grad_sample_mode": "vmap",
        **learner,
    }
    return [f"learner.{k}={json.dumps(v)}" for k, v in options.items()]


def _args(data: Path, **learner: object) -> list[str]:
    args = [
        "--dataset",
        f"npz:{data}",
        "--set",
        "num_classes=10",
        "--method",
        "dp-sgd",
        "--noise-multiplier",
        "1.0",
        "--secret-seed",
        str(SECRET),
    ]
    for item in _sets(**learner):
        args += ["--set", item]
    return args


def _config(data: Path, **learner: object):
    return resolve(
        None,
        {
            "dataset": f"npz:{data}",
            "num_classes": 10,
            "method": "dp-sgd",
            "noise_multiplier": 1.0,
            "secret_seed": SECRET,
        },
        _sets(**learner),
    )


def _checkpoint_step(path: Path) -> int:
    try:
        return int(torch.load(path, weights_only=False)["sampler"]["step"])
    except Exception:  # not written yet, or caught mid-replace on another filesystem
        return -1


def test_dpsgd_learns_and_records_every_step(data: Path) -> None:
    result = run_training(_config(data, steps=20), quiet=True)
    assert result["test_accuracy"] > 0.8  # chance is 1/3; measured 1.0
    assert result["steps"] == 20
    assert sum(entry["count"] for entry in result["privacy_ledger"]) == 20
    assert result["privacy_ledger"][0]["sample_rate"] == pytest.approx(32 / 240)
    assert 0 < result["epsilon"] < float("inf")
    assert result["test_accuracy_ema"] is not None


def test_killed_run_resumes_to_the_same_parameters_and_ledger(data: Path, tmp_path: Path) -> None:
    reference = tmp_path / "reference.ckpt"
    expected = run_training(_config(data), quiet=True, checkpoint=reference)
    interrupted = tmp_path / "interrupted.ckpt"
    command = [sys.executable, "-m", "dpvision", "train", *_args(data)]
    process = subprocess.Popen([*command, "--checkpoint", str(interrupted), "--quiet"])
    deadline = time.monotonic() + 120
    while _checkpoint_step(interrupted) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL  # killed mid-run, not finished
    killed_at = _checkpoint_step(interrupted)
    assert 3 <= killed_at < STEPS
    # The checkpoint is as private as the data: its owner's alone. It keeps the run's
    # secret randomness, so the resumed run needs no --secret-seed to continue the streams.
    assert stat.S_IMODE(interrupted.stat().st_mode) == 0o600
    assert torch.load(interrupted, weights_only=True)["secret"]["source"] == "user-secret"
    out = tmp_path / "resumed.json"
    command = [c for c in command if c not in ("--secret-seed", str(SECRET))]
    done = subprocess.run(
        [*command, "--checkpoint", str(interrupted), "--json", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "resumed from" in done.stderr
    resumed = json.loads(out.read_text())
    first = torch.load(reference, weights_only=False)
    second = torch.load(interrupted, weights_only=False)
    for name, value in first["model"].items():
        assert torch.equal(value, second["model"][name]), name
    for name, value in first["ema"]["shadow"].items():
        assert torch.equal(value, second["ema"]["shadow"][name]), name
    assert first["ledger"] == second["ledger"]
    assert resumed["privacy_ledger"] == expected["privacy_ledger"]
    assert resumed["test_accuracy"] == expected["test_accuracy"]


def test_resume_with_another_config_is_refused_and_keeps_the_checkpoint(
    data: Path, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "run.ckpt"
    run_training(_config(data, steps=3), quiet=True, checkpoint=checkpoint)
    before = checkpoint.read_bytes()
    with pytest.raises(DPVisionError, match=r"different configuration.*learner\.learning_rate"):
        run_training(_config(data, steps=3, learning_rate=0.1), quiet=True, checkpoint=checkpoint)
    assert checkpoint.read_bytes() == before
    # Memory knobs may change on resume: same algorithm, same privacy.
    run_training(_config(data, steps=3, physical_batch_size=8), quiet=True, checkpoint=checkpoint)


def test_corrupt_checkpoint_is_a_one_line_error_and_left_alone(data: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "broken.ckpt"
    checkpoint.write_bytes(b"not a checkpoint")
    done = subprocess.run(
        [sys.executable, "-m", "dpvision", "train", *_args(data), "--checkpoint", str(checkpoint)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "cannot read checkpoint" in done.stderr
    assert "Traceback" not in done.stderr
    assert checkpoint.read_bytes() == b"not a checkpoint"


def test_physical_batch_too_large_for_memory_is_a_clear_error(data: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpvision",
            "train",
            *_args(data, augmult=200_000, physical_batch_size=240),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "does not fit in memory" in last
    assert "physical_batch_size=" in last
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("model", '"resnet50"', "unknown model"),
        ("model", '"wrn-15-2"', "depth = 6n"),
        ("optimizer", '"lbfgs"', "unknown learner.optimizer"),
        ("clip_norm", "1.0", "unknown learner option 'clip_norm'"),
        ("ema_decay", "1.0", "ema_decay must be in"),
        ("batch_size", "0", "batch_size must be > 0"),
        ("augmult", "true", "whole number"),
    ],
)
def test_bad_learner_options_are_one_line_errors(
    data: Path, key: str, value: str, message: str
) -> None:
    with pytest.raises(DPVisionError, match=message):
        resolve(
            None,
            {"dataset": f"npz:{data}", "num_classes": 10, "method": "dp-sgd"},
            [f"learner.{key}={value}"],
        )


def test_batch_size_larger_than_the_dataset_is_refused(data: Path) -> None:
    # ... and the message says what would work (N is public: the result reports it)
    message = "exceeds the 240 training examples; try --set learner.batch_size=120"
    with pytest.raises(DPVisionError, match=message):
        run_training(_config(data, batch_size=1000), quiet=True)


def test_no_noise_is_a_non_private_baseline(data: Path) -> None:
    config = resolve(
        None,
        {"dataset": f"npz:{data}", "num_classes": 10, "method": "dp-sgd", "epsilon": float("inf")},
        _sets(steps=3),
    )
    result = run_training(config, quiet=True)
    assert result["epsilon"] == float("inf")
    assert result["noise_multiplier"] is None
