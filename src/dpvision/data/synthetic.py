"""Synthetic images for DP-RandP Phase I: dead leaves, random oriented filters, spectral noise.

DP-RandP (Tang et al. 2023) learns a feature extractor on images that owe nothing to the
private data, then trains privately on top of it. The images come from the random processes
of Baradad et al. (2021), "Learning to see by looking at noise", re-implemented here:

* ``dead-leaves-squares``, ``dead-leaves-oriented``, ``dead-leaves-mixed``: occluding random
  shapes (:func:`sample_radii` draws their sizes, density ∝ r^-3), as in Baradad et al.'s
  ``generate_datasets/dead_leaves``;
* ``oriented-filters``: an untrained convolutional generator whose 3×3 filters come from a bank
  of oriented edges and lines (:func:`oriented_filter_bank`), a simplified form of their
  "StyleGAN-oriented";
* ``spectral``: colour noise with a 1/f^α amplitude spectrum (:func:`spectral_noise`).

Images are ``uint8`` ``(N, H, W, C)`` like :class:`dpvision.data.ImageDataset`. Image ``i``
of a kind depends only on ``(kind, size, channels, seed, start + i)``: it has its own
``numpy`` generator seeded by ``SeedSequence([seed, start + i, kind id, size, channels])``, so
a stream can be cut into batches any way and resumed at any index. No global random state
is read or changed.

>>> images = generate("dead-leaves-squares", 4, size=16)
>>> images.shape, images.dtype
((4, 16, 16, 3), dtype('uint8'))
>>> resumed = generate("spectral", 3, start=2, channels=1)
>>> bool((resumed[1] == generate("spectral", 4, channels=1)[3]).all())
True

Privacy: data-independent; nothing here reads private data, so the images cost no privacy.
Importing this module does not import torch (only ``oriented-filters`` uses it).
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dpvision.errors import DPVisionError

__all__ = [
    "FILTER_BANK_NAMES",
    "SYNTHETIC_KINDS",
    "generate",
    "oriented_filter_bank",
    "preview_grid",
    "sample_radii",
    "spectral_noise",
    "stream",
    "write_preview",
]

SYNTHETIC_KINDS: tuple[str, ...] = (
    "dead-leaves-squares",
    "dead-leaves-oriented",
    "dead-leaves-mixed",
    "oriented-filters",
    "spectral",
)
# Fixed ids for the seeds (not the position in SYNTHETIC_KINDS, so adding a kind changes nothing).
_KIND_IDS = {
    "dead-leaves-squares": 1,
    "dead-leaves-oriented": 2,
    "dead-leaves-mixed": 3,
    "oriented-filters": 4,
    "spectral": 5,
}
MIN_SIZE = 8
MAX_SIZE = 512

# Dead leaves (Baradad et al.): radii as a fraction of the image size, at most 5000 shapes.
RADIUS_LOW = 0.03
RADIUS_HIGH = 1.0
RADIUS_EXPONENT = 3.0
MAX_SHAPES = 5000
_MIXED_SHAPES = ("circle", "square", "oriented-square", "rectangle", "triangle", "quadrilateral")

# Oriented filters: base resolution, feature channels, random-weight ranges.
_BASE_RESOLUTION = 4
_WIDTH = 16
_CONVS_PER_STAGE = 2
_PINK_ALPHA = (0.5, 1.5)
_BIAS = 0.2
_NOISE_STRENGTH = 0.3
# Spectral noise: α of the 1/f^α amplitude spectrum.
_SPECTRAL_ALPHA = (0.5, 2.5)
# Random re-colouring of a standardised channel: mean ~ N(0.48, 0.15), std ~ N(0.22, 0.06).
_COLOUR_MEAN = (0.48, 0.15)
_COLOUR_STD = (0.22, 0.06)
_MIN_COLOUR_STD = 0.02


# --- checks ---------------------------------------------------------------------------------


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise DPVisionError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise DPVisionError(f"{name} must be {bound}, got {value}")
    return int(value)


def _check_kind(kind: object) -> str:
    if kind not in _KIND_IDS:
        raise DPVisionError(
            f"unknown synthetic image kind {kind!r}; choose from {', '.join(SYNTHETIC_KINDS)}"
        )
    return str(kind)


def _check_shape(size: object, channels: object) -> tuple[int, int]:
    size = _check_int("size", size, MIN_SIZE, MAX_SIZE)
    if isinstance(channels, bool) or not isinstance(channels, int | np.integer):
        raise DPVisionError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}")
    if channels not in (1, 3):
        raise DPVisionError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels}")
    return size, int(channels)


def _image_rng(kind: str, size: int, channels: int, seed: int, index: int) -> np.random.Generator:
    """The generator of image ``index``: a function of these five numbers only."""
    return np.random.default_rng(
        np.random.SeedSequence([seed, index, _KIND_IDS[kind], size, channels])
    )


# --- shared pieces --------------------------------------------------------------------------


def _to_uint8(values: np.ndarray) -> np.ndarray:
    return np.round(np.clip(values, 0.0, 1.0) * 255.0).astype(np.uint8)


def _recolour(channels_first: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Standardises each channel of (C, H, W), gives it a random mean and std; uint8 (H, W, C)."""
    x = channels_first.astype(np.float64)
    x = x - x.mean(axis=(1, 2), keepdims=True)
    x = x / (x.std(axis=(1, 2), keepdims=True) + 1e-8)
    count = x.shape[0]
    mean = rng.normal(*_COLOUR_MEAN, size=count)
    std = np.maximum(rng.normal(*_COLOUR_STD, size=count), _MIN_COLOUR_STD)
    return _to_uint8(mean[:, None, None] + std[:, None, None] * x).transpose(1, 2, 0)


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


