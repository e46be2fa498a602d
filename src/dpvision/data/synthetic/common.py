"""Argument checks and colour helpers shared by the generators."""

from __future__ import annotations

import numpy as np

from dpvision.errors import DPVisionError

MIN_SIZE = 8


MAX_SIZE = 512


# Random re-colouring of a standardised channel: mean ~ N(0.48, 0.15), std ~ N(0.22, 0.06).
_COLOUR_MEAN = (0.48, 0.15)


_COLOUR_STD = (0.22, 0.06)


_MIN_COLOUR_STD = 0.02


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise DPVisionError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise DPVisionError(f"{name} must be {bound}, got {value}")
    return int(value)


def check_shape(size: object, channels: object) -> tuple[int, int]:
    size = check_int("size", size, MIN_SIZE, MAX_SIZE)
    if isinstance(channels, bool) or not isinstance(channels, int | np.integer):
        raise DPVisionError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}")
    if channels not in (1, 3):
        raise DPVisionError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels}")
    return size, int(channels)


def to_uint8(values: np.ndarray) -> np.ndarray:
    return np.round(np.clip(values, 0.0, 1.0) * 255.0).astype(np.uint8)


def recolour(channels_first: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Standardises each channel of (C, H, W), gives it a random mean and std; uint8 (H, W, C)."""
    x = channels_first.astype(np.float64)
    x = x - x.mean(axis=(1, 2), keepdims=True)
    x = x / (x.std(axis=(1, 2), keepdims=True) + 1e-8)
    count = x.shape[0]
    mean = rng.normal(*_COLOUR_MEAN, size=count)
    std = np.maximum(rng.normal(*_COLOUR_STD, size=count), _MIN_COLOUR_STD)
    return to_uint8(mean[:, None, None] + std[:, None, None] * x).transpose(1, 2, 0)
