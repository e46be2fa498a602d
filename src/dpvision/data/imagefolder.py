"""Reader for image-folder datasets: ``ROOT/train/<class>/*.png`` and ``ROOT/test/<class>/*``,
or a single tree ``ROOT/<class>/*.png``.

Classes are the sub-folders of ``ROOT/train`` (of ``ROOT`` for a single tree), sorted
alphabetically; class ``i`` is the ``i``-th name. ``ROOT/test`` may contain a subset of those
classes. A single tree (no ``train/`` and no ``test/`` folder) is split by
:func:`dpvision.data.splits.tree_split`: each image's side depends on that file alone and the
config's public ``split_seed`` (never the run's ``seed``), about ``test_fraction`` of them in
the test split. Files ending in ``.png``, ``.jpg`` or ``.jpeg`` (any case) are read with
Pillow; other files (``.DS_Store``, notes) are ignored. Images of any size are brought to one
size as they are decoded when the caller gives an :class:`~dpvision.data.resize.ImageGeometry`
(``image_size``, which a run's config requires for an image folder: the model's input size is
never read off the private images); without one (the Python API, pre-training), all images
must have the same width and height. Every image is converted to RGB (three channels,
an alpha channel dropped), or to grayscale with ``channels=1``: the caller decides, because
the input shape of the model must not depend on what the private images happen to be.

Decoding (the slow part of a large folder) runs in :class:`torch.utils.data.DataLoader`
worker processes (:func:`decode_workers`: one per CPU core, at most 8, for folders of
:data:`PARALLEL_FROM` images or more); the decoded ``uint8`` array is the same whatever the
number of workers. It is decoded once, before training: a run then moves the ``uint8``
images to its device in one copy and augments them there (:mod:`dpvision.data.augment`).

The images are private data; this module only reads them and releases nothing.
"""

from __future__ import annotations

# local imports: start-up time (heavy modules are imported in the functions using them)
import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dpvision.data.resize import ImageGeometry
from dpvision.data.splits import SPLIT_SEED, TEST_FRACTION, changed_tree_option, tree_split
from dpvision.errors import DPVisionError

__all__ = [
    "DECODE_BATCH",
    "IMAGE_SUFFIXES",
    "PARALLEL_FROM",
    "decode_workers",
    "image_files",
    "load_image_folder",
    "read_images",
    "single_tree",
]

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg"})
"""File suffixes (lower case) that are read as images."""

PARALLEL_FROM = 512
"""Folders with at least this many images are decoded by worker processes; below it, the
start-up of the workers costs more than it saves."""

DECODE_BATCH = 256
"""Images a decoding worker stacks before handing them back (one transfer per batch)."""


def load_image_folder(
    root: Path,
    channels: int = 3,
    *,
    geometry: ImageGeometry | None = None,
    split_seed: int = SPLIT_SEED,
    test_fraction: float = TEST_FRACTION,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]:
    """Reads ``root/train`` and ``root/test``, or a single ``root/<class>/`` tree split by
    :func:`dpvision.data.splits.tree_split` (see the module docstring).

    Args:
        root: The dataset folder.
        channels: 3 (RGB) or 1 (grayscale): what every image is converted to.
        geometry: The size every image is brought to as it is decoded
            (:mod:`dpvision.data.resize`); ``None``: the images' own size, the same for all.
        split_seed: A single tree only: the public key of the split's coins (the config's
            ``split_seed``, never the run's ``seed``).
        test_fraction: A single tree only: each image's chance of landing in the test split.

    Returns:
        ``(train_images, train_labels, test_images, test_labels, class_names)`` with images
        ``uint8`` ``(N, H, W, C)`` and labels ``int64`` ``(N,)``.

    Raises:
        DPVisionError: If Pillow is missing, the layout is wrong, a class folder has no images,
            an image cannot be read, or (without ``geometry``) the images do not all have the
            same size.

    Privacy: reads the private images; releases nothing. A single tree's split depends on
    each file alone (its class and bytes) and the public ``split_seed``: adding or removing
    one image moves no other image between the splits. Without ``geometry`` the images'
    own size becomes the shape (public by convention) and a tree of mixed sizes is refused,
    which depends on the rows: a run's config therefore requires ``image_size`` for an image
    folder (:func:`dpvision.data.datasets.check_image_size`); the message names no file and
    no size.
    """
    try:
        from PIL import Image
    except ImportError as exc:
        raise DPVisionError(
            f"{root}: image-folder datasets need Pillow; install it with: pip install pillow"
        ) from exc
    if channels not in (1, 3):
        raise DPVisionError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}")

    files, classes = _layout(root, split_seed, test_fraction)
    all_files = [path for split in files.values() for path, _ in split]
    grayscale = channels == 1
    reference: tuple[int, int] | None = None
    for path in all_files if geometry is None else ():
        with _open(Image, path) as image:
            if reference is None:
                reference = image.size
            elif image.size != reference:
                raise DPVisionError(
                    f"{root}: the images are not all of one size; give the size to bring them "
                    "to (e.g. --set image_size=64)"
                )
    mode = "L" if grayscale else "RGB"

    out: list[np.ndarray] = []
    for split in ("train", "test"):
        entries = files[split]
        images = _decode([path for path, _ in entries], mode, geometry) if entries else None
        if images is None:
            if geometry is not None:
                height, width = geometry.size
            else:
                width, height = reference if reference else (0, 0)
            images = np.zeros((0, height, width, 1 if grayscale else 3), dtype=np.uint8)
        out.extend([images, np.array([label for _, label in entries], dtype=np.int64)])
    return out[0], out[1], out[2], out[3], classes