def _spectral_image(rng: np.random.Generator, size: int, channels: int) -> np.ndarray:
    alpha = rng.uniform(*_SPECTRAL_ALPHA)
    fields = spectral_noise(rng, size, alpha, channels).transpose(2, 0, 1)  # (C, H, W)
    if channels > 1:  # random colour mixing: correlated channels
        mixing = rng.standard_normal((channels, channels))
        fields = np.tensordot(mixing, fields, axes=1)
    return _recolour(fields, rng)


# --- dead leaves ----------------------------------------------------------------------------


def sample_radii(
    rng: np.random.Generator,
    n: int,
    low: float = RADIUS_LOW,
    high: float = RADIUS_HIGH,
    exponent: float = RADIUS_EXPONENT,
) -> np.ndarray:
    """Radii with density ∝ r^-exponent on [low, high], by inverse transform sampling.

    The dead-leaves default, exponent 3 on [0.03, 1] (Baradad et al.; the scale-invariant
    model of Lee, Mumford and Huang 2001), makes small shapes common and large ones rare.
    Baradad et al. sampled a 200-point grid of the pdf ∝ r^-3 - 1; this is the exact
    continuous distribution.

    Privacy: data-independent; uses no private data, costs no privacy.

    Args:
        rng: The source of randomness.
        n: Number of radii.
        low: Smallest radius, > 0.
        high: Largest radius, > low.
        exponent: The power in the density r^-exponent (any real number).

    Returns:
        float64 ``(n,)`` radii in [low, high].

    Raises:
        DPVisionError: If ``n < 0`` or not ``0 < low < high``.
    """
    n = _check_int("n", n, 0)
    if not 0 < low < high:
        raise DPVisionError(f"radii need 0 < low < high, got low={low}, high={high}")
    u = rng.random(n)
    power = 1.0 - exponent
    if abs(power) < 1e-12:  # density ∝ 1/r: log-uniform
        return np.asarray(low * (high / low) ** u)
    a, b = low**power, high**power
    return np.asarray((a + u * (b - a)) ** (1.0 / power))


def _rectangle_mask(
    px: np.ndarray,
    py: np.ndarray,
    cx: np.ndarray,
    cy: np.ndarray,
    half_w: np.ndarray,
    half_h: np.ndarray,
    angle: np.ndarray,
) -> np.ndarray:
    """(k, U) coverage of U pixels (float32 coordinates) by k rectangles rotated by ``angle``."""
    dx = px[None, :] - cx[:, None]
    dy = py[None, :] - cy[:, None]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    along = dx * cos
    along += dy * sin
    across = dy * cos
    across -= dx * sin
    inside = np.abs(along, out=along) <= half_w[:, None]
    inside &= np.abs(across, out=across) <= half_h[:, None]
    return inside


