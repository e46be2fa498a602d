"""benchmarks/scatternet_speed.py: one run times kymatio and dpvision on the same images,
checks they agree, and writes its page (here on 300 random images instead of CIFAR-10)."""

import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from tests.benchmarks.scripts import load_script


def _module() -> ModuleType:
    return load_script("scatternet_speed")


class _Images:
    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.train_images = rng.integers(0, 256, (200, 32, 32, 3), dtype=np.uint8)
        self.test_images = rng.integers(0, 256, (100, 32, 32, 3), dtype=np.uint8)


def test_one_run_times_both_and_they_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    bench = _module()
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "load_dataset", lambda name, download: _Images())
    argv = ["scatternet_speed.py", "--images", "300", "--reference-images", "40"]
    monkeypatch.setattr(sys, "argv", argv)
    assert bench.main() == 0
    report = json.loads((tmp_path / "scatternet_speed.json").read_text())
    assert report["features"] == [243 * 8 * 8]
    assert report["max_abs_difference"] < 1e-5  # the same transform as kymatio's
    assert [row["images"] for row in report["rows"]] == [40, 40, 300]
    assert all(row["seconds"] > 0 for row in report["rows"])
    assert "ScatterNet extraction speed" in (tmp_path / "scatternet_speed.md").read_text()


def test_bad_counts_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    bench = _module()
    monkeypatch.setattr(
        sys, "argv", ["scatternet_speed.py", "--images", "10", "--reference-images", "20"]
    )
    assert bench.main() == 2
    assert capsys.readouterr().err.count("\n") == 1
