"""Reader for the "python version" of CIFAR-10 and CIFAR-100 (pickled batches).

CIFAR-10 lives in ``cifar-10-batches-py/`` (``data_batch_1`` .. ``data_batch_5`` and
``test_batch``), CIFAR-100 in ``cifar-100-python/`` (``train`` and ``test``). Each file is a
pickled dict with ``b'data'``, a ``uint8`` array ``(N, 3072)`` holding the red, green and blue
32x32 planes of each image, and ``b'labels'`` (CIFAR-10) or ``b'fine_labels'`` (CIFAR-100).

The pickles were written by Python 2, so they are read with ``encoding='bytes'``. Unpickling
can run arbitrary code, so a restricted unpickler accepts only the few NumPy globals that an
array needs and refuses everything else.

The batches hold private data; this module only reads them and releases nothing.
"""

from __future__ import annotations

import codecs
import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpvision.errors import DPVisionError

__all__ = [
    "CIFAR10",
    "CIFAR100",
    "CifarLayout",
    "find_cifar_dir",
    "load_cifar",
    "missing_cifar_files",
]

_IMAGE_BYTES = 3 * 32 * 32


@dataclass(frozen=True)
class CifarLayout:
    """Where a CIFAR variant keeps its files and what its pickles contain.

    Attributes:
        folder: Name of the folder that the official archive unpacks to.
        train_files: Training batches, in order.
        test_files: Test batches.
        label_key: Dict key of the labels (without the ``b''`` prefix).
        num_classes: Number of classes.
        class_names: Class names, or ``None`` when not recorded here.
    """

    folder: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    label_key: str
    num_classes: int
    class_names: tuple[str, ...] | None = None

    @property
    def all_files(self) -> tuple[str, ...]:
        """Every file that must be present."""
        return self.train_files + self.test_files


CIFAR10 = CifarLayout(
    folder="cifar-10-batches-py",
    train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
    test_files=("test_batch",),
    label_key="labels",
    num_classes=10,
    class_names=(
        "airplane",
        "automobile",
        "bird",
        "cat",
        "deer",
        "dog",
        "frog",
        "horse",
        "ship",
        "truck",
    ),
)
CIFAR100 = CifarLayout(
    folder="cifar-100-python",
    train_files=("train",),
    test_files=("test",),
    label_key="fine_labels",
    num_classes=100,
)


def find_cifar_dir(candidate: Path, layout: CifarLayout) -> Path | None:
    """Returns the folder holding the batches, given the folder itself or its parent.

    Args:
        candidate: Either the ``cifar-10-batches-py``/``cifar-100-python`` folder or a folder
            that contains it.
        layout: :data:`CIFAR10` or :data:`CIFAR100`.

    Returns:
        The folder whose files exist (the first batch is used as the marker), else ``None``.
    """
    for folder in (candidate, candidate / layout.folder):
        if (folder / layout.train_files[0]).is_file():
            return folder
    return None


def missing_cifar_files(folder: Path, layout: CifarLayout) -> list[str]:
    """Names of the batch files of ``layout`` that are absent from ``folder``."""
    return [name for name in layout.all_files if not (folder / name).is_file()]


def load_cifar(folder: Path, layout: CifarLayout) -> tuple[np.ndarray, ...]:
    """Reads all batches of a CIFAR variant.

    Args:
        folder: The folder holding the batch files (see :func:`find_cifar_dir`).
        layout: :data:`CIFAR10` or :data:`CIFAR100`.

    Returns:
        ``(train_images, train_labels, test_images, test_labels)`` with images ``uint8``
        ``(N, 32, 32, 3)`` and labels ``int64`` ``(N,)``.

    Raises:
        DPVisionError: If a file is missing, is not a CIFAR pickle, or has bad keys or shapes.
    """
    missing = missing_cifar_files(folder, layout)
    if missing:
        raise DPVisionError(
            f"{folder}: missing {', '.join(missing)}; unpack the complete official "
            f"{layout.folder} archive there"
        )
    splits = []
    for names in (layout.train_files, layout.test_files):
        parts = [_read_batch(folder / name, layout) for name in names]
        images = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        labels = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        splits.extend([images, labels])
    return tuple(splits)


