"""The generators by name: seeding per image, checks, ``generate`` and ``stream``."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dpvision.data.synthetic.common import check_int, check_shape
from dpvision.data.synthetic.dead_leaves import dead_leaves_image
from dpvision.data.synthetic.filters import oriented_filters_image
from dpvision.data.synthetic.spectral import spectral_image
from dpvision.errors import DPVisionError

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


# --- checks ---------------------------------------------------------------------------------


def check_kind(kind: object) -> str:
    if kind not in _KIND_IDS:
        raise DPVisionError(
            f"unknown synthetic image kind {kind!r}; choose from {', '.join(SYNTHETIC_KINDS)}"
        )
    return str(kind)


def _image_rng(kind: str, size: int, channels: int, seed: int, index: int) -> np.random.Generator:
    """The generator of image ``index``: a function of these five numbers only."""
    return np.random.default_rng(
        np.random.SeedSequence([seed, index, _KIND_IDS[kind], size, channels])
    )


# --- shared pieces --------------------------------------------------------------------------


# --- dead leaves ----------------------------------------------------------------------------


# --- oriented filters -----------------------------------------------------------------------


# --- public API -----------------------------------------------------------------------------


def _image(kind: str, rng: np.random.Generator, size: int, channels: int) -> np.ndarray:
    if kind.startswith("dead-leaves-"):
        return dead_leaves_image(rng, size, channels, kind.removeprefix("dead-leaves-"))
    if kind == "oriented-filters":
        return oriented_filters_image(rng, size, channels)
    return spectral_image(rng, size, channels)


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
    kind = check_kind(kind)
    n = check_int("n", n, 0)
    size, channels = check_shape(size, channels)
    seed = check_int("seed", seed, 0)
    start = check_int("start", start, 0)
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
    kind = check_kind(kind)
    batch_size = check_int("batch_size", batch_size, 1)
    size, channels = check_shape(size, channels)
    seed = check_int("seed", seed, 0)
    start = check_int("start", start, 0)

    def batches() -> Iterator[np.ndarray]:
        first = start
        while True:
            yield generate(kind, batch_size, size=size, channels=channels, seed=seed, start=first)
            first += batch_size

    return batches()
