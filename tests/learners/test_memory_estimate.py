"""The memory and time of a second-order learner's d×d matrices, checked before they are
allocated (issue 39, items 1-2: DP-LS on 15 552 ScatterNet features of 32×32 RGB images
took 15 GB of 23 and ran for over ten minutes without a word)."""

import json
from pathlib import Path

import numpy as np
import pytest

import dpvision.runs.features as feature_runs
from dpvision.audit import AuditSettings, audit_config, run_audit
from dpvision.audit import targets as audit_targets
from dpvision.cli import main
from dpvision.config import resolve
from dpvision.errors import DPVisionError
from dpvision.learners import LEARNERS, DPLeastSquares, DPNewton, memory

SCATTERNET_32_RGB = 15552  # 3 channels × 81 paths × 8 × 8 (J = 2, L = 8)


@pytest.fixture
def free_bytes(monkeypatch: pytest.MonkeyPatch):
    """Sets the memory the check sees as free."""

    def set_free(count: float | None) -> None:
        monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": count)

    return set_free


def test_dp_ls_on_scatternet_of_32x32_rgb_needs_gigabytes() -> None:
    footprint = DPLeastSquares(target_epsilon=3.0, num_classes=3).footprint(450, SCATTERNET_32_RGB)
    assert footprint is not None
    # The shared αG̃ and one class's statistic, half its noise, its factor, a copy, the
    # eigenvectors and LAPACK's workspace: 7.5 matrices of 1.93 GB (the issue saw 15 GB).
    assert footprint.matrices == 7.5
    assert 14.0e9 < footprint.bytes < 15.0e9
    without_noise = DPLeastSquares(target_epsilon=float("inf"), num_classes=3)
    assert without_noise.footprint(450, SCATTERNET_32_RGB).bytes < footprint.bytes
    newton = DPNewton(target_epsilon=3.0, num_classes=3).footprint(450, SCATTERNET_32_RGB)
    assert newton is not None
    assert newton.bytes > 2 * footprint.bytes
    linear = LEARNERS["dp-sgd-linear"](num_classes=3).footprint(450, SCATTERNET_32_RGB)
    assert linear is not None
    assert linear.matrices == 0
    assert linear.bytes < 1e9


def test_the_refusal_is_one_line_with_the_alternatives(free_bytes) -> None:
    free_bytes(3.1e9)
    learner = DPLeastSquares(target_epsilon=3.0, num_classes=3)
    with pytest.raises(DPVisionError) as error:
        learner.check_resources(450, SCATTERNET_32_RGB)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("DP-LS on 15552 features needs about 14.6 GB")
    assert "3.1 GB are free" in message
    assert 'method = "dp-sgd-linear"' in message
    assert "pool=N" in message
    fits = int(message.split("at most ")[1].split()[0])
    footprint = learner.footprint(450, fits)
    assert footprint is not None
    assert footprint.bytes <= 3.1e9
    assert learner.footprint(450, fits + 1).bytes > 3.1e9  # type: ignore[union-attr]


def test_fit_refuses_before_allocating(free_bytes, monkeypatch) -> None:
    free_bytes(10_000)
    calls = []
    monkeypatch.setattr(DPLeastSquares, "_fit_private", lambda *a: calls.append(a))
    rng = np.random.default_rng(0)
    for name in ("dp-ls", "dp-newton", "dp-fc"):
        with pytest.raises(DPVisionError, match="needs about"):
            LEARNERS[name](target_epsilon=1.0, num_classes=3).fit(
                rng.normal(size=(50, 64)), rng.integers(0, 3, 50)
            )
    assert calls == []


def test_an_accepted_fit_runs_unchanged(free_bytes) -> None:
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(80, 16)), rng.integers(0, 3, 80)
    free_bytes(None)  # unknown: never refused
    unknown = DPLeastSquares(target_epsilon=2.0, num_classes=3, random_state=3).fit(x, y)
    free_bytes(1e12)
    plenty = DPLeastSquares(target_epsilon=2.0, num_classes=3, random_state=3).fit(x, y)
    np.testing.assert_array_equal(unknown.coef_, plenty.coef_)
    # With the noise off DP-LS is still the closed-form ridge solution (the memory trims
    # of the fit change no number).
    exact = DPLeastSquares(target_epsilon=float("inf"), num_classes=3, ridge=0.5).fit(x, y)
    clipped = x / np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    gram = clipped.T @ clipped
    for j in range(3):
        a_j = clipped[y == j].T @ clipped[y == j]
        b_j = clipped[y == j].sum(axis=0)
        theta = np.linalg.solve(a_j + gram + 0.5 * np.eye(16), b_j)
        np.testing.assert_allclose(exact.coef_[j], theta, rtol=1e-8, atol=1e-10)