def _box_mask(
    ix: np.ndarray, iy: np.ndarray, size: int, cx: np.ndarray, cy: np.ndarray, half: np.ndarray
) -> np.ndarray:
    """(k, U) coverage of the pixels (ix, iy) by k axis-aligned squares: separable in x and y."""
    grid = np.arange(size, dtype=np.float32)
    in_x = np.abs(grid[None, :] - cx[:, None]) <= half[:, None]  # (k, size)
    in_y = np.abs(grid[None, :] - cy[:, None]) <= half[:, None]
    if ix.size == size * size:  # every pixel, in raster order
        return (in_y[:, :, None] & in_x[:, None, :]).reshape(len(cx), -1)
    return in_x[:, ix] & in_y[:, iy]


def _polygon_mask(px: np.ndarray, py: np.ndarray, vx: np.ndarray, vy: np.ndarray) -> np.ndarray:
    """(k, U) coverage by k convex polygons with counter-clockwise vertices (k, m)."""
    inside = np.ones((vx.shape[0], px.size), dtype=bool)
    ex, ey = np.roll(vx, -1, axis=1) - vx, np.roll(vy, -1, axis=1) - vy  # edge vectors
    offset = ex * vy - ey * vx  # pixel p is left of edge j when ex·py - ey·px >= offset
    for j in range(vx.shape[1]):
        left = ex[:, j, None] * py[None, :]
        left -= ey[:, j, None] * px[None, :]
        inside &= left >= offset[:, j, None]
    return inside


def _shape_masks(
    rng: np.random.Generator, k: int, size: int, shapes: str, ix: np.ndarray, iy: np.ndarray
) -> np.ndarray:
    """Draws k shapes (front first) and returns their (k, U) coverage of the pixels (ix, iy).

    Pixel centres are at integer coordinates; shape centres are uniform over the image.
    """
    centre = rng.uniform(-0.5, size - 0.5, size=(2, k)).astype(np.float32)
    cx, cy = centre[0], centre[1]
    radius = np.maximum((sample_radii(rng, k) * size).astype(np.int64), 1).astype(np.float32)
    if shapes == "squares":
        return _box_mask(ix, iy, size, cx, cy, radius)
    px, py = ix.astype(np.float32), iy.astype(np.float32)
    angle = rng.uniform(0.0, np.pi / 2, size=k).astype(np.float32)  # squares: mod 90° is all
    if shapes == "oriented":
        return _rectangle_mask(px, py, cx, cy, radius, radius, angle)
    # mixed: every parameter is drawn for every shape, then each shape uses its own.
    kind = rng.integers(len(_MIXED_SHAPES), size=k)
    aspect = rng.uniform(0.2, 1.0, size=k).astype(np.float32)
    wide = rng.random(k) < 0.5
    corners = np.sort(rng.uniform(0.0, 2 * np.pi, size=(k, 4)), axis=1).astype(np.float32)
    inside = np.empty((k, px.size), dtype=bool)

    circle = kind == 0
    if circle.any():
        dx = px[None, :] - cx[circle, None]
        dy = py[None, :] - cy[circle, None]
        dx *= dx
        dy *= dy
        dx += dy
        inside[circle] = dx <= (radius[circle] ** 2)[:, None]
    rect = (kind >= 1) & (kind <= 3)
    if rect.any():
        half_w = np.where((kind == 3) & ~wide, radius * aspect, radius)
        half_h = np.where((kind == 3) & wide, radius * aspect, radius)
        turned = np.where(kind == 2, angle, np.float32(0.0))
        inside[rect] = _rectangle_mask(
            px, py, cx[rect], cy[rect], half_w[rect], half_h[rect], turned[rect]
        )
    poly = kind >= 4
    if poly.any():
        phi = corners[poly]
        triangle = kind[poly] == 4
        phi[triangle, 3] = phi[triangle, 2]  # a repeated vertex: a zero-length edge
        r = radius[poly, None]
        vx, vy = cx[poly, None] + r * np.cos(phi), cy[poly, None] + r * np.sin(phi)
        inside[poly] = _polygon_mask(px, py, vx, vy)
    return inside


