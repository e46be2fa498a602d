"""What dpvision writes is either released (noisy, in the ledger), public, or about test data.

The result JSON of every method is walked field by field; each field must have a
justification below. A new field that is an exact statistic of the training data (such as
the former ``nonfinite_gradients`` count) has none and fails the test. Files dpvision reads
are opened without running code from them.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from dpvision.cli import main
from dpvision.errors import DPVisionError

PUBLIC = "public: the configuration, the dataset's public conventions, or the accounting"
JUSTIFIED = {
    "dataset": PUBLIC,
    "method": PUBLIC,
    "features": PUBLIC,
    "model": PUBLIC,
    "config": PUBLIC + " (the fully resolved config)",
    "seed": PUBLIC,
    "secret_randomness": "public: the source of the secret randomness (os, user-secret, "
    "csprng), never the secret",
    "validation": "public: the validation mode (private or public)",
    "validation_noise": "public: σ_v, calibrated from ε, δ and the planned count",
    "validation_accuracy": "noisy count of correct validation examples over n_validation "
    "(sensitivity 1, in the ledger), or exact where validation = 'public'",
    "n_train": "public by convention: n (as in the papers; the sample rate q = B/n needs it)",
    "n_test": "test data, not private training data",
    "test_split": "public: a single image tree's split_seed and test_fraction (the config); "
    "its test side is evaluation data, released exactly",
    "n_validation": "public by convention, as n: about validation_fraction · n",
    "num_features": "public: the feature extractor's output width, fixed by the config",
    "input_shape": "public: the model's input shape (C, H, W): the dataset's image shape or "
    "the feature maps', fixed by the config",
    "num_parameters": "public: the model architecture, fixed by the config",
    "num_trained_parameters": "public: the architecture and learner.finetune",
    "finetune": PUBLIC,
    "batchnorm": PUBLIC,
    "init": "public: the weight file's path, digest, what it says of its training data, and "
    "whether the head fit (shapes only)",
    "epsilon": "accounting of the ledger (noise multipliers, rates, counts)",
    "epsilon_zcdp": "accounting of the ledger",
    "delta": PUBLIC,
    "accountant": PUBLIC,
    "noise_multiplier": "calibrated from public quantities (ε, δ, q, T)",
    "final_clip_norm": "adaptive clipping: post-processing of the noisy unclipped counts "
    "(None with a fixed C)",
    "steps": "public: from the config and n",
    "sample_rate": "public: B/n",
    "privacy_ledger": "the list of releases that ran (their parameters, not their values)",
    "test_accuracy": "test data, evaluated on the released model (post-processing)",
    "test_accuracy_last": "test data, evaluated on the released model",
    "test_accuracy_ema": "test data, evaluated on the EMA of released models",
    "history": "test accuracies along training (test data, released models)",
    "diverged": "post-processing: whether the released parameters are finite",
    "wall_seconds": "timing (see the README's assumptions: timing is not protected)",
    "train_seconds": "timing (see the README's assumptions)",
    "world_size": PUBLIC,
    "device": "public: the machine's device the run computed on (its name, not its state)",
    "precision": PUBLIC,
    # dp-randp's transfer summary
    "encoder": PUBLIC,
    "encoder_trained_on": "public: what the encoder's own file says",
    "phase2_steps": "public: from the budget split",
    "phase3_steps": "public: from the budget split",
    "phase2_epsilon": "accounting",
    "phase2_epsilon_fraction": "accounting",
    "phase2_parameters": "public: the architecture",
    "pretrain": "public: Phase I options (synthetic data)",
    # dpvision tune
    "tuning": "public calibration, fixed before any secret coin: the search, the candidates, "
    "the distribution of K and its mean, the noise factor and multipliers, σ_v, n_train, "
    "n_validation (never K, the draws, their order or a timing)",
    "selected": "the selection's release: the best run's candidate (accounted; K and the "
    "other runs stay secret)",
    "validation_score_noisy": "the selection's release: the best run's noisy count of correct "
    "validation examples over n_validation (accounted, sensitivity 1, secret noise)",
    "recipe": "public: what the default recipe chose from the config, ε, n and the image "
    "shape, and why",
}
HISTORY_FIELDS = {
    "step",
    "phase",
    "test_accuracy",
    "test_accuracy_ema",
    "validation_accuracy",  # noisy counts (runs/validation.py)
    "validation_accuracy_ema",
}


def _train(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    assert main(["train", "--quiet", "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_every_tune_result_field_is_justified(tmp_path):
    out = tmp_path / "tuned.json"
    argv = ["tune", "--quiet", "--json", str(out), "--set", "learner.epochs=2"]
    argv += ["--search", "learner.learning_rate=0.1,0.5", "--mean-runs", "3"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert not sorted(set(result) - set(JUSTIFIED))
    assert "validation_accuracy" not in result  # exact: never released by tune
    # K, the runs' order and timings stay secret: a total wall time is about K runs' own
    assert not {"wall_seconds", "train_seconds", "history"} & set(result)
    assert set(result["tuning"]) == {
        "search",
        "candidates",
        "distribution",
        "mean_runs",
        "shape",
        "noise_scale",
        "noise_multipliers",
        "score_noise",
        "n_validation",
        "n_train",
    }


def test_every_dp_randp_result_field_is_justified(tmp_path, encoder):
    sets = [f"learner.encoder='{encoder}'", "learner.model='mlp-16'", "learner.steps=4"]
    args = ["--method", "dp-randp"]
    for item in [*sets, "learner.batch_size=64"]:
        args += ["--set", item]
    result = _train(tmp_path, *args)
    assert not sorted(set(result) - set(JUSTIFIED))
    assert {"phase2_steps", "phase2_epsilon"} <= set(result)


@pytest.mark.parametrize(
    "args",
    [
        ["--method", "dp-ls"],
        ["--method", "dp-newton", "--set", "learner.iterations=2"],
        ["--method", "dp-fc", "--set", "learner.epochs=2"],
        ["--method", "dp-sgd-linear", "--set", "learner.epochs=2"],
        ["--method", "dp-sgd", "--set", "learner.model='mlp-8'", "--set", "learner.steps=2"],
        [
            "--method",
            "dp-sgd",
            "--set",
            "learner.model='mlp-8'",
            "--set",
            "learner.steps=2",
            "--set",
            "learner.init='INIT'",
            "--set",
            "learner.finetune='head'",
        ],
    ],
    ids=lambda a: a[1],
)
def test_every_result_field_is_released_public_or_about_test_data(tmp_path, args):
    if "learner.init='INIT'" in args:  # weights of another model: public
        from dpvision.models.registry import build_network

        torch.save(build_network("mlp-8", (1, 8, 8), 10).state_dict(), tmp_path / "w.pt")
        args = [a.replace("INIT", str(tmp_path / "w.pt")) for a in args]
    result = _train(tmp_path, *args)
    unexplained = sorted(set(result) - set(JUSTIFIED))
    assert not unexplained, f"fields without a justification: {unexplained}"
    assert "nonfinite_gradients" not in result
    for entry in result.get("history", []):
        assert set(entry) <= HISTORY_FIELDS
    for entry in result["privacy_ledger"]:
        assert set(entry) <= {
            "mechanism",
            "sampling",
            "noise_multiplier",
            "sample_rate",
            "count",
            "released",
            "l2_sensitivity",
        }


class _Planted:
    """Unpickling this object creates a file: a stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pt"
    torch.save({"format": "dpvision-dpsgd-checkpoint-v1", "payload": _Planted(marker)}, path)
    with path.open("rb") as file:  # the file really would run code when fully unpickled
        assert b"touch" in file.read()
    return path, marker


