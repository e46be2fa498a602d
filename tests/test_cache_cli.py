"""``dpvision cache list | clear`` on entries of path-named datasets and long names."""

import re
from pathlib import Path

import numpy as np
import pytest

from dpvision.cli import main
from dpvision.data.core import ImageDataset
from dpvision.features import parse_feature_spec
from dpvision.features.cache import cache_entries, load_or_extract


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit:
        code = int(exit.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _npz(path: Path) -> Path:
    """A tiny synthetic 3-class npz dataset (random pixels: public)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(60, 8, 8, 3), dtype=np.uint8)
    labels = np.arange(60) % 3
    np.savez(path, x_train=images[:40], y_train=labels[:40], x_test=images[40:], y_test=labels[40:])
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("DPVISION_CACHE", str(folder))
    return folder


def test_entries_of_npz_datasets_are_listed_and_cleared(
    tmp_path: Path,
    cache: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name with "." and "-" in its path (``npz:my.v2-set.npz``) makes an entry whose
    file names hold dots; list shows it under its name and clear deletes it."""
    _npz(tmp_path / "my.v2-set.npz")
    monkeypatch.chdir(tmp_path)  # a short name: the file names keep all of it
    name = "npz:my.v2-set.npz"
    train = ["train", "--set", f"dataset={name}", "--set", "num_classes=3"]
    assert _cli(capsys, *train, "--method", "dp-ls", "--features", "pixels", "-q")[0] == 0
    assert _cli(capsys, "train", "--method", "dp-ls", "--features", "pixels:pool=2", "-q")[0] == 0
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 6
    assert any(".v2-set.npz-pixels-" in f for f in files)
    # A write of the npz entry interrupted before its JSON: a hidden temporary file.
    stem = next(f for f in files if f.endswith(".json") and "npz" in f).removesuffix(".json")
    half = stem.replace("-pixels-", "-scatternet-")
    (cache / f".{half}.train.npy.k2j_9x.tmp").write_bytes(b"half")

    code, out, _ = _cli(capsys, "cache", "list")
    assert code == 0
    assert "3 entries" in out
    (line,) = [row for row in out.splitlines() if row.strip().startswith(name)]
    assert stem in line
    assert "incomplete" not in line
    (leftover,) = [row for row in out.splitlines() if "incomplete" in row]
    assert half in leftover
    assert {e.dataset for e in cache_entries(cache)} >= {name, "digits"}

    # --dataset names the npz by its path, relative or not; the leftover (no JSON: known
    # only by its file name) goes with the name it was made under.
    for given, count in ((name, 2), (f"npz:{tmp_path / 'my.v2-set.npz'}", 1)):
        code, out, _ = _cli(capsys, "cache", "clear", "--dataset", given, "--dry-run")
        assert f"would delete {count} feature-cache entries" in out
    assert len(list(cache.iterdir())) == 7
    code, out, _ = _cli(capsys, "cache", "clear", "--older-than", "0")
    assert code == 0
    assert "deleted 3 feature-cache entries" in out
    assert not list(cache.iterdir())


def test_list_aligns_its_columns_on_long_names(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(1)

    def dataset(name: str) -> ImageDataset:
        images = rng.integers(0, 256, size=(6, 8, 8, 1), dtype=np.uint8)
        labels = np.arange(6) % 2
        return ImageDataset(name, images, labels, images[:2], labels[:2], num_classes=2)

    long_name = "imagefolder:/data/a_practitioners_own_images_of_many_shapes"
    load_or_extract(dataset("toy"), parse_feature_spec("pixels"), progress=False)
    spec = parse_feature_spec("pixels:pool=2")
    load_or_extract(dataset(long_name), spec, progress=False)
    code, out, _ = _cli(capsys, "cache", "list")
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("  ")]
    assert len(rows) == 2
    assert any(row.lstrip().startswith(long_name) for row in rows)
    # Each later column starts (the sizes end) at the same place in every row.
    for column in (r"pixels", r"[0-9.]+ [KMG]?B\b", r"ago"):
        ends = {re.search(column, row).end() for row in rows}  # type: ignore[union-attr]
        starts = {re.search(column, row).start() for row in rows}  # type: ignore[union-attr]
        assert len(ends if column != "pixels" else starts) == 1, (column, out)
