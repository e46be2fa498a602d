"""Features extracted elsewhere, read from files: ``features = "precomputed:path=DIR"``.

Mehta et al. (seed 000) train on embeddings of ViT-G/14 (JFT-3B) and ViT-B/16 (ImageNet-21k,
ImageNet-1k); their code reads those vectors from files, not images. dpvision does the same:
``DIR`` holds four ``.npy`` files (the names of ``npy:DIR`` datasets)::

    x_train.npy   (N, D) float16, float32 or float64: one feature vector per training example
    y_train.npy   (N,) or (N, 1) integer labels from 0
    x_test.npy    (M, D)
    y_test.npy    (M,)

The feature matrices are memory-mapped (read-only), never loaded whole, so ImageNet-1k's
1.28 M × 1664 float32 vectors (8.5 GB) train in memory bounded by the learners' chunks. Any
model can write them, e.g. with NumPy: ``np.save("DIR/x_train.npy", embeddings)``.

The config's ``dataset`` names what the vectors are features *of* (``cifar10``,
``imagenet``, …); for a dataset dpvision knows, the labels must lie in its classes. No image
is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpvision.data.core import LabelledSplits
from dpvision.data.datasets import PATH_PREFIXES, dataset_info
from dpvision.data.npzfiles import ARRAY_KEYS, as_labels, read_npy
from dpvision.errors import DPVisionError

__all__ = ["FeatureFiles", "load_feature_files"]

_FLOATS = (np.float16, np.float32, np.float64)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True, eq=False)
class FeatureFiles(LabelledSplits):
    """The train and test features of one dataset, read from a ``precomputed`` folder.

    Attributes:
        name: The dataset the features are of (the config's ``dataset``; a name dpvision
            knows is given its canonical spelling), as :class:`~dpvision.data.ImageDataset`
            names it.
        train, test: ``(N, D)`` and ``(M, D)`` float arrays, memory-mapped read-only.
        train_labels, test_labels: ``int64`` labels.
        num_classes: The dataset's number of classes (for an unknown name: the largest label
            plus one, the label set treated as public, as the learners do).
    """

    name: str
    train: np.ndarray
    train_labels: np.ndarray
    test: np.ndarray
    test_labels: np.ndarray
    num_classes: int


def load_feature_files(
    path: str | Path, dataset: str, num_classes: int | None = None
) -> FeatureFiles:
    """Opens the four ``.npy`` files of a ``precomputed:path=DIR`` folder.

    Args:
        path: The folder.
        dataset: What the features are of: a dataset name dpvision knows (``cifar10``, …;
            its number of classes bounds the labels) or any other plain name (``imagenet``,
            ``my-xrays``). Path datasets (``npz:``, ``npy:``, ``imagefolder:``) are refused:
            their images would be ignored.
        num_classes: The number of classes; required for a name dpvision does not know
            (never read off the labels, which are private), else it must match.

    Returns:
        The features and labels, the feature matrices memory-mapped.

    Raises:
        DPVisionError: A one-line message for a missing folder or file, a pickled or
            malformed array, a non-float feature matrix, train and test of different
            widths, a label count that differs from the rows, or labels outside the
            dataset's classes.

    Privacy:
        Releases nothing: the files are the private data (features of private examples). The
        extractor must not have seen them (a model pre-trained on public data); dpvision
        cannot check how the files were made.
    """
    name = dataset.strip()
    if name.lower().startswith(PATH_PREFIXES) or not _NAME.fullmatch(name):
        raise DPVisionError(
            f"with precomputed features, dataset names what they are features of (cifar10, "
            f"imagenet, …), not a path; got {dataset!r}"
        )
    info = dataset_info(name)
    if info is None and num_classes is None:
        raise DPVisionError(
            f"features of {name!r}, a dataset dpvision does not know, need num_classes (e.g. "
            "--set num_classes=1000); it is not read off the labels, which are private"
        )
    if info is not None and num_classes is not None and num_classes != info.num_classes:
        raise DPVisionError(
            f"num_classes = {num_classes} but {info.name} has {info.num_classes} classes"
        )
    folder = Path(path).expanduser()
    fix = (
        f"expected {', '.join(k + '.npy' for k in ARRAY_KEYS)} in {folder} "
        "((N, D) float features and (N,) integer labels)"
    )
    if not folder.is_dir():
        raise DPVisionError(f"{folder}: no such folder; {fix}")
    arrays = {
        key: read_npy(folder / f"{key}.npy", mmap=key.startswith("x"), fix=fix)
        for key in ARRAY_KEYS
    }
    for split in ("train", "test"):
        x = arrays[f"x_{split}"]
        if x.ndim != 2 or x.dtype.type not in _FLOATS:
            raise DPVisionError(
                f"{folder / f'x_{split}.npy'}: features must be a 2-d float16/32/64 array "
                f"(N, D), got {x.dtype} of shape {x.shape}; {fix}"
            )
        arrays[f"y_{split}"] = as_labels(arrays[f"y_{split}"], str(folder / f"y_{split}.npy"))
        if len(arrays[f"y_{split}"]) != len(x):
            raise DPVisionError(
                f"{folder}: x_{split}.npy has {len(x)} rows but y_{split}.npy has "
                f"{len(arrays[f'y_{split}'])} labels; store one label per row"
            )
    if arrays["x_train"].shape[1] != arrays["x_test"].shape[1]:
        raise DPVisionError(
            f"{folder}: x_train.npy has {arrays['x_train'].shape[1]} features per row but "
            f"x_test.npy has {arrays['x_test'].shape[1]}; both must come from one extractor"
        )
    if len(arrays["x_train"]) == 0:
        raise DPVisionError(f"{folder / 'x_train.npy'}: the training split is empty")
    largest = int(max(arrays["y_train"].max(initial=0), arrays["y_test"].max(initial=0)))
    num_classes = info.num_classes if info is not None else num_classes
    assert num_classes is not None  # checked on entry
    if largest >= num_classes:
        raise DPVisionError(
            f"{folder}: labels go up to {largest} but {info.name if info else name} has "
            f"{num_classes} classes; are these features of another dataset?"
        )
    return FeatureFiles(
        name=info.name if info is not None else name,
        train=arrays["x_train"],
        train_labels=arrays["y_train"],
        test=arrays["x_test"],
        test_labels=arrays["y_test"],
        num_classes=num_classes,
    )
