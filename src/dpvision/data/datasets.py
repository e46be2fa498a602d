"""The registry of dataset names and :func:`load_dataset`.

Names:

* ``digits``: scikit-learn's 8x8 digits, split 80/20 per class with a fixed seed
  (:mod:`dpvision.data.digits`); needs scikit-learn, no files.
* ``mnist``, ``fashion-mnist``: the four IDX files (``.gz`` or not) (:mod:`dpvision.data.idx`).
* ``cifar10``, ``cifar100``: the python-version pickles (:mod:`dpvision.data.cifar`).
* ``cifar10-jpeg``: CIFAR-10 as a lossy public JPEG (q75) copy, never labelled ``cifar10``
  (:mod:`dpvision.data.cifar_jpeg`).
* ``dermamnist``: MedMNIST's ``dermamnist.npz``, 28x28 RGB, 7 classes; the official train and
  test splits, the validation split ignored (:mod:`dpvision.data.npzfiles`).
* ``npz:PATH``: an ``.npz`` with ``x_train``, ``y_train``, ``x_test``, ``y_test``.
* ``npy:DIR``: the same four arrays as ``.npy`` files in a folder; the uint8 images are
  memory-mapped, not loaded, for image sets larger than memory.
* ``imagefolder:PATH``: ``PATH/train/<class>/*.png`` and ``PATH/test/<class>/*``, or a single
  ``PATH/<class>/*.png`` tree split by ``test_fraction`` and ``split_seed``
  (:mod:`dpvision.data.imagefolder`); needs Pillow.

Any of them may be brought to one image size as it is loaded (``geometry``,
:mod:`dpvision.data.resize`): image folders as each file is decoded, the others image by image
after loading (``npy:DIR`` is then read into memory at the new size).

Named datasets with files are found as described in :mod:`dpvision.data.sources`. Each entry
of the registry knows its loader (:attr:`DatasetInfo.loader`; :data:`PATH_LOADERS` for the
path forms): :func:`load_dataset` checks the public shape, then dispatches.

Loading reads the private data into memory (``npy:DIR``: maps it) and nothing else: no
statistic of the data is computed, logged or released here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dpvision.data import cifar, cifar_jpeg, digits, idx, imagefolder, npzfiles, sources
from dpvision.data.core import ImageDataset
from dpvision.data.resize import ImageGeometry
from dpvision.data.splits import SPLIT_SEED, TEST_FRACTION, changed_tree_option
from dpvision.errors import DPVisionError

__all__ = [
    "DATASETS",
    "PATH_LOADERS",
    "PATH_PREFIXES",
    "DatasetInfo",
    "available_datasets",
    "dataset_info",
    "load_dataset",
]

_DIGIT_NAMES = tuple(str(d) for d in range(10))


@dataclass(frozen=True)
class DatasetInfo:
    """A named dataset.

    Attributes:
        name: Its name for :func:`load_dataset`.
        description: One line for help texts.
        num_classes: Number of classes.
        class_names: Names of the classes, if known.
        needs_files: Whether it is read from files (found as in :mod:`dpvision.data.sources`).
        loader: ``loader(info, data_dir, download)`` reads it (see :func:`load_dataset` for
            the arguments).
        caveat: What ``dpvision report`` says beside a missed band (a lossy copy), or None.

    Privacy: the loader reads the private data into memory and releases nothing.
    """

    name: str
    description: str
    num_classes: int
    class_names: tuple[str, ...] | None
    needs_files: bool = True
    loader: DatasetLoader = field(
        default=lambda info, _data_dir, _download: _unloadable(info), repr=False, compare=False
    )
    caveat: str | None = None


DatasetLoader = Callable[[DatasetInfo, "str | Path | None", bool], ImageDataset]
"""``loader(info, data_dir, download)``: a named dataset's arrays (:attr:`DatasetInfo.loader`)."""

PathLoader = Callable[[str, Path, "int | None", "int | None"], ImageDataset]
"""``loader(name, path, num_classes, channels)``: a dataset named by its path."""


def _unloadable(info: DatasetInfo) -> ImageDataset:
    """The loader of an entry made without one: a one-line error."""
    raise DPVisionError(f"dataset {info.name} has no loader")


def _load_digits(info: DatasetInfo, data_dir: str | Path | None, download: bool) -> ImageDataset:
    """scikit-learn's digits (no files: ``data_dir`` and ``download`` are ignored).

    Privacy: reads the private data into memory and releases nothing.
    """
    return _make(info, *digits.load_digits_arrays())


