"""The in-memory image dataset that every loader returns, and conversions to model inputs.

Images stay ``uint8`` in channels-last layout ``(N, H, W, C)`` (``C == 1`` for grayscale) so a
dataset costs one byte per pixel; :func:`images_to_float` and :func:`images_to_tensor` make the
``float32`` ``(N, C, H, W)`` arrays in ``[0, 1]`` that models consume, one split at a time.

The arrays are the private data. Nothing here releases them or anything computed from them.
"""

from __future__ import annotations

# local imports: start-up time (heavy modules are imported in the functions using them)
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dpvision.errors import DPVisionError

if TYPE_CHECKING:
    import torch

__all__ = ["ImageDataset", "images_to_float", "images_to_tensor"]


class LabelledSplits:
    """The sizes of a dataset's train and test splits, read from its labels."""

    train_labels: np.ndarray
    test_labels: np.ndarray

    @property
    def num_train(self) -> int:
        """Number of training examples."""
        return len(self.train_labels)

    @property
    def num_test(self) -> int:
        """Number of test examples."""
        return len(self.test_labels)


@dataclass(frozen=True, eq=False)
class ImageDataset(LabelledSplits):
    """A labelled image classification dataset with a fixed train/test split.

    Treat the arrays as read-only: they are shared by every user of the dataset object.

    Attributes:
        name: The name it was loaded under, e.g. ``"fashion-mnist"`` or ``"npz:/data/x.npz"``.
        train_images: ``uint8`` array of shape ``(N, H, W, C)``.
        train_labels: ``int64`` array of shape ``(N,)`` with values in ``[0, num_classes)``.
        test_images: ``uint8`` array of shape ``(M, H, W, C)`` (same ``H, W, C`` as train).
        test_labels: ``int64`` array of shape ``(M,)`` with values in ``[0, num_classes)``.
        num_classes: Number of classes.
        class_names: Optional human-readable name of each class, ``num_classes`` of them.
        geometry: The public description of the size the images were brought to as they
            were loaded (:meth:`dpvision.data.resize.ImageGeometry.describe`), or ``None``:
            their own size. Part of the feature cache's key.
        native_train_images: The training images at their own size when they were resized
            from arrays (``None`` otherwise): what identifies a row (:attr:`row_images`).
    """

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    num_classes: int
    class_names: tuple[str, ...] | None = None
    geometry: dict[str, object] | None = None
    native_train_images: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Checks the invariants listed in the class docstring.

        Raises:
            DPVisionError: If shapes, dtypes or labels are inconsistent.
        """
        where = f"dataset {self.name!r}"
        if self.num_classes < 1:
            raise DPVisionError(f"{where}: num_classes must be >= 1, got {self.num_classes}")
        for split in ("train", "test"):
            images = getattr(self, f"{split}_images")
            labels = getattr(self, f"{split}_labels")
            if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4:
                raise DPVisionError(
                    f"{where}: {split} images must be a uint8 array of shape (N, H, W, C), got "
                    f"{_describe(images)}"
                )
            if not isinstance(labels, np.ndarray) or labels.dtype != np.int64 or labels.ndim != 1:
                raise DPVisionError(
                    f"{where}: {split} labels must be an int64 array of shape (N,), got "
                    f"{_describe(labels)}"
                )
            if len(images) != len(labels):
                raise DPVisionError(
                    f"{where}: {len(images)} {split} images but {len(labels)} {split} labels"
                )
            if labels.size and (labels.min() < 0 or labels.max() >= self.num_classes):
                raise DPVisionError(
                    f"{where}: {split} labels must lie in [0, {self.num_classes}), found "
                    f"{labels.min()}..{labels.max()}"
                )
        if self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise DPVisionError(
                f"{where}: train images are {self.train_images.shape[1:]} (H, W, C) but test "
                f"images are {self.test_images.shape[1:]}"
            )
        if len(self.train_images) == 0:
            raise DPVisionError(f"{where}: the training split is empty")
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise DPVisionError(
                f"{where}: {len(self.class_names)} class names for {self.num_classes} classes"
            )

    @property
    def row_images(self) -> np.ndarray:
        """The training images as their rows are identified: at their own size, whatever
        ``image_size`` the run brings them to. The public split, the validation coins and
        the digests a weight file records of its rows read these, so a resized run leaves
        out the same public rows as pre-training did (:mod:`dpvision.data.splits`)."""
        if self.native_train_images is not None:
            return self.native_train_images
        return self.train_images

    @property
    def row_identity_kept(self) -> bool:
        """Whether :attr:`row_images` are the rows at their own size: the images were not
        resized, or were resized from arrays (an image folder resized as each file is
        decoded keeps no native copy)."""
        return self.geometry is None or self.native_train_images is not None

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """The shape ``(H, W, C)`` of one image."""
        height, width, channels = self.train_images.shape[1:]
        return int(height), int(width), int(channels)

    def __repr__(self) -> str:
        """A summary without the pixel data."""
        height, width, channels = self.image_shape
        return (
            f"ImageDataset(name={self.name!r}, train={self.num_train}, test={self.num_test}, "
            f"image={height}x{width}x{channels}, num_classes={self.num_classes})"
        )


def images_to_float(images: np.ndarray) -> np.ndarray:
    """Converts ``uint8`` ``(N, H, W, C)`` images to ``float32`` ``(N, C, H, W)`` in ``[0, 1]``.

    Args:
        images: ``uint8`` array of shape ``(N, H, W, C)``, e.g. ``dataset.train_images``.

    Returns:
        A new C-contiguous ``float32`` array of shape ``(N, C, H, W)`` equal to ``images / 255``.

    Raises:
        DPVisionError: If ``images`` is not a 4-d ``uint8`` array.
    """
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4:
        raise DPVisionError(
            f"images_to_float expects uint8 images of shape (N, H, W, C), got {_describe(images)}"
        )
    out = np.empty(
        (images.shape[0], images.shape[3], images.shape[1], images.shape[2]), dtype=np.float32
    )
    np.divide(images.transpose(0, 3, 1, 2), np.float32(255.0), out=out, dtype=np.float32)
    return out


def images_to_tensor(images: np.ndarray) -> torch.Tensor:
    """Like :func:`images_to_float`, but returns a ``torch.float32`` tensor (imports torch).

    Args:
        images: ``uint8`` array of shape ``(N, H, W, C)``.

    Returns:
        A CPU ``float32`` tensor of shape ``(N, C, H, W)`` with values in ``[0, 1]``.
    """
    import torch

    return torch.from_numpy(images_to_float(images))


def _describe(value: object) -> str:
    """Names the type, dtype and shape of ``value`` for error messages."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    return type(value).__name__