def _read_batch(path: Path, layout: CifarLayout) -> tuple[np.ndarray, np.ndarray]:
    """Reads one pickled batch into channels-last images and labels."""
    batch = _unpickle(path)
    if not isinstance(batch, dict):
        raise DPVisionError(
            f"{path}: not a CIFAR batch (pickle holds a {type(batch).__name__}, expected a dict);"
            " replace it with the original file"
        )
    data = _get(batch, "data", path)
    labels = _get(batch, layout.label_key, path)
    if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != _IMAGE_BYTES:
        shape = getattr(data, "shape", type(data).__name__)
        raise DPVisionError(
            f"{path}: b'data' must be a uint8 array of shape (N, {_IMAGE_BYTES}), got {shape};"
            " replace it with the original file"
        )
    if data.dtype != np.uint8:
        raise DPVisionError(
            f"{path}: b'data' has dtype {data.dtype}, expected uint8; "
            "replace it with the original file"
        )
    try:
        label_array = np.asarray(labels)
    except (TypeError, ValueError) as exc:  # pragma: no cover - ragged or exotic content
        raise DPVisionError(f"{path}: unreadable b'{layout.label_key}' ({exc})") from exc
    if label_array.ndim != 1 or not np.issubdtype(label_array.dtype, np.integer):
        raise DPVisionError(
            f"{path}: b'{layout.label_key}' must be a list of integers, got "
            f"{label_array.dtype} of shape {label_array.shape}; replace it with the original file"
        )
    if len(label_array) != len(data):
        raise DPVisionError(
            f"{path}: {len(data)} images but {len(label_array)} labels; "
            "replace it with the original file"
        )
    if label_array.size and (label_array.min() < 0 or label_array.max() >= layout.num_classes):
        raise DPVisionError(
            f"{path}: labels must lie in [0, {layout.num_classes}), found "
            f"{label_array.min()}..{label_array.max()}; is this the right CIFAR variant?"
        )
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return images, label_array.astype(np.int64)


def _get(batch: dict[Any, Any], key: str, path: Path) -> Any:
    """Looks ``key`` up as bytes (Python 2 pickles) or str (re-pickled by Python 3)."""
    for candidate in (key.encode(), key):
        if candidate in batch:
            return batch[candidate]
    keys = ", ".join(sorted(repr(k) for k in batch))
    raise DPVisionError(
        f"{path}: no b'{key}' entry (keys: {keys}); this is not the right CIFAR batch file"
    )


def _safe_globals() -> dict[tuple[str, str], Any]:
    """The only globals a CIFAR pickle may refer to: what rebuilding a NumPy array needs."""
    reconstruct = np.zeros(1).__reduce__()[0]
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]
    scalar = np.uint8(0).__reduce__()[0]
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,
    }
    for module in ("numpy.core", "numpy._core"):
        allowed[(f"{module}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{module}.multiarray", "scalar")] = scalar
        allowed[(f"{module}.numeric", "_frombuffer")] = frombuffer
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only NumPy array globals (see :func:`_safe_globals`)."""

    _allowed = _safe_globals()

    def find_class(self, module: str, name: str) -> Any:
        """Returns an allowed global; refuses any other."""
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}") from None


def _unpickle(path: Path) -> Any:
    """Loads a pickle with the restricted unpickler, with one-line errors."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DPVisionError(f"{path}: cannot read the file ({exc.strerror or exc})") from exc
    try:
        return _RestrictedUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # any failure to decode means a bad file
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DPVisionError(
            f"{path}: not a valid CIFAR pickle ({detail}); replace it with the original file"
        ) from exc