def single_tree(name: str) -> bool:
    """Whether the dataset ``name`` is an ``imagefolder:ROOT`` tree with its classes directly
    under ``ROOT`` (no ``train/`` or ``test/``), whose test split :func:`tree_split` draws.

    Privacy: decided by the folders ``train/`` and ``test/`` (the public layout) alone.
    """
    text = name.strip()
    if not text.lower().startswith("imagefolder:"):
        return False
    root = Path(text[len("imagefolder:") :].strip()).expanduser()
    return root.is_dir() and not (root / "train").is_dir() and not (root / "test").is_dir()


def _layout(
    root: Path, split_seed: int, test_fraction: float
) -> tuple[dict[str, list[tuple[Path, int]]], tuple[str, ...]]:
    """The ``(file, label)`` entries of each split and the class names: from ``root/train``
    and ``root/test``, or a single ``root/<class>/`` tree split by each file's coin.

    Privacy: which layout applies is decided by the folders ``train/`` and ``test/`` (the
    public layout), before any image is read.
    """
    train_dir, test_dir = root / "train", root / "test"
    if not root.is_dir():
        raise DPVisionError(
            f"{root}: no such folder; an image-folder dataset is {root}/<class>/*.png, or "
            f"{root}/train/<class>/*.png and {root}/test/<class>/*.png"
        )
    if not train_dir.is_dir() and not test_dir.is_dir():
        classes = _classes(root)
        entries = _list_images(root, classes)
        train, test = tree_split(
            [path for path, _ in entries],
            [classes[label] for _, label in entries],
            test_fraction,
            split_seed,
        )
        return {
            "train": [entries[i] for i in train],
            "test": [entries[i] for i in test],
        }, classes
    for split_dir in (train_dir, test_dir):
        if not split_dir.is_dir():
            raise DPVisionError(
                f"{split_dir}: no such folder; an image-folder dataset needs "
                f"{root}/train/<class>/*.png and {root}/test/<class>/*.png (or no train/ and "
                f"test/ at all: {root}/<class>/*.png, split by test_fraction)"
            )
    option = changed_tree_option(test_fraction, split_seed)
    if option is not None:
        raise DPVisionError(
            f"{option} splits a single {root}/<class>/ tree; {root} has its own train/ and "
            f"test/ folders: leave {option} unset"
        )
    classes = _classes(train_dir)
    unknown = sorted(p.name for p in test_dir.iterdir() if p.is_dir() and p.name not in classes)
    if unknown:
        raise DPVisionError(
            f"{test_dir}: class folder(s) {', '.join(unknown)} have no counterpart in "
            f"{train_dir}; every test class must also be a training class"
        )
    return {
        "train": _list_images(train_dir, classes),
        "test": _list_images(test_dir, classes),
    }, classes


def _classes(folder: Path) -> tuple[str, ...]:
    """The class names: ``folder``'s sub-folders, sorted."""
    classes = tuple(sorted(p.name for p in folder.iterdir() if p.is_dir()))
    if not classes:
        raise DPVisionError(f"{folder}: no class folders; put images in {folder}/<class>/")
    if len(classes) == 1:  # the folder names are the public label space, not private rows
        raise DPVisionError(
            f"{folder}: one class folder ({classes[0]}); a classifier needs two or more, "
            f"each in {folder}/<class>/"
        )
    return classes


def image_files(path: Path) -> list[Path]:
    """The image files at ``path``: the file itself, or a folder's images (recursively,
    sorted by path)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DPVisionError(f"{path}: no such file or folder")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise DPVisionError(f"{path}: no .png/.jpg/.jpeg images in this folder")
    return files


def read_images(
    paths: list[Path], channels: int, geometry: ImageGeometry | None = None
) -> np.ndarray:
    """Decodes image files to ``uint8`` ``(N, H, W, C)`` with ``channels`` 1 (grayscale) or
    3 (RGB), each brought to ``geometry``'s size; without one, all must have the same size."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise DPVisionError(
            "reading images needs Pillow; install it with: pip install pillow"
        ) from exc
    mode = "L" if channels == 1 else "RGB"
    sizes = set()
    for path in paths if geometry is None else ():
        with _open(Image, path) as image:
            sizes.add(image.size[::-1])
    if len(sizes) > 1:
        raise DPVisionError(
            f"the images have different sizes ({', '.join(sorted(str(s) for s in sizes))}); "
            "resize them to one size"
        )
    return _decode(paths, mode, geometry)


