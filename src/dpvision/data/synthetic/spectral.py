"""``spectral``: colour noise with a 1/f^α amplitude spectrum."""

from __future__ import annotations

import functools

import numpy as np

from dpvision.data.synthetic.common import recolour

# Spectral noise: α of the 1/f^α amplitude spectrum.
_SPECTRAL_ALPHA = (0.5, 2.5)


@functools.lru_cache(maxsize=32)
def _radial_frequency(size: int) -> np.ndarray:
    """|f| in cycles per pixel on the ``rfft2`` grid of a size × size image (read-only)."""
    fy = np.fft.fftfreq(size)[:, None]
    fx = np.fft.rfftfreq(size)[None, :]
    radius = np.sqrt(fy * fy + fx * fx)
    radius.setflags(write=False)
    return radius


def spectral_noise(
    rng: np.random.Generator, size: int, alpha: float, channels: int = 1
) -> np.ndarray:
    """Independent noise fields whose amplitude spectrum falls as 1/f^α.

    Each channel is white complex Gaussian noise on the ``rfft2`` grid (random phase, Rayleigh
    amplitude) multiplied by ``|f|^-α`` (0 at f = 0), transformed back: its expected power
    spectrum is ∝ f^-2α (α = 1: pink noise). The fields are periodic (they tile seamlessly).

    Privacy: data-independent; uses no private data, costs no privacy.

    Args:
        rng: The source of randomness.
        size: Height and width in pixels.
        alpha: Spectral exponent α ≥ 0 (0: white noise; larger: smoother).
        channels: Number of independent fields.

    Returns:
        float64 ``(size, size, channels)``, each channel with mean 0 and standard deviation 1.
    """
    radius = _radial_frequency(size)
    amplitude = np.zeros_like(radius)
    np.power(radius, -float(alpha), out=amplitude, where=radius > 0)
    shape = (channels, *radius.shape)
    coefficients = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    fields = np.fft.irfft2(coefficients * amplitude, s=(size, size))
    fields -= fields.mean(axis=(1, 2), keepdims=True)
    fields /= fields.std(axis=(1, 2), keepdims=True) + 1e-12
    return fields.transpose(1, 2, 0)


def spectral_image(rng: np.random.Generator, size: int, channels: int) -> np.ndarray:
    alpha = rng.uniform(*_SPECTRAL_ALPHA)
    fields = spectral_noise(rng, size, alpha, channels).transpose(2, 0, 1)  # (C, H, W)
    if channels > 1:  # random colour mixing: correlated channels
        mixing = rng.standard_normal((channels, channels))
        fields = np.tensordot(mixing, fields, axes=1)
    return recolour(fields, rng)
