"""Progress where stderr is not a terminal (a log file, ``2>&1 | tee``, CI): a plain line at
the start of every long phase, then at most every ``LOG_INTERVAL`` seconds (issue 39, items
1-2: an audit and a sweep that printed nothing for minutes)."""

import io
import re
from pathlib import Path

import numpy as np
import pytest

import dpvision.learners.base as learner_base
from dpvision import log
from dpvision.audit import AuditSettings, run_audit
from dpvision.cli import main
from dpvision.config import resolve
from dpvision.features import FeatureSpec, extract_features
from dpvision.learners import DPLeastSquares
from dpvision.log import Progress
from dpvision.report import sweep


@pytest.fixture
def every_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line at every update (the 10 s interval shortened to nothing)."""
    monkeypatch.setattr(log, "LOG_INTERVAL", 0.0)


def _lines(text: str, pattern: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(pattern, line)]


def test_a_plain_line_at_the_start_then_by_time_not_by_item() -> None:
    stream = io.StringIO()
    with Progress(1000, "demo", unit="runs", stream=stream, log_interval=3600) as bar:
        for _ in range(1000):
            bar.update(1)
    # The first line comes at the start; a thousand updates within the interval add none,
    # and the end is logged (a log that stops at "0/1000" reads as a stalled phase).
    assert stream.getvalue() == (
        "[dpvision] demo: 0/1000 runs (  0%) 0 s\n[dpvision] demo: 1000/1000 runs (100%) 0 s\n"
    )
    stream = io.StringIO()
    with Progress(4, "demo", unit="runs", stream=stream, log_interval=0) as bar:
        for _ in range(4):
            bar.update(1)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[dpvision] demo: 0/4 runs (  0%) 0 s"
    assert lines[2].startswith("[dpvision] demo: 2/4 runs ( 50%) 0 s, about 0 s left")
    assert lines[-1].startswith("[dpvision] demo: 4/4 runs (100%)")
    assert len(lines) == 5  # no repeated last line


def test_quiet_silences_the_logged_lines(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        log.configure(-1)
        with Progress(2, "demo") as bar:
            bar.update(2)
        assert capsys.readouterr().err == ""
    finally:
        log.configure()
    with Progress(2, "demo") as bar:
        bar.update(2)
    assert capsys.readouterr().err.startswith("[dpvision] demo: 0/2 images")


def test_the_time_left_leaves_out_the_first_items_set_up(monkeypatch) -> None:
    """The audit's case: its first model took 100 s (data, set-up), the next ones 1 s each;
    "about 9 min left" came from the first alone. The rate counts from the first update."""
    clock = [0.0]
    monkeypatch.setattr(log.time, "monotonic", lambda: clock[0])
    bar = Progress(10, "audit phase I", unit="models", enabled=False)
    bar.__enter__()
    clock[0] = 100.0
    bar.update(1)
    assert bar.render() == "audit phase I: 1/10 models ( 10%) 100 s"  # nothing to go on
    clock[0] = 102.0
    bar.update(2)
    assert bar.render() == "audit phase I: 3/10 models ( 30%) 102 s, about 7 s left"


def test_the_time_left_comes_from_the_estimate_at_first() -> None:
    bar = Progress(100.0, "DP-LS on 15552 features", counts=False, expected_seconds=600)
    bar.update(10.0)
    assert re.fullmatch(r"DP-LS on 15552 features:  10%, 0 s, about 9\.0 min left", bar.render())


def test_a_phase_slower_than_its_estimate_stops_quoting_it(monkeypatch) -> None:
    """The DP-LS case: "about 5 s left" of a fit that took 32 s. Once the phase is behind
    its estimate, the time left follows the rate since the start."""
    clock = [0.0]
    monkeypatch.setattr(log.time, "monotonic", lambda: clock[0])
    bar = Progress(100.0, "DP-LS on 3888 features", counts=False, expected_seconds=6, enabled=False)
    bar.__enter__()
    clock[0] = 0.5  # within the estimate: it is quoted
    assert bar.render().endswith("about 6 s left")
    clock[0] = 20.0
    assert bar.render().endswith("longer than the estimated 6 s")  # nothing done yet
    bar.update(10.0)
    assert bar.render().endswith(", about 3.0 min left")


def test_feature_extraction_shows_progress(capsys, every_update) -> None:
    images = np.random.default_rng(0).integers(0, 256, (12, 8, 8, 1), dtype=np.uint8)
    extract_features(images, FeatureSpec("pixels"), progress=True, batch_size=4)
    err = capsys.readouterr().err
    assert _lines(err, r"^\[dpvision\] pixels: 0/12 images")
    assert _lines(err, r"^\[dpvision\] pixels: 8/12 images .*left")  # from the second batch
    assert _lines(err, r"^\[dpvision\] pixels: 12/12 images \(100%\)")


def test_a_long_dp_ls_fit_shows_its_progress(capsys, every_update, monkeypatch) -> None:
    # Any fit counts as long here: the threshold is lowered below zero.
    monkeypatch.setattr(learner_base, "PROGRESS_SECONDS", -1.0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(120, 32)), rng.integers(0, 3, 120)
    shown = DPLeastSquares(target_epsilon=2.0, num_classes=3, random_state=0).fit(x, y)
    err = capsys.readouterr().err
    assert _lines(err, r"^\[dpvision\] DP-LS on 32 features:   0%, 0 s")
    assert _lines(err, r"^\[dpvision\] DP-LS on 32 features: 100%")
    monkeypatch.setattr(learner_base, "PROGRESS_SECONDS", 5.0)
    silent = DPLeastSquares(target_epsilon=2.0, num_classes=3, random_state=0).fit(x, y)
    assert capsys.readouterr().err == ""  # a fit of milliseconds prints nothing
    np.testing.assert_array_equal(shown.coef_, silent.coef_)  # the display changes nothing


def test_both_audit_phases_show_progress_from_their_start(capsys, every_update) -> None:
    config = resolve(None, {"method": "dp-ls", "epsilon": 4.0}, [])
    settings = AuditSettings(
        dataset_size=30,
        canaries=("noise",),
        sweep=(("learner.clip_norm", (1.0, 5.0)),),
        phase1_runs=2,
        runs=4,
        selection_fraction=0.5,
    )
    run_audit(config, settings, progress=True)
    err = capsys.readouterr().err
    assert _lines(err, r"^\[dpvision\] audit phase I: 0/8 models")
    assert _lines(err, r"^\[dpvision\] audit phase I: 1/8 models \( 12%\) \d+ s$")  # no rate yet
    assert _lines(err, r"^\[dpvision\] audit phase I: 4/8 models .*about .* left")
    assert _lines(err, r"^\[dpvision\] audit phase II: 0/8 models")
    assert _lines(err, r"^\[dpvision\] audit phase II: 8/8 models \(100%\)")
    run_audit(config, settings, progress=False)
    assert "audit phase" not in capsys.readouterr().err


def test_each_run_of_a_sweep_is_announced_with_the_time_left(tmp_path: Path, capsys) -> None:
    config = tmp_path / "ls.toml"
    config.write_text(
        'dataset = "digits"\nmethod = "dp-ls"\nfeatures = "pixels"\naccountant = "rdp"\n'
    )
    sweep([config], epsilons=[1.0, 2.0], seeds=[0], out=tmp_path / "out")
    err = capsys.readouterr().err
    assert _lines(err, r"^\[dpvision\] run 1/2 \(ls_eps1_seed0\.json\)$")
    assert _lines(err, r"^\[dpvision\] run 2/2 \(ls_eps2_seed0\.json\): about \d+ s left$")
    sweep([config], epsilons=[1.0, 2.0], seeds=[0], out=tmp_path / "out", quiet=True)
    assert "run 1/2" not in capsys.readouterr().err


def test_cli_audit_progress_reaches_a_captured_stderr(capsys, every_update) -> None:
    code = main(
        [
            "audit",
            "--method",
            "dp-ls",
            "--epsilon",
            "4",
            "--dataset-size",
            "20",
            "--runs",
            "4",
            "--selection-fraction",
            "0.5",
            "--sweep",
            "none",
            "--canary",
            "noise",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0
    assert _lines(err, r"^\[dpvision\] audit phase II: 0/8 models")
    main(["-q", "audit", "--method", "dp-ls", "--dataset-size", "20", "--runs", "4",
          "--selection-fraction", "0.5", "--sweep", "none", "--canary", "noise"])  # fmt: skip
    assert "audit phase" not in capsys.readouterr().err