def test_a_long_fit_is_warned_of_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(memory, "estimate_seconds", lambda footprint, device="cpu": 3600.0)
    monkeypatch.setattr(memory, "_warned", set())
    learner = DPLeastSquares(target_epsilon=3.0, num_classes=3)
    assert learner.check_resources(450, 512) == 3600.0
    learner.check_resources(451, 512)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "DP-LS on 512 features will take about 60 min and 47 MB (3 eigendecompositions of "
        "512×512 matrices): fewer features (feature options pool=N or projection_dim=K) or "
        'method = "dp-sgd-linear" is much faster'
    ]


def test_available_memory_is_read_on_linux() -> None:
    free = memory.available_bytes("cpu")
    assert free is None or free > 0
    if Path("/proc/meminfo").exists():
        assert free is not None


def test_train_refuses_before_extracting_and_writes_nothing(
    free_bytes, monkeypatch, tmp_path, capsys
) -> None:
    free_bytes(20_000)  # digits' 64 pixels need ~0.2 MB for DP-LS

    def extract(*args, **kwargs):
        raise AssertionError("features were extracted before the memory check")

    monkeypatch.setattr(feature_runs, "load_or_extract", extract)
    out = tmp_path / "result.json"
    code = main(["train", "--method", "dp-ls", "--features", "pixels", "--json", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "DP-LS on 64 features needs about" in err
    assert "dp-sgd-linear" in err
    assert "Traceback" not in err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []
    # dp-sgd-linear's memory is linear in d: the same machine trains it.
    monkeypatch.undo()  # the real free memory, the real extraction
    code = main(["train", "--method", "dp-sgd-linear", "--json", str(out)])
    assert code == 0
    assert json.loads(out.read_text())["method"] == "dp-sgd-linear"


def test_audit_refuses_before_extracting(free_bytes, monkeypatch) -> None:
    free_bytes(20_000)

    def extract(*args, **kwargs):
        raise AssertionError("features were extracted before the memory check")

    monkeypatch.setattr(audit_targets, "extract_features", extract)
    config = resolve(None, {"method": "dp-ls"}, [])
    with pytest.raises(DPVisionError, match="DP-LS on 64 features needs about"):
        run_audit(config, AuditSettings(dataset_size=20, runs=4), progress=False)


def test_the_audit_of_auto_trains_a_method_that_fits(free_bytes, capsys) -> None:
    free_bytes(None)
    config, sweep = audit_config(None, {}, [])
    assert config.method == "dp-ls"
    free_bytes(20_000)
    config, sweep = audit_config(None, {}, [])
    assert config.method == "dp-sgd-linear"
    assert sweep == (("learner.clip_norm", (1.0, 10.0)),)
    assert "auditing dp-sgd-linear (memory linear in d) instead" in capsys.readouterr().err
    config, _ = audit_config(None, {"method": "dp-ls"}, [])  # asked for: kept (and refused
    assert config.method == "dp-ls"  # by run_audit in one line if it does not fit)


def test_an_audit_warns_of_its_total_time(monkeypatch, caplog) -> None:
    monkeypatch.setattr(memory, "estimate_seconds", lambda footprint, device="cpu": 2.0)
    config = resolve(None, {"method": "dp-ls"}, [])
    settings = AuditSettings(dataset_size=20, canaries=("noise", "blank"), phase1_runs=50, runs=200)
    from dpvision.audit.harness import audit_trainings, check_audit_resources

    assert audit_trainings(settings) == 2 * 50 * 2 + 2 + 2 * 200 + 1
    total = check_audit_resources(config, config.load_dataset(), settings)
    assert total == 2.0 * 603
    assert any(
        "audit: 603 trainings of dp-ls on 64 features, about 2.0 s each: about 20 min in all"
        in r.getMessage()
        for r in caplog.records
    )
