"""Shared fixtures: small synthetic classification data with a learnable signal."""

import numpy as np
import pytest


@pytest.fixture
def blobs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 6)) * 2
    y = rng.integers(0, 3, size=400)
    x = centers[y] + rng.normal(size=(400, 6))
    return x[:300], y[:300], x[300:], y[300:]
