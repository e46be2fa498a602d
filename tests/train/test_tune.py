"""``dpvision tune``: the best candidate is found, nothing exact is released, bad specs
are one line."""

import json
import math

import numpy as np
import pytest

from dpvision.accounting import PrivacyLedger
from dpvision.cli import main
from dpvision.config import resolve
from dpvision.errors import DPVisionError
from dpvision.runs.tune import TuneSettings, parse_search, release_score, run_tune


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def separable(tmp_path):
    """Two classes told apart by which half of a 6×6 image is bright."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 3000)
    x = rng.random((3000, 6, 6)) * 60
    x[y == 1, :, :3] += 150
    x[y == 0, :, 3:] += 150
    path = tmp_path / "halves.npz"
    x = x.astype(np.uint8)
    np.savez(path, x_train=x[:2500], y_train=y[:2500], x_test=x[2500:], y_test=y[2500:])
    return path


def test_the_best_candidate_is_found_whenever_it_is_drawn(separable):
    """ScatterNet keeps no layout of 6×6 images (chance, measured 53 %); the pixels separate
    the halves (100 %). Whenever K's runs draw the good candidate it is the one released,
    and with E[K] = 6 it is drawn in most seeds (probability 1 − E[(1/2)^K] = 6/7 each).
    DP-FC trains in a fraction of DP-SGD's time and tells the features apart as clearly."""
    search = parse_search(["features='scatternet','pixels'"])
    found = 0
    for seed in range(4):
        base = resolve(
            sets=[f"dataset='npz:{separable}'", "num_classes=2", "method='dp-fc'", f"seed={seed}"]
        )
        result, model = run_tune(base, search, TuneSettings(mean_runs=6.0), quiet=True)
        drawn = result["tuning"]["drawn"]
        assert model is not None
        assert len(drawn) == result["tuning"]["runs"] >= 1
        if 1 in drawn:
            assert result["selected"]["candidate"] == 1
            assert result["test_accuracy"] > 0.95
            found += 1
        assert result["epsilon"] <= 3.0
    assert found >= 3


def test_nothing_exact_about_the_validation_examples_is_released(separable, tmp_path):
    out = tmp_path / "tuned.json"
    saved = tmp_path / "tuned.safetensors"
    argv = [
        "tune", "--quiet", "--dataset", f"npz:{separable}", "--set", "num_classes=2",
        "--set", "learner.epochs=3", "--search", "learner.learning_rate=0.1,0.5",
        "--mean-runs", "2", "--epsilon", "2", "--json", str(out), "--save", str(saved),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert not [key for key in result if key.startswith("validation_") and "noisy" not in key]
    assert "history" not in result
    ledger = PrivacyLedger.from_dict({**_ledger_header(), "entries": result["privacy_ledger"]})
    assert ledger.epsilon(1e-5, "rdp") == pytest.approx(result["epsilon"], rel=1e-12)
    assert result["epsilon"] <= 2.0
    # the saved model carries the selection's ledger, not the single run's
    assert main(["evaluate", "--quiet", str(saved), "--dataset", f"npz:{separable}"]) == 0


def _ledger_header():
    return {"format": "dpvision-ledger/1", "neighboring_relation": "add_or_remove_one"}


def test_the_score_moves_by_at_most_one_when_a_validation_example_is_added():
    """Neighbouring validation sets (one added example, whatever its norm), noise off: the
    count of correct examples — the score's release — moves by at most its sensitivity 1."""
    rng = np.random.default_rng(0)
    coef = rng.normal(size=(3, 5))
    x, y = rng.normal(size=(50, 5)), rng.integers(0, 3, 50)
    huge = np.full((1, 5), 1e12)
    for label in range(3):
        neighbour_x, neighbour_y = np.vstack([x, huge]), np.append(y, label)
        counts = [
            int(((features @ coef.T).argmax(1) == labels).sum())
            for features, labels in ((x, y), (neighbour_x, neighbour_y))
        ]
        scores = [release_score(c, 0.0, np.random.default_rng(1)) for c in counts]
        assert abs(scores[1] - scores[0]) <= 1
    assert release_score(10, 5.0, np.random.default_rng(1)) != 10  # noise on by default use
    with pytest.raises(DPVisionError, match="score noise must be >= 0"):
        release_score(10, -1.0, np.random.default_rng(1))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give at least one --search"),
        (["--search", "learner.learning_rate"], "--search expects KEY=V1,V2"),
        (["--search", "=1,2"], "--search expects KEY=V1,V2"),
        (["--search", "learner.learning_rate=1,,2"], "none empty"),
        (["--search", "learner.learning_rate="], "none empty"),
        (["--search", "learner.learning_rate=1,1"], "a value is listed twice"),
        (["--search", "learner.epochs=1,2", "--search", "learner.epochs=3"], "searched twice"),
        (["--search", "epsilon=1,2"], "epsilon is fixed by the selection"),
        (["--search", "learner.lerning_rate=1,2"], "unknown learner option 'lerning_rate'"),
        (["--search", "learner.epochs=1,-2"], "epochs"),
        (["--search", "learner.epochs=1,2", "--distribution", "zipf"], "unknown distribution"),
        (["--search", "learner.epochs=1,2", "--distribution", "tnb:-1"], "unknown distribution"),
        (["--search", "learner.epochs=1,2", "--mean-runs", "0.5"], "mean number of runs"),
        (["--search", "learner.epochs=1,2", "--epsilon", "inf"], "needs a finite target"),
        (["--search", "learner.epochs=1,2", "--method", "dp-randp"], "dp-randp"),
        (
            ["--search", "learner.epochs=1,2", "--set", "preprocessing.kind=center"],
            "makes releases of its own",
        ),
    ],
)
def test_bad_searches_are_one_line_before_any_training(argv, message, capsys, tmp_path):
    out = tmp_path / "never.json"
    code = main(["tune", "--quiet", "--json", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_more_runs_cost_more_noise():
    """The selection's price: a larger E[K] needs a larger factor on every run's σ."""
    base = resolve(sets=["method='dp-sgd-linear'", "features='pixels'", "learner.epochs=1"])
    search = parse_search(["learner.learning_rate=0.1,0.2"])
    scales = []
    for mean in (1.0, 4.0, 16.0):
        result, _ = run_tune(base, search, TuneSettings(mean_runs=mean), quiet=True)
        scales.append(result["tuning"]["noise_scale"])
    assert 1.0 < scales[0] < scales[1] < scales[2]
    assert math.isfinite(scales[2])


def test_the_python_entry_point_mirrors_the_command(tmp_path):
    import dpvision

    saved = tmp_path / "m.safetensors"
    result, model = dpvision.tune(
        ["learner.learning_rate=0.1,0.5"],
        dataset="digits",
        epsilon=2.0,
        mean_runs=2,
        learner={"epochs": 2},
        save=saved,
    )
    assert result["epsilon"] <= 2.0
    assert result["selected"]["setting"]["learner.learning_rate"] in (0.1, 0.5)
    assert dpvision.load_model(saved).epsilon == result["epsilon"]
    assert model.predict(np.zeros((2, 8, 8, 1), dtype=np.uint8)).shape == (2,)
    with pytest.raises(DPVisionError, match="give at least one --search"):
        dpvision.tune([], dataset="digits")
