"""``dpvision tune`` says when its score noise swamps what it must detect, and shows it is
alive without telling how many runs it made (issue 39, items 10 and 2)."""

import io
import math
import re
import sys
import time

import numpy as np
import pytest

from dpvision.accounting import Repetitions
from dpvision.cli import main
from dpvision.config import TrainConfig, resolve
from dpvision.log import configure
from dpvision.runs import tune as tune_module
from dpvision.runs.selection_plan import SCORE_NOISE_WARNING, score_noise_warning
from dpvision.runs.tune import TuneSettings, heartbeat_text, parse_search, release_score, run_tune


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))


def _digits(*sets: str) -> TrainConfig:
    return resolve(
        sets=["dataset='digits'", "method='dp-fc'", "features='pixels'", "learner.epochs=2", *sets]
    )


def test_the_issue_case_warns_with_the_noise_and_the_validation_size_that_would_do():
    # 45 validation examples, σ_v = 12.3: the noisy 71.9 % against 95 % of the issue.
    text = score_noise_warning(12.3, 45, 400)
    assert text is not None
    assert "±27.3 points" in text
    assert "1230 validation examples would bring it to ±1 point" in text
    # The size it names does bring it to 1 point, and from 2 points down it is quiet.
    assert 12.3 / 1230 <= 0.01
    assert score_noise_warning(12.3, 1230, 20_000) is None
    edge = math.ceil(12.3 / SCORE_NOISE_WARNING)
    assert score_noise_warning(12.3, edge, 20_000) is None
    assert score_noise_warning(12.3, edge - 1, 20_000) is not None
    # A fraction to set when the data allow it.
    assert "validation_fraction = 0.062" in str(score_noise_warning(12.3, 100, 19_900))


def test_the_stated_noise_is_the_noise_of_the_released_accuracy():
    # X = σ_v / n_val must be the std of the released score over n_val (the mechanism's own).
    sigma, n_val, correct = 12.3, 45, 40
    rng = np.random.default_rng(0)
    accuracies = [release_score(correct, sigma, rng) / n_val for _ in range(20_000)]
    measured = float(np.std(accuracies))
    stated = float(re.search(r"±([\d.]+) points", str(score_noise_warning(sigma, n_val, 400)))[1])
    assert stated / 100 == pytest.approx(measured, rel=0.03)


def test_tune_warns_on_a_small_validation_split_and_not_on_a_quiet_score(monkeypatch, capsys):
    configure()
    monkeypatch.setattr(Repetitions, "sample", lambda self, rng: 1)
    search = parse_search(["learner.learning_rate=0.1,0.5"])
    result, _ = run_tune(_digits("secret_seed=3"), search, TuneSettings(), quiet=False)
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "points of accuracy" in line]
    assert len(warning) == 1, err
    n_val, sigma = result["tuning"]["n_validation"], result["tuning"]["score_noise"]
    assert f"on {n_val} validation examples" in warning[0]  # public: in the result already
    assert f"±{100 * sigma / n_val:.1f} points" in warning[0]
    # Half the digits held out (~700 examples): ±1.7 points, nothing to say.
    base = _digits("secret_seed=3", "validation_fraction=0.5")
    result, _ = run_tune(base, search, TuneSettings(), quiet=False)
    assert result["tuning"]["score_noise"] / result["tuning"]["n_validation"] < 0.02
    assert "points of accuracy" not in capsys.readouterr().err


def test_what_a_run_writes_itself_is_withheld_whatever_k(monkeypatch, capsys):
    """A run that writes to stdout or stderr directly (a progress bar drawn by a learner or
    the feature extraction, a model factory's print) would count the runs: withheld, and
    the output has the same lines whatever K the coins draw."""
    configure()
    original_fit = tune_module.fit

    def chatty_fit(*args, **kwargs):
        print("bar of one run", file=sys.stderr, flush=True)
        print("print of one run", flush=True)
        return original_fit(*args, **kwargs)

    monkeypatch.setattr(tune_module, "fit", chatty_fit)
    search = parse_search(["learner.learning_rate=0.1,0.5"])
    outputs = {}
    for runs in (1, 3):
        monkeypatch.setattr(Repetitions, "sample", lambda self, rng, runs=runs: runs)
        run_tune(_digits("secret_seed=5"), search, TuneSettings(), quiet=False)
        printed = capsys.readouterr()
        outputs[runs] = printed.err.splitlines() + printed.out.splitlines()
    assert not any("of one run" in line for lines in outputs.values() for line in lines)
    assert len(outputs[1]) == len(outputs[3]), outputs
    # Only the selected candidate's line may differ (the winner is released).
    assert outputs[1][:-1] == outputs[3][:-1], outputs


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_a_heartbeat_of_elapsed_time_only_then_nothing(monkeypatch):
    configure()
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(tune_module, "HEARTBEAT_SECONDS", 0.05)
    original_fit = tune_module.fit

    def slow_fit(*args, **kwargs):
        time.sleep(0.3)
        return original_fit(*args, **kwargs)

    monkeypatch.setattr(tune_module, "fit", slow_fit)
    monkeypatch.setattr(Repetitions, "sample", lambda self, rng: 2)
    search = parse_search(["learner.learning_rate=0.1,0.5"])
    run_tune(_digits("secret_seed=5"), search, TuneSettings(), quiet=False)
    text = terminal.getvalue()
    beats = [
        part
        for part in text.split("\r")
        if part.startswith("[dpvision] tune: ") and "so far" in part
    ]
    assert beats, text
    for beat in beats:  # the elapsed time and the public distribution of K, nothing else
        match = re.fullmatch(
            r"\[dpvision\] tune: (\d+) s so far \(a secret number of runs: (.*)\)\x1b\[K", beat
        )
        assert match, beat
        assert match[2] == "geometric, mean 2"
        assert heartbeat_text(float(match[1]), match[2]) + "\x1b[K" == beat
    assert "\r\x1b[K[dpvision] tune: selected" in text  # erased before the end line


def test_a_log_file_gets_the_tune_lines_without_their_timestamps(tmp_path, monkeypatch):
    # The time between the plan line and the selected one is about K runs' time.
    monkeypatch.setattr(Repetitions, "sample", lambda self, rng: 2)
    log = tmp_path / "log.txt"
    argv = [
        "tune", "--dataset", "digits", "--method", "dp-fc", "--set", "features='pixels'",
        "--set", "learner.epochs=2", "--search", "learner.learning_rate=0.1,0.5",
        "--mean-runs", "2", "--secret-seed", "5", "--log-file", str(log),
    ]  # fmt: skip
    try:
        assert main(argv) == 0
    finally:
        configure()  # closes the log file
    lines = [line for line in log.read_text().splitlines() if "tune: " in line]
    assert len(lines) == 3, lines  # the plan, the score-noise warning, the selected one
    assert not [line for line in lines if re.match(r"\d{4}-\d\d-\d\d", line)], lines
    assert lines[0].startswith("INFO tune: 2 candidates")
