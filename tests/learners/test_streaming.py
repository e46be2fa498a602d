"""Reading memory-mapped features: exact values, and the map's pages do not pile up in RSS."""

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dpvision.data import rows as row_reading
from dpvision.learners.statistics import ClassIndex, class_grams, iter_chunks, read_rows

ROWS, DIM, CLASSES, CHUNK = 20000, 64, 20, 2000
CHUNK_BYTES = CHUNK * DIM * 4


@pytest.fixture
def mapped(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """A 20000 × 64 float32 ``.npy`` on disk and its in-memory copy and labels."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, DIM)).astype(np.float32) / 4
    path = tmp_path / "features.npy"
    np.save(path, x)
    return path, x, rng.integers(0, CLASSES, size=ROWS)


def mapped_rss_bytes(path: Path) -> int:
    """Resident bytes of every mapping of ``path`` in this process (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split(maxsplit=5)
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
                inside = len(fields) == 6 and fields[5].rstrip("\n") == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


needs_linux = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"),
    reason="reads /proc/self/smaps and needs MADV_DONTNEED (Linux)",
)


def test_read_rows_matches_the_array(mapped: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, x, _ = mapped
    view = np.load(path, mmap_mode="r")
    rng = np.random.default_rng(1)
    scattered = np.sort(rng.choice(ROWS, size=500, replace=False))
    for rows in (
        slice(0, CHUNK),
        slice(ROWS - 7, ROWS + 100),
        slice(5, 5),
        slice(10, 900, 7),
        scattered,
        rng.permutation(ROWS)[:300],
        np.array([-1, 0, -ROWS]),
        rng.random(ROWS) < 0.1,
        np.array([], dtype=np.int64),
    ):
        got = read_rows(view, rows)
        expected = torch.from_numpy(np.array(x[rows], dtype=np.float64))
        assert got.dtype == torch.float64
        assert torch.equal(got, expected), rows
        assert torch.equal(read_rows(x, rows), expected)  # in memory: the plain copy


def test_small_release_parts_give_the_same_values(
    mapped: tuple[Path, np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, x, _ = mapped
    view = np.load(path, mmap_mode="r")
    # 16-row parts for slices, one 2 MiB block per part for row numbers.
    monkeypatch.setattr(row_reading, "RELEASE_BYTES", 16 * DIM * 4)
    rows = np.sort(np.random.default_rng(2).choice(ROWS, size=3000, replace=False))
    for selection in (slice(3, 5003), rows):
        assert torch.equal(read_rows(view, selection), torch.from_numpy(x[selection].astype(float)))


def test_chunks_and_class_grams_match_the_array(
    mapped: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    path, x, y = mapped
    view = np.load(path, mmap_mode="r")
    for (got, got_y), (expected, expected_y) in zip(
        iter_chunks(view[100:], y[100:], chunk_size=CHUNK),
        iter_chunks(x[100:], y[100:], chunk_size=CHUNK),
        strict=True,
    ):
        assert torch.equal(got, expected)
        assert got_y is not None
        assert expected_y is not None
        assert torch.equal(got_y, expected_y)
    index = ClassIndex(y, CLASSES)
    classes = range(3, 11)
    assert torch.equal(
        class_grams(view, index, classes, clip_norm=1.0, chunk_size=CHUNK),
        class_grams(x, index, classes, clip_norm=1.0, chunk_size=CHUNK),
    )


@needs_linux
def test_a_full_pass_leaves_at_most_a_chunk_resident(
    mapped: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    path, x, y = mapped
    touched = np.load(path, mmap_mode="r")
    float(np.asarray(touched).sum())  # plain reading keeps every page of the file resident
    assert mapped_rss_bytes(path) >= x.nbytes // 2  # (and the measurement sees it)
    del touched  # unmaps it
    assert mapped_rss_bytes(path) == 0
    view = np.load(path, mmap_mode="r")
    for _ in iter_chunks(view, chunk_size=CHUNK):
        assert mapped_rss_bytes(path) <= CHUNK_BYTES
    assert mapped_rss_bytes(path) <= CHUNK_BYTES < x.nbytes // 4
    index = ClassIndex(y, CLASSES)
    class_grams(view, index, range(CLASSES), clip_norm=1.0, chunk_size=CHUNK)
    assert mapped_rss_bytes(path) <= CHUNK_BYTES
    rows = np.sort(np.random.default_rng(3).choice(ROWS, size=ROWS // 2, replace=False))
    read_rows(view, rows)
    assert mapped_rss_bytes(path) <= CHUNK_BYTES


@needs_linux
def test_writeable_and_copy_on_write_maps_are_not_dropped(
    mapped: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    path, x, _ = mapped
    private = np.load(path, mmap_mode="c")  # copy-on-write: dropping a page loses the edit
    private[10] = 7.0
    assert (read_rows(private, slice(0, CHUNK))[10] == 7.0).all()
    frozen = private[:]
    frozen.flags.writeable = False  # a read-only view of a copy-on-write map
    assert (read_rows(frozen, np.arange(5, 50))[5] == 7.0).all()
    assert (read_rows(private, slice(0, CHUNK))[10] == 7.0).all()
    assert torch.equal(read_rows(private, slice(11, 20)), torch.from_numpy(x[11:20].astype(float)))