def test_checkpoints_and_encoders_are_read_without_running_code(planted):
    from dpvision.models.encoder import read_encoder
    from dpvision.training.checkpoint import read_checkpoint as _read_checkpoint

    path, marker = planted
    with pytest.raises(DPVisionError, match="cannot read checkpoint"):
        _read_checkpoint(path)
    with pytest.raises(DPVisionError, match="cannot read encoder"):
        read_encoder(path)
    assert not marker.exists()


def test_no_module_loads_torch_files_with_weights_only_false():
    source = Path(__file__).parents[1] / "src" / "dpvision"
    offenders = [
        str(p) for p in source.rglob("*.py") if "weights_only=False" in p.read_text("utf-8")
    ]
    assert not offenders


@pytest.mark.parametrize("sigma", [1e-6, 1e-9, 1e-12])
def test_exact_gaussian_accountant_handles_tiny_noise(sigma):
    # Before: brentq raised a raw ValueError for σ ≈ 1e-9.
    from dpvision.accounting import PrivacyLedger

    ledger = PrivacyLedger()
    ledger.record(noise_multiplier=sigma, released="x")
    epsilon = ledger.epsilon(1e-5, "gaussian")
    assert math.isfinite(epsilon)
    assert epsilon > 1 / (2 * sigma**2) * 0.99


def test_dp_ls_records_the_class_grams_after_their_noise(monkeypatch):
    import numpy as np

    from dpvision.accounting import PrivacyLedger
    from dpvision.learners import DPLeastSquares, dp_ls

    events = []
    noise = dp_ls.add_symmetric_gaussian_noise_

    def drawn(*args, **kwargs):
        events.append("noise A_j")
        return noise(*args, **kwargs)

    record = PrivacyLedger.record

    def recorded(self, **kwargs):
        events.append(f"record {kwargs['released']}")
        return record(self, **kwargs)

    monkeypatch.setattr(dp_ls, "add_symmetric_gaussian_noise_", drawn)
    monkeypatch.setattr(PrivacyLedger, "record", recorded)
    x = np.random.default_rng(0).normal(size=(30, 4))
    DPLeastSquares(noise_multiplier=2.0, num_classes=3, max_block_bytes=8 * 16).fit(
        x, np.arange(30) % 3
    )
    assert events.count("noise A_j") == 3  # one block per class
    assert events.index("record DP-LS A_j") > max(
        i for i, e in enumerate(events) if e == "noise A_j"
    )