def decode_workers(count: int) -> int:
    """How many worker processes decode ``count`` images: 0 (in this process) below
    :data:`PARALLEL_FROM`, else one per CPU core this process may use, at most 8."""
    if count < PARALLEL_FROM:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(8, cores or 1)


class _Files:
    """Image files decoded one by one, a map-style dataset for ``DataLoader``; a failure
    comes back as a message, not an exception (a worker's exception would reach the user as
    a traceback)."""

    def __init__(self, paths: list[Path], mode: str, geometry: ImageGeometry | None) -> None:
        self.paths, self.mode, self.geometry = paths, mode, geometry

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[np.ndarray | None, str]:
        from PIL import Image

        try:
            return _pixels(Image, self.paths[index], self.mode, self.geometry), ""
        except DPVisionError as error:
            return None, str(error)


def _stacked(items: list[tuple[np.ndarray | None, str]]) -> tuple[np.ndarray | None, str]:
    """A worker's batch as one array, or the first failure (module level: workers may
    pickle it)."""
    for array, problem in items:
        if array is None:
            return None, problem
    return np.stack([array for array, _ in items]), ""


def _decode(paths: list[Path], mode: str, geometry: ImageGeometry | None = None) -> np.ndarray:
    """Decodes ``paths`` (all of one size, checked by the caller, or each brought to
    ``geometry``'s) to ``uint8`` ``(N, H, W, C)`` with :func:`decode_workers` ``DataLoader``
    workers, in order; each worker hands back batches of :data:`DECODE_BATCH` images."""
    import torch.utils.data

    loader = torch.utils.data.DataLoader(
        _Files(paths, mode, geometry),
        batch_size=DECODE_BATCH,
        num_workers=decode_workers(len(paths)),
        collate_fn=_stacked,
    )
    arrays: list[np.ndarray] = []
    for array, problem in loader:
        if array is None:
            raise DPVisionError(problem)
        arrays.append(array)
    return np.concatenate(arrays)


def _list_images(split_dir: Path, classes: tuple[str, ...]) -> list[tuple[Path, int]]:
    """Lists ``(file, label)`` for every image under ``split_dir/<class>/``, sorted by name.

    Privacy: a class folder with no image is a class with no example, not an error: the
    label set is the folders' names (public), and a refusal would tell whether the class's
    one image is in the data (issue 48's review).
    """
    entries: list[tuple[Path, int]] = []
    for label, name in enumerate(classes):
        class_dir = split_dir / name
        if not class_dir.is_dir():
            continue
        paths = sorted(
            p for p in class_dir.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        )
        entries.extend((path, label) for path in paths)
    return entries


_DECODING = threading.RLock()


@contextlib.contextmanager
def _decoding(image_module: Any) -> Iterator[None]:
    """Decodes as the config says whatever the image holds: Pillow's warnings about one
    file (a palette with transparency, a large image) are not shown, and no size limit
    refuses a valid image. A warning or a refusal that one private image brings would tell
    whether it is in the data (issue 48's review); the size every image is brought to is
    the config's ``image_size``."""
    # One decode at a time in this process (dpvision's parallel decoding uses worker
    # processes): Pillow's limit and the warning filters are process-wide, so blocks of two
    # threads that overlapped would leave them changed.
    with _DECODING:
        limit = image_module.MAX_IMAGE_PIXELS
        image_module.MAX_IMAGE_PIXELS = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            image_module.MAX_IMAGE_PIXELS = limit


def _open(image_module: Any, path: Path) -> Any:
    """Opens an image lazily (header only), with a one-line error naming the file."""
    try:
        with _decoding(image_module):
            return image_module.open(path)
    except (OSError, ValueError) as exc:
        raise DPVisionError(f"{path}: cannot read the image ({exc}); fix or remove it") from exc


def _pixels(
    image_module: Any, path: Path, mode: str, geometry: ImageGeometry | None = None
) -> np.ndarray:
    """Decodes one image to ``uint8`` ``(H, W, C)`` in ``mode`` (``"L"`` or ``"RGB"``),
    brought to ``geometry``'s size when given."""
    try:
        with _decoding(image_module), image_module.open(path) as image:
            converted = image.convert(mode)
            if geometry is not None:
                converted = geometry.apply(converted)
            array = np.asarray(converted, dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise DPVisionError(f"{path}: cannot decode the image ({exc}); fix or remove it") from exc
    return array[..., np.newaxis] if array.ndim == 2 else array
