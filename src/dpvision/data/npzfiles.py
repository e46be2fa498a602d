"""Readers for NumPy ``.npz`` datasets: the generic ``npz:PATH`` format and MedMNIST files.

Generic format (``npz:PATH``): an ``.npz`` archive with arrays ``x_train``, ``y_train``,
``x_test``, ``y_test``. Images are ``(N, H, W)`` or ``(N, H, W, C)`` (channels last, ``C`` in
1..4), either ``uint8`` (0..255) or floating point in ``[0, 1]`` (stored as
``round(255 * x)``). Labels are integers ``(N,)`` or ``(N, 1)``, from 0; the number of classes is
the largest label plus one.

MedMNIST format (e.g. ``dermamnist.npz``): arrays ``train_images``, ``train_labels`` (``(N, 1)``),
``val_images``, ``val_labels``, ``test_images``, ``test_labels``. Only train and test are used;
the validation split is ignored (it is not merged into train), so results are comparable with
papers that train on the official training split.

Archives are opened with ``allow_pickle=False``. They hold private data; this module only reads
them and releases nothing.
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dpvision.errors import DPVisionError

__all__ = [
    "ARRAY_KEYS",
    "MEDMNIST_KEYS",
    "as_labels",
    "as_uint8_images",
    "find_medmnist_file",
    "load_array_npz",
    "load_medmnist",
    "read_npy",
    "read_npz",
]

ARRAY_KEYS = ("x_train", "y_train", "x_test", "y_test")
"""Arrays required in a generic ``npz:PATH`` dataset."""
MEDMNIST_KEYS = ("train_images", "train_labels", "test_images", "test_labels")
"""Arrays used from a MedMNIST archive (``val_*`` may be present and is ignored)."""


def read_npz(path: Path, keys: Sequence[str], fix: str) -> dict[str, np.ndarray]:
    """Loads the arrays ``keys`` from an ``.npz`` archive, refusing pickled objects.

    Args:
        path: The archive.
        keys: Arrays that must be present.
        fix: What the user should do if the file is wrong, appended to error messages.

    Returns:
        A dict from key to loaded array.

    Raises:
        DPVisionError: If the file is missing, not an ``.npz`` archive, corrupt, holds
            object arrays, or lacks one of ``keys``.
    """
    if not path.is_file():
        raise DPVisionError(f"{path}: no such file; {fix}")
    try:
        with path.open("rb") as handle:  # np.load leaks its own handle when the zip is bad
            try:
                loaded = np.load(handle, allow_pickle=False)
            except (ValueError, EOFError, zipfile.BadZipFile) as exc:
                raise DPVisionError(
                    f"{path}: not a readable .npz archive ({_first_line(exc)}); {fix}"
                ) from exc
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise DPVisionError(f"{path}: a single .npy array, not an .npz archive; {fix}")
            with loaded:
                return _read_members(path, loaded, keys, fix)
    except OSError as exc:
        raise DPVisionError(f"{path}: cannot read the file ({_first_line(exc)}); {fix}") from exc


def _read_members(
    path: Path, archive: np.lib.npyio.NpzFile, keys: Sequence[str], fix: str
) -> dict[str, np.ndarray]:
    """Reads ``keys`` from an open archive, with one-line errors."""
    missing = [key for key in keys if key not in archive.files]
    if missing:
        found = ", ".join(archive.files) or "none"
        raise DPVisionError(
            f"{path}: missing array(s) {', '.join(missing)} (found: {found}); {fix}"
        )
    arrays = {}
    for key in keys:
        try:
            arrays[key] = archive[key]
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise DPVisionError(
                f"{path}: cannot load array {key!r} ({_first_line(exc)}); {fix}"
            ) from exc
    return arrays


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def as_uint8_images(array: np.ndarray, where: str) -> np.ndarray:
    """Converts images to ``uint8`` ``(N, H, W, C)``.

    Args:
        array: ``(N, H, W)`` or ``(N, H, W, C)``; ``uint8`` (or another integer type with values
            in 0..255) or floating point with values in ``[0, 1]``.
        where: Names the file and array in error messages, e.g. ``"data.npz: x_train"``.

    Returns:
        The images as ``uint8`` ``(N, H, W, C)`` (the input itself when already so).

    Raises:
        DPVisionError: If the shape, dtype or value range is not supported.
    """
    if array.ndim == 3:
        array = array[..., np.newaxis]
    if array.ndim != 4 or not 1 <= array.shape[-1] <= 4:
        hint = ""
        if array.ndim == 4 and array.shape[1] in (1, 3):
            hint = " (channels-first? store (N, H, W, C))"
        raise DPVisionError(
            f"{where}: images must have shape (N, H, W) or (N, H, W, C) with C in 1..4, got "
            f"{array.shape}{hint}"
        )
    if array.dtype == np.uint8:
        return array
    if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        if array.size and (array.min() < 0 or array.max() > 255):
            raise DPVisionError(
                f"{where}: integer images must lie in 0..255, found {array.min()}..{array.max()}"
            )
        return array.astype(np.uint8)
    if np.issubdtype(array.dtype, np.floating):
        if array.size and not np.isfinite(array).all():
            raise DPVisionError(f"{where}: images contain NaN or infinite values")
        if array.size and (array.min() < 0.0 or array.max() > 1.0):
            raise DPVisionError(
                f"{where}: float images must lie in [0, 1], found {array.min():g}..{array.max():g}"
                "; divide by 255 or store uint8"
            )
        return np.rint(array * 255.0).astype(np.uint8)
    raise DPVisionError(f"{where}: images must be uint8 or float, got dtype {array.dtype}")


def as_labels(array: np.ndarray, where: str) -> np.ndarray:
    """Converts labels of shape ``(N,)`` or ``(N, 1)`` to non-negative ``int64`` ``(N,)``.

    Args:
        array: Integer class labels.
        where: Names the file and array in error messages.

    Returns:
        ``int64`` labels of shape ``(N,)``.

    Raises:
        DPVisionError: If the labels are not integers, not one per example, or negative.
    """
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        raise DPVisionError(
            f"{where}: labels must have shape (N,) or (N, 1) (one class per image), got "
            f"{array.shape}"
        )
    if not np.issubdtype(array.dtype, np.integer):
        raise DPVisionError(f"{where}: labels must be integers, got dtype {array.dtype}")
    if array.size and array.min() < 0:
        raise DPVisionError(f"{where}: labels must be >= 0, found {array.min()}")
    return array.astype(np.int64)


def load_array_npz(
    path: Path, num_classes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Reads a generic ``npz:PATH`` dataset (see the module docstring).

    Args:
        path: The ``.npz`` archive.
        num_classes: The number of classes, given by the user (never read off the private
            labels: it fixes the model's output shape); labels must lie below it.

    Returns:
        ``(train_images, train_labels, test_images, test_labels, num_classes)``.

    Raises:
        DPVisionError: If the archive does not follow the format.
    """
    fix = "expected arrays x_train, y_train, x_test, y_test (see dpvision.data.npzfiles)"
    arrays = read_npz(path, ARRAY_KEYS, fix)
    splits = _convert(path, arrays, ("x_train", "y_train"), ("x_test", "y_test"))
    check_labels(path, splits, ("y_train", "y_test"), num_classes, "set num_classes to match")
    return (*splits, num_classes)