def _load_idx(info: DatasetInfo, data_dir: str | Path | None, download: bool) -> ImageDataset:
    """Finds and reads the four IDX files of ``mnist`` or ``fashion-mnist``.

    Privacy: reads the private data into memory; a label out of range is refused with the
    file's name and the largest label (a defect of the file, never logged otherwise).
    """
    files = sources.locate(info.name, data_dir, idx.find_idx_files, idx.EXPECTED, download=download)
    arrays: list[np.ndarray] = []
    for split in ("train", "test"):
        images, labels = idx.load_idx_split(files[f"{split}_images"], files[f"{split}_labels"])
        if labels.size and labels.max() >= info.num_classes:
            raise DPVisionError(
                f"{files[f'{split}_labels']}: labels outside [0, {info.num_classes}) but "
                f"{info.name} has {info.num_classes} classes; replace it with the original file"
            )
        arrays.extend([images, labels])
    return _make(info, *arrays)


def _load_cifar(
    layout: cifar.CifarLayout, info: DatasetInfo, data_dir: str | Path | None, download: bool
) -> ImageDataset:
    """Finds and reads the python-version pickles of CIFAR-10 or CIFAR-100.

    Privacy: reads the private data into memory and releases nothing.
    """
    folder = sources.locate(
        info.name,
        data_dir,
        lambda candidate: cifar.find_cifar_dir(candidate, layout),
        f"{layout.folder}/ with {', '.join(layout.all_files)}",
        download=download,
    )
    return _make(info, *cifar.load_cifar(folder, layout))


def _load_medmnist(info: DatasetInfo, data_dir: str | Path | None, download: bool) -> ImageDataset:
    """Finds and reads a MedMNIST ``<name>.npz`` (train and test splits).

    Privacy: reads the private data into memory and releases nothing.
    """
    path = sources.locate(
        info.name,
        data_dir,
        lambda candidate: npzfiles.find_medmnist_file(candidate, info.name),
        f"{info.name}.npz",
        download=download,
    )
    return _make(info, *npzfiles.load_medmnist(path, info.num_classes))


DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo(
            "digits",
            "scikit-learn digits, 8x8 grayscale (no download)",
            10,
            _DIGIT_NAMES,
            False,
            loader=_load_digits,
        ),
        DatasetInfo(
            "mnist", "MNIST handwritten digits, 28x28 grayscale", 10, _DIGIT_NAMES, loader=_load_idx
        ),
        DatasetInfo(
            "fashion-mnist",
            "Fashion-MNIST Zalando article images, 28x28 grayscale",
            10,
            (
                "T-shirt/top",
                "Trouser",
                "Pullover",
                "Dress",
                "Coat",
                "Sandal",
                "Shirt",
                "Sneaker",
                "Bag",
                "Ankle boot",
            ),
            loader=_load_idx,
        ),
        DatasetInfo(
            "cifar10",
            "CIFAR-10, 32x32 RGB",
            10,
            cifar.CIFAR10.class_names,
            loader=functools.partial(_load_cifar, cifar.CIFAR10),
        ),
        DatasetInfo(
            cifar_jpeg.NAME,
            "CIFAR-10 as a lossy JPEG (q75) copy, 32x32 RGB (no download)",
            10,
            cifar.CIFAR10.class_names,
            loader=lambda _info, data_dir, _download: cifar_jpeg.load_cifar10_jpeg(data_dir),
            caveat=cifar_jpeg.CAVEAT,
        ),
        DatasetInfo(
            "cifar100",
            "CIFAR-100 (fine labels), 32x32 RGB",
            100,
            None,
            loader=functools.partial(_load_cifar, cifar.CIFAR100),
        ),
        DatasetInfo(
            "dermamnist",
            "MedMNIST DermaMNIST dermatoscopy, 28x28 RGB (train/test; val ignored)",
            7,
            (
                "actinic keratoses and intraepithelial carcinoma",
                "basal cell carcinoma",
                "benign keratosis-like lesions",
                "dermatofibroma",
                "melanoma",
                "melanocytic nevi",
                "vascular lesions",
            ),
            loader=_load_medmnist,
        ),
    )
}
"""The named datasets, by name."""

_ALIASES = {
    "fashion_mnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "cifar-10": "cifar10",
    "cifar-100": "cifar100",
}


def dataset_info(name: str) -> DatasetInfo | None:
    """The named dataset ``name`` stands for (aliases and case allowed), or ``None``."""
    lowered = name.strip().lower()
    return DATASETS.get(_ALIASES.get(lowered, lowered))


def same_dataset(first: str | None, second: str | None) -> bool:
    """Whether two dataset names denote the same dataset: aliases and case of named
    datasets, and the resolved path of ``npz:``/``npy:``/``imagefolder:`` ones.

    >>> same_dataset("Fashion_MNIST", "fashion-mnist"), same_dataset("mnist", "cifar10")
    (True, False)
    """
    if first is None or second is None:
        return False

    def key(name: str) -> str:
        info = dataset_info(name)
        if info is not None:
            return info.name
        lowered = name.strip().lower()
        prefix = next((p for p in PATH_PREFIXES if lowered.startswith(p)), None)
        if prefix is None:
            return name.strip()
        return prefix + str(Path(name.strip()[len(prefix) :]).expanduser().resolve())

    return key(first) == key(second)


