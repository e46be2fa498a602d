"""benchmarks/small_folders.py: the folders a user would have, and ``--method dp-sgd`` with
nothing but a model learning on one (issue 52: its former fixed defaults, B 256, lr 1,
C 1 and no momentum, trained every model to chance on such a folder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpvision.cli import main
from dpvision.data.datasets import load_dataset
from dpvision.errors import DPVisionError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import small_folders  # noqa: E402 (the benchmark is a script folder, not a package)


@pytest.fixture(scope="module")
def held_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        load_dataset("fashion-mnist", download=False)
    except DPVisionError:
        pytest.skip("needs Fashion-MNIST (DPVISION_DATA)")
    return small_folders.make_folder(tmp_path_factory.mktemp("folders"), "held-out")


def test_the_folder_looks_like_a_users(held_out: Path) -> None:
    classes = sorted(p.name for p in (held_out / "train").iterdir())
    assert classes == ["boot", "sneaker", "tshirt"]
    files = sorted((held_out / "train").rglob("*.png"))
    assert len(files) == 3 * small_folders.TRAIN_PER_CLASS
    sizes = {Image.open(f).size for f in files}
    modes = {Image.open(f).mode for f in files}
    assert len(sizes) > 50  # mixed sizes
    assert modes == {"L", "RGB"}  # grey and tinted RGB
    assert len(list((held_out / "test").rglob("*.png"))) == 3 * small_folders.TEST_PER_CLASS


def test_dp_sgd_with_only_a_model_learns_on_a_small_folder(held_out: Path, tmp_path) -> None:
    """The Tanh CNN under the dp-sgd recipe: measured 93–96 % (benchmarks/results/
    small_folders.md); under the former defaults it scored chance (33 %)."""
    out = tmp_path / "r.json"
    argv = ["train", "-q", "--dataset", f"imagefolder:{held_out}", "--method", "dp-sgd"]
    argv += ["--epsilon", "3", "--set", "image_size=32", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["recipe"]["set"]["learner.batch_size"] == 120
    assert result["epsilon"] <= 3.0
    assert result["test_accuracy"] >= 2 / 3  # at least twice chance
    assert np.isfinite(result["noise_multiplier"])
