"""Preview grids: many synthetic images as one PNG to look at."""

from __future__ import annotations

# local imports: start-up time (heavy modules are imported in the functions using them)
import os
import tempfile
from pathlib import Path

import numpy as np

from dpvision.data.synthetic.common import check_int
from dpvision.data.synthetic.generator import check_kind, generate
from dpvision.errors import DPVisionError


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
    columns = check_int("columns", columns, 1)
    padding = check_int("padding", padding, 0)
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
    from PIL import Image

    kind = check_kind(kind)
    n = check_int("n", n, 1)
    columns = check_int("columns", columns, 1)
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