def available_datasets() -> tuple[str, ...]:
    """The accepted dataset names, path forms included (``npz:PATH``, ``npy:PATH``,
    ``imagefolder:PATH``)."""
    return (*DATASETS, *(prefix + "PATH" for prefix in PATH_PREFIXES))


def load_dataset(
    name: str,
    data_dir: str | Path | None = None,
    *,
    download: bool = True,
    num_classes: int | None = None,
    channels: int | None = None,
    geometry: ImageGeometry | None = None,
    split_seed: int = SPLIT_SEED,
    test_fraction: float = TEST_FRACTION,
) -> ImageDataset:
    """Loads a dataset by name (see the module docstring for the names).

    Args:
        name: ``digits``, ``mnist``, ``fashion-mnist``, ``cifar10``, ``cifar100``,
            ``dermamnist``, ``npz:PATH``, ``npy:PATH`` or ``imagefolder:PATH``.
            Case-insensitive, except the path.
        data_dir: For named datasets with files: the folder holding them, or its parent with a
            ``<name>/`` sub-folder. When given, only that place is used. When ``None``, the
            lookup order of :mod:`dpvision.data.sources` applies. Ignored by ``digits``,
            ``npz:``, ``npy:`` and ``imagefolder:``.
        download: Whether a missing named dataset may be downloaded into
            ``~/.cache/dpvision/<name>`` (never when ``data_dir`` is given or
            ``DPVISION_OFFLINE`` is set).
        num_classes: The number of classes. Required for ``npz:`` and ``npy:`` (it fixes the
            model's output shape, so it is never read off the private labels); for other
            datasets it must agree with the registry or the class folders when given.
        channels: ``imagefolder:`` only: 3 (default, every image converted to RGB) or 1
            (grayscale), never decided by what the private images happen to be.
        geometry: The size every image is brought to (:mod:`dpvision.data.resize`);
            ``None``: the images' own size.
        split_seed: ``imagefolder:`` with a single ``PATH/<class>/`` tree: the public key
            of its train/test split (:func:`dpvision.data.splits.tree_split`; a config's
            ``split_seed``, never its ``seed``); refused (one line), unless 0, for every
            other dataset.
        test_fraction: The same: each image's chance of landing in the test split; refused
            (one line), unless the default, for every other dataset.

    Returns:
        The dataset, images ``uint8`` ``(N, H, W, C)``, labels ``int64``.

    Raises:
        DPVisionError: For an unknown name, missing or malformed files, or a failed download.
    """
    text = name.strip()
    lowered = text.lower()
    check_public_shape(text, num_classes, channels)
    check_test_fraction(text, test_fraction, split_seed)
    for prefix, load in PATH_LOADERS.items():
        if lowered.startswith(prefix):
            raw_path = text[len(prefix) :].strip()
            if not raw_path:
                raise DPVisionError(f"dataset {text!r} names no path; write {prefix}PATH")
            path = Path(raw_path).expanduser()
            if prefix == "imagefolder:":  # resized as each file is decoded
                return _load_image_folder(
                    text,
                    path,
                    num_classes,
                    channels,
                    geometry=geometry,
                    split_seed=split_seed,
                    test_fraction=test_fraction,
                )
            return resized(load(text, path, num_classes, channels), geometry)
    info = dataset_info(text)
    assert info is not None  # check_public_shape refused unknown names
    return resized(info.loader(info, data_dir, download), geometry)


def resized(dataset: ImageDataset, geometry: ImageGeometry | None) -> ImageDataset:
    """``dataset`` with every image brought to ``geometry``'s size (itself when ``None``).

    Privacy: each image is resized alone (:meth:`ImageGeometry.apply_array`); releases
    nothing.
    """
    if geometry is None:
        return dataset
    return dataclasses.replace(
        dataset,
        train_images=geometry.apply_array(dataset.train_images),
        test_images=geometry.apply_array(dataset.test_images),
        geometry=geometry.describe(),
        native_train_images=dataset.train_images,
    )


def check_test_fraction(name: str, test_fraction: float, split_seed: int = SPLIT_SEED) -> None:
    """Refuses a ``test_fraction`` or ``split_seed`` other than the default for a dataset
    they cannot split (all but ``imagefolder:``, whose single tree they split)."""
    option = changed_tree_option(test_fraction, split_seed)
    if option is not None and not name.strip().lower().startswith("imagefolder:"):
        raise DPVisionError(
            f"{option} splits a single imagefolder: tree; {name} has its own test split: "
            f"leave {option} unset"
        )