def _dead_leaves_labels(
    rng: np.random.Generator, size: int, shapes: str, max_shapes: int = MAX_SHAPES
) -> tuple[np.ndarray, int]:
    """Which shape (0 = frontmost) is visible at each pixel: int64 (size·size,), -1 uncovered.

    Shapes are drawn front to back in chunks; each pixel takes the first shape that covers
    it, and later chunks only test the pixels still uncovered. Returns the labels and the
    number of shapes drawn (≤ ``max_shapes``; drawing stops once every pixel is covered).
    """
    pixels = size * size
    labels = np.full(pixels, -1, dtype=np.int64)
    uncovered = np.arange(pixels)
    limit = max(16, min(1024, (1 << 20) // pixels))  # (chunk × pixels) stays ~1M booleans
    chunk = min(limit, max(16, 2 * size))
    drawn = 0
    while uncovered.size and drawn < max_shapes:
        k = min(chunk, max_shapes - drawn)
        iy, ix = np.divmod(uncovered, size)
        inside = _shape_masks(rng, k, size, shapes, ix, iy)
        front = inside.argmax(axis=0)
        hit = inside[front, np.arange(uncovered.size)]
        labels[uncovered[hit]] = drawn + front[hit]
        uncovered = uncovered[~hit]
        drawn += k
        chunk = min(2 * chunk, limit)
    return labels, drawn


def _dead_leaves_image(
    rng: np.random.Generator, size: int, channels: int, shapes: str
) -> np.ndarray:
    labels, drawn = _dead_leaves_labels(rng, size, shapes)
    # One colour per shape, drawn after the shapes; the last row is the background that shows
    # where 5000 shapes left pixels uncovered (labels -1).
    colours = rng.integers(0, 256, size=(drawn + 1, channels), dtype=np.uint8)
    return colours[labels].reshape(size, size, channels)


# --- oriented filters -----------------------------------------------------------------------


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


def _oriented_filters_image(rng: np.random.Generator, size: int, channels: int) -> np.ndarray:
    """One image of the random oriented-filter generator (torch does the arithmetic)."""
    # local import: start-up time
    import torch

    # local import: start-up time
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
    return _recolour(y[:, top : top + size, top : top + size], rng)


# --- public API -----------------------------------------------------------------------------


def _image(kind: str, rng: np.random.Generator, size: int, channels: int) -> np.ndarray:
    if kind.startswith("dead-leaves-"):
        return _dead_leaves_image(rng, size, channels, kind.removeprefix("dead-leaves-"))
    if kind == "oriented-filters":
        return _oriented_filters_image(rng, size, channels)
    return _spectral_image(rng, size, channels)


def generate(
    kind: str, n: int, *, size: int = 32, channels: int = 3, seed: int = 0, start: int = 0
) -> np.ndarray:
    """Generates ``n`` synthetic images of one kind.

    Image ``i`` depends only on ``(kind, size, channels, seed, start + i)``, so
    ``generate(k, 10, start=5)[3]`` equals ``generate(k, 20)[8]``: a stream can be resumed
    and cut into batches any way.

    Privacy: data-independent; uses no private data, costs no privacy.

    Args:
        kind: One of :data:`SYNTHETIC_KINDS`.
        n: Number of images, ≥ 0.
        size: Height and width in pixels, in [8, 512].
        channels: 1 (grayscale) or 3 (RGB).
        seed: Non-negative seed of the whole stream.
        start: Index of the first image in the stream, ≥ 0.

    Returns:
        uint8 ``(n, size, size, channels)`` (NHWC, like :class:`dpvision.data.ImageDataset`).

    Raises:
        DPVisionError: On an unknown kind or an out-of-range argument.
    """
    kind = _check_kind(kind)
    n = _check_int("n", n, 0)
    size, channels = _check_shape(size, channels)
    seed = _check_int("seed", seed, 0)
    start = _check_int("start", start, 0)
    images = np.empty((n, size, size, channels), dtype=np.uint8)
    for i in range(n):
        rng = _image_rng(kind, size, channels, seed, start + i)
        images[i] = _image(kind, rng, size, channels)
    return images


def stream(
    kind: str,
    *,
    batch_size: int,
    size: int = 32,
    channels: int = 3,
    seed: int = 0,
    start: int = 0,
) -> Iterator[np.ndarray]:
    """Endless batches of synthetic images: batch ``k`` is images ``start + k·batch_size …``.

    Equivalent to ``generate(kind, batch_size, start=start + k * batch_size, ...)`` for
    k = 0, 1, …; the arguments are checked when ``stream`` is called, not at the first batch.

    Privacy: data-independent; uses no private data, costs no privacy.

    Args:
        kind: One of :data:`SYNTHETIC_KINDS`.
        batch_size: Images per batch, ≥ 1.
        size: Height and width in pixels, in [8, 512].
        channels: 1 (grayscale) or 3 (RGB).
        seed: Non-negative seed of the whole stream.
        start: Index of the first image, ≥ 0 (to resume a stream).

    Returns:
        An endless iterator of uint8 ``(batch_size, size, size, channels)`` arrays.

    Raises:
        DPVisionError: On an unknown kind or an out-of-range argument.
    """
    kind = _check_kind(kind)
    batch_size = _check_int("batch_size", batch_size, 1)
    size, channels = _check_shape(size, channels)
    seed = _check_int("seed", seed, 0)
    start = _check_int("start", start, 0)

    def batches() -> Iterator[np.ndarray]:
        first = start
        while True:
            yield generate(kind, batch_size, size=size, channels=channels, seed=seed, start=first)
            first += batch_size

    return batches()


def preview_grid(images: np.ndarray, columns: int = 8, padding: int = 2) -> np.ndarray:
    """Tiles images into one grid image, row by row, on a white background.

    Privacy: data-independent; uses no private data, costs no privacy (it only arranges the
    images it is given: do not pass it private images to publish).

    Args:
        images: uint8 ``(N, H, W, C)`` with N ≥ 1 and C in {1, 3, 4}.
        columns: Images per row, ≥ 1 (fewer when N is smaller).
        padding: White pixels between images and around the grid, ≥ 0.

    Returns:
        uint8 ``(rows·(H + padding) + padding, cols·(W + padding) + padding, C)``.

    Raises:
        DPVisionError: On a wrong dtype or shape, or ``columns < 1`` or ``padding < 0``.
    """
    columns = _check_int("columns", columns, 1)
    padding = _check_int("padding", padding, 0)
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] not in (1, 3, 4):
        raise DPVisionError(
            "preview_grid expects uint8 (N, H, W, C) images with C in {1, 3, 4}, got "
            f"{images.dtype} {images.shape}"
        )
    count, height, width, depth = images.shape
    if count == 0:
        raise DPVisionError("preview_grid needs at least one image, got none")
    cols = min(columns, count)
    rows = -(-count // cols)
    grid = np.full(
        (rows * (height + padding) + padding, cols * (width + padding) + padding, depth),
        255,
        dtype=np.uint8,
    )
    for i in range(count):
        top = padding + (i // cols) * (height + padding)
        left = padding + (i % cols) * (width + padding)
        grid[top : top + height, left : left + width] = images[i]
    return grid


def write_preview(
    kind: str,
    path: str | Path,
    *,
    n: int = 64,
    size: int = 32,
    channels: int = 3,
    seed: int = 0,
    columns: int = 8,
) -> Path:
    """Generates ``n`` images of a kind and writes their grid (:func:`preview_grid`) as a PNG.

    The file is written to a temporary file beside ``path`` and renamed into place, so
    ``path`` is never half-written; missing parent folders are created.

    Privacy: data-independent; uses no private data, costs no privacy.

    Args:
        kind: One of :data:`SYNTHETIC_KINDS`.
        path: Where to write; must end in ``.png``.
        n: Number of images, ≥ 1 (images ``0 … n-1`` of the stream).
        size: Height and width of each image in pixels, in [8, 512].
        channels: 1 (grayscale PNG) or 3 (RGB PNG).
        seed: Non-negative seed of the stream.
        columns: Images per row, ≥ 1.

    Returns:
        The path written.

    Raises:
        DPVisionError: On bad arguments or if the file cannot be written.
    """
    # local import: start-up time
    from PIL import Image

    kind = _check_kind(kind)
    n = _check_int("n", n, 1)
    columns = _check_int("columns", columns, 1)
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise DPVisionError(f"preview path must end in .png, got {str(path)!r}")
    images = generate(kind, n, size=size, channels=channels, seed=seed)
    grid = preview_grid(images, columns=columns)
    picture = Image.fromarray(grid[:, :, 0] if channels == 1 else grid)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
        )
    except OSError as error:
        raise DPVisionError(f"cannot write {path}: {error.strerror or error}") from error
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
        with os.fdopen(handle, "wb") as out:
            picture.save(out, format="PNG")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        raise DPVisionError(f"cannot write {path}: {error.strerror or error}") from error
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
