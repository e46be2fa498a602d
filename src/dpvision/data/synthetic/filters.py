"""``oriented-filters``: an untrained convolutional generator whose 3×3 filters come from a
bank of oriented edges and lines (a simplified "StyleGAN-oriented")."""

from __future__ import annotations

# local imports: start-up time (heavy modules are imported in the functions using them)
import functools
import math

import numpy as np

from dpvision.data.synthetic.common import recolour
from dpvision.data.synthetic.spectral import spectral_noise

# Oriented filters: base resolution, feature channels, random-weight ranges.
_BASE_RESOLUTION = 4


_WIDTH = 16


_CONVS_PER_STAGE = 2


_PINK_ALPHA = (0.5, 1.5)


_BIAS = 0.2


_NOISE_STRENGTH = 0.3


def _unit(f: np.ndarray, zero_mean: bool) -> np.ndarray:
    if zero_mean:
        f = f - f.mean()
    return f / np.linalg.norm(f)


@functools.lru_cache(maxsize=1)
def _filter_bank() -> tuple[np.ndarray, tuple[str, ...]]:
    y, x = np.mgrid[-1:2, -1:2].astype(np.float64)  # y down, x right
    filters, names = [], []
    for i in range(8):
        theta = np.deg2rad(22.5 * i)
        across = x * np.cos(theta) + y * np.sin(theta)  # signed distance across the edge
        filters.append(_unit(np.clip(2.0 * across, -1.0, 1.0), zero_mean=True))
        names.append(f"edge-{22.5 * i:g}")
    for i in range(8):
        theta = np.deg2rad(22.5 * i)
        off_line = np.abs(y * np.cos(theta) - x * np.sin(theta))  # distance to the line
        filters.append(_unit(np.maximum(0.0, 1.0 - off_line), zero_mean=True))
        names.append(f"line-{22.5 * i:g}")
    surround8 = -np.ones((3, 3))
    surround8[1, 1] = 8.0
    surround4 = np.array([[0.0, -1.0, 0.0], [-1.0, 4.0, -1.0], [0.0, -1.0, 0.0]])
    delta = np.zeros((3, 3))
    delta[1, 1] = 1.0
    blur = np.array([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]])
    filters += [
        _unit(surround8, zero_mean=True),
        _unit(surround4, zero_mean=True),
        _unit(delta, zero_mean=False),
        _unit(blur, zero_mean=False),
    ]
    names += ["centre-surround-8", "centre-surround-4", "delta", "blur"]
    bank = np.stack(filters + [-f for f in filters])
    bank.setflags(write=False)
    return bank, tuple(names + [f"-{name}" for name in names])


def oriented_filter_bank() -> np.ndarray:
    """The 40 3×3 filters of the ``oriented-filters`` generator, each of unit L2 norm.

    Rows 0–7: oriented step edges (clipped ramps across an edge at 0°, 22.5°, …, 157.5°);
    8–15: oriented lines at the same angles; 16–19: an 8-neighbour and a 4-neighbour
    centre-surround filter, a delta (identity) and a 3×3 binomial blur; 20–39: the negatives
    of rows 0–19, in the same order. Edges, lines and centre-surround filters are zero-mean;
    the delta and the blur (and their negatives) are not: they carry the low frequencies
    through the layers. :data:`FILTER_BANK_NAMES` names the rows.

    Privacy: data-independent; uses no private data, costs no privacy.

    Returns:
        float64 ``(40, 3, 3)``, read-only.
    """
    return _filter_bank()[0]


FILTER_BANK_NAMES: tuple[str, ...] = _filter_bank()[1]


def oriented_filters_image(rng: np.random.Generator, size: int, channels: int) -> np.ndarray:
    """One image of the random oriented-filter generator (torch does the arithmetic)."""
    import torch
    import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)

    bank = oriented_filter_bank()
    target = 1 << max(size - 1, 1).bit_length()  # the next power of two >= size
    res = min(_BASE_RESOLUTION, target)
    alpha = rng.uniform(*_PINK_ALPHA)

    def pink(resolution: int) -> torch.Tensor:
        noise = spectral_noise(rng, resolution, alpha, _WIDTH).transpose(2, 0, 1)
        return torch.from_numpy(np.ascontiguousarray(noise, dtype=np.float32))[None]

    subset = rng.choice(len(bank), size=rng.integers(5, len(bank) + 1), replace=False)

    def conv(x: torch.Tensor) -> torch.Tensor:
        """3×3 conv from the bank ("chin-chout") → bias → leaky ReLU."""
        chosen = subset[rng.integers(subset.size, size=(_WIDTH, _WIDTH))]
        scale = rng.standard_normal((_WIDTH, _WIDTH, 1, 1)) / math.sqrt(_WIDTH)
        weight = torch.from_numpy((bank[chosen] * scale).astype(np.float32))
        x = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), weight)
        x = x / (x.std() + 1e-6)  # keeps the activations O(1) whatever the weights
        bias = torch.from_numpy(rng.uniform(-_BIAS, _BIAS, _WIDTH).astype(np.float32))
        return F.leaky_relu(x + bias[None, :, None, None], 0.2)

    def stage(x: torch.Tensor) -> torch.Tensor:
        """``_CONVS_PER_STAGE`` convs, then pink noise of random strength."""
        for _ in range(_CONVS_PER_STAGE):
            x = conv(x)
        return x + float(rng.uniform(0.0, _NOISE_STRENGTH)) * pink(x.shape[-1])

    x = pink(res)
    with torch.no_grad():
        x = stage(x)
        while res < target:
            res *= 2
            x = stage(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False))
        out = rng.standard_normal((channels, _WIDTH)) / math.sqrt(_WIDTH)
        y = np.tensordot(out, x[0].numpy().astype(np.float64), axes=1)  # 1×1 conv
    top = (target - size) // 2
    return recolour(y[:, top : top + size, top : top + size], rng)
