"""What a trained model's ``predict`` takes, brought to the images it was trained on.

One path for the command line (``dpvision predict``) and Python (``TrainedModel.predict``):
image files or folders, ``.npy`` files, Pillow images, NumPy arrays (one image or a batch,
uint8, any size, grey, RGB or RGBA) and lists of them become uint8 ``(N, H, W, C)`` with the
model's channels, each brought to its geometry (``image_size``, ``crop_mode``, ``crop_pct``,
``interpolation``, as timm's ``resolve_data_config`` / ``create_transform``) — the
transformation training applied, pixel for pixel.

Privacy: per image, with public constants; reads the given images only, releases nothing.
"""

from pathlib import Path
from typing import Any

import numpy as np

from dpvision.data.imagefolder import image_files, read_images
from dpvision.data.npzfiles import read_npy
from dpvision.data.resize import ImageGeometry
from dpvision.errors import DPVisionError

TAKES = (
    "uint8 images: arrays (H, W[, C]) or (N, H, W, C), Pillow images, image files or "
    "folders, .npy files, or a list of them"
)


def as_images(inputs: Any, channels: int, geometry: ImageGeometry) -> np.ndarray:
    """``inputs`` as uint8 ``(N, H, W, channels)`` at ``geometry``'s size.

    A file or folder is decoded as ``dpvision predict`` decodes it (``convert`` to ``L`` or
    ``RGB``, then the geometry); an array's channels are converted the same way (grey is
    repeated into RGB, RGB(A) goes through Pillow's ``L``), then resized channel by channel
    (:meth:`ImageGeometry.apply_array`, the same pixels). Float arrays and tensors are
    refused: their scale and normalisation are not known.
    """
    if isinstance(inputs, str | Path):
        return _from_path(Path(inputs), channels, geometry)
    if _is_pil(inputs):
        return _from_pil(inputs, channels, geometry)[np.newaxis]
    if isinstance(inputs, list | tuple):
        if not inputs:
            return np.zeros((0, *geometry.size, channels), dtype=np.uint8)
        return np.concatenate([_one_or_more(item, channels, geometry) for item in inputs])
    if isinstance(inputs, np.ndarray):
        return _from_array(inputs, channels, geometry, batch=inputs.ndim == 4)
    raise DPVisionError(f"this model takes {TAKES}; got {type(inputs).__name__}")


def _one_or_more(item: Any, channels: int, geometry: ImageGeometry) -> np.ndarray:
    """A list's item: an image (one), or a file, folder or batch (several)."""
    if isinstance(item, list | tuple):
        raise DPVisionError(f"this model takes {TAKES}; got a list inside a list")
    return as_images(item, channels, geometry)  # a 4-D array is a batch there too


def _is_pil(value: Any) -> bool:
    try:
        from PIL import Image  # local import: optional dependency (no Pillow, no its images)
    except ImportError:
        return False
    return isinstance(value, Image.Image)


def _from_path(path: Path, channels: int, geometry: ImageGeometry) -> np.ndarray:
    if path.suffix == ".npy" and path.is_file():
        array = read_npy(path, mmap=False, fix="save a NumPy array with np.save")
        return _from_array(np.asarray(array), channels, geometry, batch=array.ndim == 4)
    return read_images(image_files(path), channels=channels, geometry=geometry)


def _from_pil(image: Any, channels: int, geometry: ImageGeometry) -> np.ndarray:
    """One Pillow image as a file of it is decoded: ``convert``, then the geometry."""
    converted = geometry.apply(image.convert("L" if channels == 1 else "RGB"))
    array = np.asarray(converted, dtype=np.uint8)
    return array[..., np.newaxis] if array.ndim == 2 else array


def _from_array(
    array: np.ndarray, channels: int, geometry: ImageGeometry, *, batch: bool
) -> np.ndarray:
    if array.dtype != np.uint8:
        raise DPVisionError(
            f"this model takes uint8 images (0–255), got {array.dtype}: scale them, e.g. "
            "(x * 255).round().astype(np.uint8) for values in [0, 1]"
        )
    images = array if batch else array[np.newaxis]
    if images.ndim == 3:  # grey images without a channel axis
        images = images[..., np.newaxis]
    if images.ndim != 4 or images.shape[-1] not in (1, 3, 4):
        raise DPVisionError(
            f"this model takes images (H, W), (H, W, C) or (N, H, W, C) with C = 1, 3 or 4; "
            f"got shape {array.shape}"
        )
    if images.shape[-1] != channels:
        images = _convert(images, channels)
    return geometry.apply_array(images)


def _convert(images: np.ndarray, channels: int) -> np.ndarray:
    """Channels converted as Pillow converts a decoded file: ``RGB`` or ``L``."""
    from PIL import Image  # local import: optional dependency

    modes = {1: "L", 3: "RGB", 4: "RGBA"}
    out = np.empty((*images.shape[:3], channels), dtype=np.uint8)
    for i, image in enumerate(images):
        pixels = image[..., 0] if image.shape[-1] == 1 else image
        converted = Image.fromarray(np.ascontiguousarray(pixels), modes[image.shape[-1]])
        array = np.asarray(converted.convert("L" if channels == 1 else "RGB"), dtype=np.uint8)
        out[i] = array[..., np.newaxis] if array.ndim == 2 else array
    return out