def find_medmnist_file(candidate: Path, name: str) -> Path | None:
    """Finds ``<name>.npz`` given the file itself, its folder, or the folder's parent.

    Args:
        candidate: ``.../dermamnist.npz``, the folder holding it, or a parent with ``<name>/``.
        name: The MedMNIST dataset name, e.g. ``"dermamnist"``.

    Returns:
        The path of the archive if it exists, else ``None``.
    """
    filename = f"{name}.npz"
    if candidate.name == filename and candidate.is_file():
        return candidate
    for path in (candidate / filename, candidate / name / filename):
        if path.is_file():
            return path
    return None


def load_medmnist(
    path: Path, num_classes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Reads the train and test splits of a MedMNIST archive (validation is ignored).

    Args:
        path: The archive, e.g. ``dermamnist.npz``.
        num_classes: Number of classes of this MedMNIST dataset; labels must be below it.

    Returns:
        ``(train_images, train_labels, test_images, test_labels)``.

    Raises:
        DPVisionError: If the archive does not follow the MedMNIST format.
    """
    fix = "replace it with the official MedMNIST file (train_images, train_labels, ...)"
    arrays = read_npz(path, MEDMNIST_KEYS, fix)
    splits = _convert(
        path, arrays, ("train_images", "train_labels"), ("test_images", "test_labels")
    )
    check_labels(path, splits, ("train_labels", "test_labels"), num_classes, fix)
    return splits


def check_labels(
    path: Path,
    splits: tuple[np.ndarray, ...],
    keys: tuple[str, str],
    num_classes: int,
    fix: str,
) -> None:
    """Raises a one-line error unless both splits' labels lie in 0..num_classes−1."""
    for labels, key in ((splits[1], keys[0]), (splits[3], keys[1])):
        if labels.size and labels.max() >= num_classes:
            raise DPVisionError(
                f"{path}: {key} has labels outside [0, {num_classes}) but this dataset has "
                f"{num_classes} classes; {fix}"
            )


def _convert(
    path: Path, arrays: dict[str, np.ndarray], train: tuple[str, str], test: tuple[str, str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validates and converts the images and labels of both splits."""
    out: list[np.ndarray] = []
    for image_key, label_key in (train, test):
        images = as_uint8_images(arrays[image_key], f"{path}: {image_key}")
        labels = as_labels(arrays[label_key], f"{path}: {label_key}")
        if len(images) != len(labels):
            raise DPVisionError(
                f"{path}: {image_key} has {len(images)} images but {label_key} has "
                f"{len(labels)} labels; store one label per image"
            )
        out.extend([images, labels])
    if out[0].shape[1:] != out[2].shape[1:]:
        raise DPVisionError(
            f"{path}: {train[0]} images are {out[0].shape[1:]} but {test[0]} images are "
            f"{out[2].shape[1:]}; all images must share one (H, W, C)"
        )
    return out[0], out[1], out[2], out[3]


def read_npy(file: Path, *, mmap: bool, fix: str) -> np.ndarray:
    """Opens one ``.npy`` file (never pickled), memory-mapped read-only when ``mmap``.

    Raises:
        DPVisionError: If the file is missing or not a readable ``.npy`` array; the message
            ends with ``fix``.
    """
    if not file.is_file():
        raise DPVisionError(f"{file}: no such file; {fix}")
    try:
        array: np.ndarray = np.load(file, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DPVisionError(
            f"{file}: not a readable .npy array ({_first_line(exc)}); {fix}"
        ) from None
    if not isinstance(array, np.ndarray):  # an .npz archive saved under a .npy name
        array.close()
        raise DPVisionError(f"{file}: an .npz archive, not one .npy array; {fix}")
    return array


def load_array_folder(
    path: Path, num_classes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Reads a ``npy:DIR`` dataset: ``x_train.npy``, ``y_train.npy``, ``x_test.npy`` and
    ``y_test.npy`` in one folder, the images **memory-mapped** (read-only), not loaded.

    This is the format for image sets larger than memory: the images must already be
    ``uint8`` ``(N, H, W)`` or ``(N, H, W, C)`` (converting would read them all), and are read
    from disk a batch at a time by whoever indexes them. Labels are loaded and must lie
    below ``num_classes`` (given by the user, never read off the private labels).

    Returns:
        ``(train_images, train_labels, test_images, test_labels, num_classes)``.

    Raises:
        DPVisionError: If a file is missing, pickled, or not in the format.
    """
    fix = f"expected {', '.join(k + '.npy' for k in ARRAY_KEYS)} in {path} (uint8 images)"
    if not path.is_dir():
        raise DPVisionError(f"{path}: no such folder; {fix}")
    arrays = {}
    for key in ARRAY_KEYS:
        file = path / f"{key}.npy"
        array = read_npy(file, mmap=key.startswith("x"), fix=fix)
        if key.startswith("x") and array.dtype != np.uint8:
            raise DPVisionError(
                f"{file}: memory-mapped images must be uint8, got {array.dtype}; {fix}"
            )
        arrays[key] = array
    splits = _convert(path, arrays, ("x_train", "y_train"), ("x_test", "y_test"))
    check_labels(path, splits, ("y_train", "y_test"), num_classes, "set num_classes to match")
    return (*splits, num_classes)
