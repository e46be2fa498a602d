"""Helpers for the dpvision.features tests: an isolated cache, small synthetic images.

There is no ``conftest.py`` here on purpose: with ``--doctest-modules`` and test folders
without ``__init__.py``, a second ``conftest`` module clashes with ``tests/data/conftest.py``.
Each test module calls :func:`isolate_cache` from its own autouse fixture instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpvision.data import ImageDataset
from dpvision.features import ENV_CACHE


def isolate_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Points HOME and $DPVISION_CACHE at empty folders under tmp_path; returns the cache.

    No test can then read or write a real feature cache.
    """
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    cache = tmp_path / "feature-cache"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv(ENV_CACHE, str(cache))
    return cache


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Runs torch on one thread, then restores the previous count.

    The test tensors are tiny, so a second thread gains nothing; and on a shared 2-core
    machine whose other core is busy, two OpenMP threads make kymatio 10-80x slower.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def random_images(count: int, height: int, width: int, channels: int, seed: int = 0) -> np.ndarray:
    """Uniform random ``uint8`` images ``(count, height, width, channels)``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(count, height, width, channels), dtype=np.uint8)


def make_dataset(
    name: str = "toy", train: int = 12, test: int = 5, shape: tuple[int, int, int] = (28, 28, 1)
) -> ImageDataset:
    """A small random dataset with the given image shape ``(H, W, C)``."""
    images = random_images(train + test, *shape, seed=7)
    labels = np.arange(train + test, dtype=np.int64) % 3
    return ImageDataset(
        name=name,
        train_images=images[:train],
        train_labels=labels[:train],
        test_images=images[train:],
        test_labels=labels[train:],
        num_classes=3,
    )
