"""Reader for the IDX files of MNIST and Fashion-MNIST (plain or gzip-compressed).

An IDX file is a 4-byte magic number ``0x0000TTNN`` (``TT`` the element type, ``0x08`` for
unsigned bytes; ``NN`` the number of dimensions), ``NN`` big-endian ``uint32`` sizes, then the
elements in C order. Image files are ``0x00000803`` ``(N, rows, cols)``; label files are
``0x00000801`` ``(N,)``. The header is parsed here (no third-party parser) and checked against
the number of bytes that follow, so a truncated or corrupt file is reported, never half-read.

The files hold private data; this module only reads them and releases nothing.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from dpvision.errors import DPVisionError

__all__ = [
    "EXPECTED",
    "IDX_IMAGES_MAGIC",
    "IDX_LABELS_MAGIC",
    "MNIST_FILES",
    "find_idx_file",
    "find_idx_files",
    "load_idx_split",
    "read_idx",
]

IDX_IMAGES_MAGIC = 0x00000803
"""Magic number of an IDX file of unsigned-byte images ``(N, rows, cols)``."""
IDX_LABELS_MAGIC = 0x00000801
"""Magic number of an IDX file of unsigned-byte labels ``(N,)``."""

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
"""The four files of an MNIST-style dataset, without the optional ``.gz`` suffix."""

_GZIP_MAGIC = b"\x1f\x8b"
_UBYTE = 0x08


def find_idx_file(folder: Path, stem: str) -> Path | None:
    """Returns ``folder/stem.gz`` or ``folder/stem``, whichever exists (``.gz`` first)."""
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: str | Path, expected_magic: int) -> np.ndarray:
    """Reads an unsigned-byte IDX file, gzip-compressed or not.

    Compression is recognised from the file's first bytes, not its name.

    Args:
        path: The file.
        expected_magic: :data:`IDX_IMAGES_MAGIC` or :data:`IDX_LABELS_MAGIC`.

    Returns:
        A writable ``uint8`` array with the shape given in the header.

    Raises:
        DPVisionError: If the file cannot be read, is not valid gzip, has the wrong magic
            number, or holds a different number of bytes than its header announces.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise DPVisionError(
            f"{path}: not an IDX file ({len(data)} bytes, too short for a header); "
            "replace it with the original file"
        )
    magic = struct.unpack(">I", data[:4])[0]
    if magic != expected_magic:
        kind = "images" if expected_magic == IDX_IMAGES_MAGIC else "labels"
        raise DPVisionError(
            f"{path}: bad IDX magic number 0x{magic:08x} (expected 0x{expected_magic:08x} for "
            f"{kind}); the file is corrupt or not an IDX {kind} file, replace it with the original"
        )
    if (magic >> 8) & 0xFF != _UBYTE:  # pragma: no cover - both accepted magics are ubyte
        raise DPVisionError(f"{path}: only unsigned-byte IDX files are supported")
    ndim = magic & 0xFF
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise DPVisionError(
            f"{path}: truncated IDX header ({len(data)} bytes, need {header_len}); "
            "replace it with the original file"
        )
    shape = struct.unpack(f">{ndim}I", data[4:header_len])
    expected = int(np.prod(shape, dtype=np.int64))
    actual = len(data) - header_len
    if actual != expected:
        what = "truncated" if actual < expected else "corrupt (trailing bytes)"
        raise DPVisionError(
            f"{path}: {what}: header announces shape {tuple(shape)} = {expected} bytes of data "
            f"but the file holds {actual}; replace it with the original file"
        )
    return np.frombuffer(bytearray(memoryview(data)[header_len:]), dtype=np.uint8).reshape(shape)


def load_idx_split(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Reads one split: images ``(N, H, W, 1)`` ``uint8`` and labels ``(N,)`` ``int64``.

    Args:
        images_path: IDX images file (magic ``0x00000803``).
        labels_path: IDX labels file (magic ``0x00000801``).

    Returns:
        ``(images, labels)``.

    Raises:
        DPVisionError: If a file is invalid or the two files disagree on the number of examples.
    """
    images = read_idx(images_path, IDX_IMAGES_MAGIC)
    labels = read_idx(labels_path, IDX_LABELS_MAGIC)
    if len(images) != len(labels):
        raise DPVisionError(
            f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} "
            "labels; the files do not belong together, replace them with the original pair"
        )
    return images[..., np.newaxis], labels.astype(np.int64)


def _read_bytes(path: Path) -> bytes:
    """Returns the (decompressed) content of ``path``, with one-line errors."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DPVisionError(f"{path}: cannot read the file ({exc.strerror or exc})") from exc
    if not raw.startswith(_GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DPVisionError(
            f"{path}: truncated or corrupt gzip data ({exc}); download the file again"
        ) from exc


EXPECTED = ", ".join(f"{stem}[.gz]" for stem in MNIST_FILES.values())
"""The four files, as the lookup's error messages name them."""


def find_idx_files(candidate: Path) -> dict[str, Path] | None:
    """The four IDX files of :data:`MNIST_FILES` in ``candidate``, or ``None`` unless all of
    them are there."""
    found = {key: find_idx_file(candidate, stem) for key, stem in MNIST_FILES.items()}
    if any(path is None for path in found.values()):
        return None
    return {key: path for key, path in found.items() if path is not None}
