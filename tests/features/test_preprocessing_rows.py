"""A run's training rows and held-out rows reach the preprocessing as views of the cached
features (:class:`~dpvision.data.rows.Rows`): read once, into the one array each becomes,
with the same values as the copies they replace, and a memory map's pages let go."""

import sys
from pathlib import Path

import numpy as np
import pytest

from dpvision.accounting import PrivacyLedger
from dpvision.data import rows as row_reading
from dpvision.data.rows import Rows, gather
from dpvision.features import preprocessing as module
from dpvision.features.preprocessing import PreprocessingConfig, preprocess

CHANNELS = 6
KINDS = [
    PreprocessingConfig(kind="none"),
    PreprocessingConfig(kind="group-norm", groups=3, channels=CHANNELS),
    PreprocessingConfig(kind="private-norm", noise_multiplier=0.0, channels=CHANNELS),
    PreprocessingConfig(kind="center", noise_multiplier=0.0),
]


@pytest.fixture
def cached(tmp_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A read-only memory map of 'cached' train features, and test features."""
    rng = np.random.default_rng(0)
    train = rng.normal(size=(900, CHANNELS * 16)).astype(np.float32)
    np.save(tmp_path / "train.npy", train)
    return np.load(tmp_path / "train.npy", mmap_mode="r"), rng.normal(size=(50, 96)).astype(
        np.float32
    )


@pytest.mark.parametrize("pre", KINDS, ids=lambda p: p.kind)
def test_views_give_what_the_copies_gave(pre, cached, monkeypatch) -> None:
    train, test = cached
    monkeypatch.setattr(module, "CHUNK_BYTES", 37 * 96 * 4)  # chunks of 37 rows
    rng = np.random.default_rng(1)
    side = rng.random(len(train))
    rows, held = np.flatnonzero(side < 0.8), np.flatnonzero(side >= 0.8)
    copies = preprocess(
        pre,
        np.asarray(train[rows]),
        np.concatenate([train[held], test]),
        CHANNELS,
        PrivacyLedger(),
        None,
        noise_off=True,
    )
    views = preprocess(
        pre,
        Rows.of(train, rows),
        Rows.of(train, held) + Rows.of(test),
        CHANNELS,
        PrivacyLedger(),
        None,
        noise_off=True,
    )
    for copy, view in zip(copies[:2], views[:2], strict=True):
        assert view.dtype == np.float32
        assert view.flags.writeable
        np.testing.assert_allclose(view, copy, rtol=1e-6, atol=1e-6)
    for name, value in copies[2].statistics.items():
        np.testing.assert_allclose(views[2].statistics[name], value, rtol=1e-12)


def test_rows_read_in_order_across_parts(cached) -> None:
    train, test = cached
    view = Rows.of(train, np.array([5, 1, 7])) + Rows.of(test)
    assert view.shape == (53, 96)
    assert len(view) == 53
    got = np.concatenate(list(view.chunks(2, np.float64)))
    np.testing.assert_array_equal(got, np.concatenate([train[[5, 1, 7]], test]))


def test_gather_copies_a_slice_of_an_in_memory_array() -> None:
    x = np.arange(12.0).reshape(4, 3)
    got = gather(x, slice(1, 3), np.float64)
    got[0, 0] = -1.0
    assert x[1, 0] == 3.0


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_reading_a_view_lets_the_pages_go(tmp_path: Path, monkeypatch) -> None:
    from tests.learners.test_streaming import mapped_rss_bytes

    path = tmp_path / "big.npy"
    np.save(path, np.random.default_rng(3).normal(size=(6000, 384)).astype(np.float32))
    train = np.load(path, mmap_mode="r")  # 9.2 MB
    bound = 2 * 2**21
    float(np.asarray(train).sum())  # a plain read keeps the whole file mapped ...
    assert mapped_rss_bytes(path) > 2 * bound
    del train
    train = np.load(path, mmap_mode="r")
    monkeypatch.setattr(row_reading, "RELEASE_BYTES", 2**21)
    pre = PreprocessingConfig(kind="group-norm", groups=3, channels=CHANNELS)
    fitted = preprocess(
        pre,
        Rows.of(train, np.arange(0, 6000, 2)),
        Rows.of(train, np.arange(1, 6000, 2)),
        CHANNELS,
        PrivacyLedger(),
        None,
    )
    assert fitted[0].shape == (3000, 384)
    assert mapped_rss_bytes(path) <= bound  # ... the views' reads let it go
