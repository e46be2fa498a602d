"""benchmarks/feature_path.py: the step part times the four cases in one process, checks the
step against the step before, and writes its page (here on a small synthetic matrix)."""

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from tests.benchmarks.scripts import load_script


def _module() -> ModuleType:
    return load_script("feature_path")


def test_the_step_part_times_every_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    bench = _module()
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    argv = ["feature_path.py", "--rows", "600", "--dim", "300", "--batch", "200", "--repeats", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    assert bench.main() == 0
    report = json.loads((tmp_path / "feature_path_step.json").read_text())
    assert set(report["seconds"]) == {"gemm32", "gemm_step", "before", "after"}
    assert all(len(times) == 2 for times in report["all_seconds"].values())
    assert report["relative_difference"] < 1e-10  # the same float64 arithmetic as before
    assert "a step against its matrix products" in (tmp_path / "feature_path_step.md").read_text()


def test_bad_sizes_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    bench = _module()
    monkeypatch.setattr(sys, "argv", ["feature_path.py", "--rows", "10", "--batch", "20"])
    assert bench.main() == 2
    assert capsys.readouterr().err.count("\n") == 1