def check_image_size(name: str, image_size: object) -> None:
    """Refuses, before any file is read, an ``imagefolder:`` run without ``image_size``.

    Privacy: the images' own sizes are private rows; the model's input size must not be
    read off them, nor may a run refuse because one image has another size (D and D plus an
    odd-sized image would then differ: one runs, one refuses). The size is the config's,
    every image is brought to it as it is decoded, and this refusal is decided by the
    config alone.
    """
    if image_size is None and name.strip().lower().startswith("imagefolder:"):
        raise DPVisionError(
            f"{name} needs image_size (e.g. --set image_size=64): every image is brought to it "
            "as it is decoded, so that the model's input size is the config's, never read off "
            "the private images"
        )


def check_public_shape(name: str, num_classes: int | None, channels: int | None) -> None:
    """Refuses, before any file is read, a dataset whose public shape is not known.

    The number of classes and the image channels fix the shape of the released model, so
    they must come from the registry or the user, never from the private data (one added
    example would otherwise be able to change them).
    """
    lowered = name.strip().lower()
    prefix = next((p for p in PATH_PREFIXES if lowered.startswith(p)), None)
    if prefix is None and dataset_info(name) is None:
        choices = ", ".join(available_datasets())
        raise DPVisionError(f"unknown dataset {name!r}; choose one of: {choices}")
    if num_classes is not None and (isinstance(num_classes, bool) or num_classes < 2):
        raise DPVisionError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    if prefix in ("npz:", "npy:") and num_classes is None:
        raise DPVisionError(
            f"dataset {name} needs its number of classes: set num_classes (e.g. --set "
            "num_classes=10); it is not read off the labels, which are private"
        )
    info = dataset_info(name) if prefix is None else None
    if info is not None and num_classes is not None and num_classes != info.num_classes:
        raise DPVisionError(
            f"num_classes = {num_classes} but {info.name} has {info.num_classes} classes"
        )
    if channels is not None and (prefix != "imagefolder:" or channels not in (1, 3)):
        raise DPVisionError(
            "image_channels is for imagefolder: datasets only, and must be 1 (grayscale) or "
            f"3 (RGB), got {channels!r} for {name}"
        )


def _load_arrays(
    load: Callable[[Path, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]],
    name: str,
    path: Path,
    num_classes: int | None,
    channels: int | None,
) -> ImageDataset:
    """Loads ``npz:PATH`` or ``npy:PATH`` with ``load`` (its number of classes is public:
    :func:`check_public_shape` required it).

    Privacy: reads (``npy:``: maps) the private data and releases nothing.
    """
    assert num_classes is not None  # check_public_shape
    x_train, y_train, x_test, y_test, m = load(path, num_classes)
    return ImageDataset(name, x_train, y_train, x_test, y_test, num_classes=m)


def _load_image_folder(
    name: str,
    path: Path,
    num_classes: int | None,
    channels: int | None,
    *,
    geometry: ImageGeometry | None = None,
    split_seed: int = SPLIT_SEED,
    test_fraction: float = TEST_FRACTION,
) -> ImageDataset:
    """Loads ``imagefolder:PATH``; the classes are the public folder names.

    Privacy: reads the private images into memory and releases nothing.
    """
    x_train, y_train, x_test, y_test, classes = imagefolder.load_image_folder(
        path,
        channels=channels or 3,
        geometry=geometry,
        split_seed=split_seed,
        test_fraction=test_fraction,
    )
    if num_classes is not None and num_classes != len(classes):
        raise DPVisionError(
            f"num_classes = {num_classes} but {path} has {len(classes)} class folders"
        )
    return ImageDataset(
        name,
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes=len(classes),
        class_names=classes,
        geometry=None if geometry is None else geometry.describe(),
    )


PATH_LOADERS: dict[str, PathLoader] = {
    "npz:": functools.partial(_load_arrays, npzfiles.load_array_npz),
    "npy:": functools.partial(_load_arrays, npzfiles.load_array_folder),
    "imagefolder:": _load_image_folder,
}
"""Prefix of a dataset name that carries a path → its loader."""

PATH_PREFIXES = tuple(PATH_LOADERS)
"""Prefixes of the dataset names that carry a path: ``npz:``, ``npy:``, ``imagefolder:``."""


def _make(info: DatasetInfo, *arrays: np.ndarray) -> ImageDataset:
    """Wraps the four arrays of a named dataset."""
    train_images, train_labels, test_images, test_labels = arrays
    return ImageDataset(
        name=info.name,
        train_images=train_images,
        train_labels=train_labels,
        test_images=test_images,
        test_labels=test_labels,
        num_classes=info.num_classes,
        class_names=info.class_names,
    )
