"""``dead-leaves-*``: occluding random shapes whose radii have density ∝ r⁻³ (Baradad et al.'s
``generate_datasets/dead_leaves``)."""

from __future__ import annotations

import numpy as np

from dpvision.data.synthetic.common import check_int
from dpvision.errors import DPVisionError

# Dead leaves (Baradad et al.): radii as a fraction of the image size, at most 5000 shapes.
RADIUS_LOW = 0.03


RADIUS_HIGH = 1.0


RADIUS_EXPONENT = 3.0


MAX_SHAPES = 5000


_MIXED_SHAPES = ("circle", "square", "oriented-square", "rectangle", "triangle", "quadrilateral")


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
    n = check_int("n", n, 0)
    if not 0 < low < high:
        raise DPVisionError(f"radii need 0 < low < high, got low={low}, high={high}")
    u = rng.random(n)
    power = 1.0 - exponent
    if abs(power) < 1e-12:  # density ∝ 1/r: log-uniform
        return np.asarray(low * (high / low) ** u)
    a, b = low**power, high**power
    return np.asarray((a + u * (b - a)) ** (1.0 / power))


def rectangle_mask(
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


def box_mask(
    ix: np.ndarray, iy: np.ndarray, size: int, cx: np.ndarray, cy: np.ndarray, half: np.ndarray
) -> np.ndarray:
    """(k, U) coverage of the pixels (ix, iy) by k axis-aligned squares: separable in x and y."""
    grid = np.arange(size, dtype=np.float32)
    in_x = np.abs(grid[None, :] - cx[:, None]) <= half[:, None]  # (k, size)
    in_y = np.abs(grid[None, :] - cy[:, None]) <= half[:, None]
    if ix.size == size * size:  # every pixel, in raster order
        return (in_y[:, :, None] & in_x[:, None, :]).reshape(len(cx), -1)
    return in_x[:, ix] & in_y[:, iy]


def polygon_mask(px: np.ndarray, py: np.ndarray, vx: np.ndarray, vy: np.ndarray) -> np.ndarray:
    """(k, U) coverage by k convex polygons with counter-clockwise vertices (k, m)."""
    inside = np.ones((vx.shape[0], px.size), dtype=bool)
    ex, ey = np.roll(vx, -1, axis=1) - vx, np.roll(vy, -1, axis=1) - vy  # edge vectors
    offset = ex * vy - ey * vx  # pixel p is left of edge j when ex·py - ey·px >= offset
    for j in range(vx.shape[1]):
        left = ex[:, j, None] * py[None, :]
        left -= ey[:, j, None] * px[None, :]
        inside &= left >= offset[:, j, None]
    return inside


def shape_masks(
    rng: np.random.Generator, k: int, size: int, shapes: str, ix: np.ndarray, iy: np.ndarray
) -> np.ndarray:
    """Draws k shapes (front first) and returns their (k, U) coverage of the pixels (ix, iy).

    Pixel centres are at integer coordinates; shape centres are uniform over the image.
    """
    centre = rng.uniform(-0.5, size - 0.5, size=(2, k)).astype(np.float32)
    cx, cy = centre[0], centre[1]
    radius = np.maximum((sample_radii(rng, k) * size).astype(np.int64), 1).astype(np.float32)
    if shapes == "squares":
        return box_mask(ix, iy, size, cx, cy, radius)
    px, py = ix.astype(np.float32), iy.astype(np.float32)
    angle = rng.uniform(0.0, np.pi / 2, size=k).astype(np.float32)  # squares: mod 90° is all
    if shapes == "oriented":
        return rectangle_mask(px, py, cx, cy, radius, radius, angle)
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
        inside[rect] = rectangle_mask(
            px, py, cx[rect], cy[rect], half_w[rect], half_h[rect], turned[rect]
        )
    poly = kind >= 4
    if poly.any():
        phi = corners[poly]
        triangle = kind[poly] == 4
        phi[triangle, 3] = phi[triangle, 2]  # a repeated vertex: a zero-length edge
        r = radius[poly, None]
        vx, vy = cx[poly, None] + r * np.cos(phi), cy[poly, None] + r * np.sin(phi)
        inside[poly] = polygon_mask(px, py, vx, vy)
    return inside


def dead_leaves_labels(
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
        inside = shape_masks(rng, k, size, shapes, ix, iy)
        front = inside.argmax(axis=0)
        hit = inside[front, np.arange(uncovered.size)]
        labels[uncovered[hit]] = drawn + front[hit]
        uncovered = uncovered[~hit]
        drawn += k
        chunk = min(2 * chunk, limit)
    return labels, drawn


def dead_leaves_image(
    rng: np.random.Generator, size: int, channels: int, shapes: str
) -> np.ndarray:
    labels, drawn = dead_leaves_labels(rng, size, shapes)
    # One colour per shape, drawn after the shapes; the last row is the background that shows
    # where 5000 shapes left pixels uncovered (labels -1).
    colours = rng.integers(0, 256, size=(drawn + 1, channels), dtype=np.uint8)
    return colours[labels].reshape(size, size, channels)
