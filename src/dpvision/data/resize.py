"""The image size a run trains at, and how an image of another size is brought to it.

:class:`ImageGeometry` is the config's ``image_size``, ``crop_mode``, ``crop_pct`` and
``interpolation``, with timm's names and meanings (``timm.data.create_transform`` at
evaluation, ``pretrained_cfg``): for a target ``(H, W)`` the image is first resized towards
the *scale size* ``(⌊H / crop_pct⌋, ⌊W / crop_pct⌋)``, then cropped (or padded) to ``(H, W)``
at the centre:

* ``center`` (timm's default): the aspect ratio is kept and the image *covers* the scale size
  (the shorter side fits, as torchvision's ``Resize(int)``); the centre ``(H, W)`` is kept.
  With ``crop_pct = 1`` a square image loses nothing; other images lose the ends of their
  longer side.
* ``squash``: resized to exactly the scale size (the aspect ratio is not kept), then
  centre-cropped: nothing is lost with ``crop_pct = 1``.
* ``border``: the aspect ratio is kept and the image *fits inside* the scale size (the longer
  side fits), then padded with black (0, torchvision's ``Pad`` default; timm pads with the
  model's mean pixel) and centre-cropped: nothing is lost with ``crop_pct = 1``.

``crop_pct`` in (0, 1] is the share of the scale size kept: timm's ViTs use 0.9 (resize to
248, keep the centre 224). ``interpolation`` is Pillow's filter (``bilinear``, ``bicubic``,
``nearest``, ``lanczos``), with Pillow's antialiasing when shrinking, as torchvision's
``Resize`` on PIL images. The same geometry is applied to every image a model sees: training,
test, ``dpvision predict`` and ``evaluate`` (the model file records it in its config), and it
is part of the feature cache's key.

Privacy: a resize reads one image and depends on nothing else (never on another image or a
statistic of the dataset); it releases nothing. The geometry itself is public (the config).

>>> ImageGeometry((4, 4)).scale_size((8, 16))  # the shorter side fits; the centre 4x4 is kept
(4, 8)
>>> ImageGeometry((4, 4), crop_mode="border").scale_size((8, 16))
(2, 4)
"""

from __future__ import annotations

# local imports: start-up time (Pillow is imported in the functions using it)
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from dpvision.errors import DPVisionError

__all__ = [
    "CROP_MODES",
    "DEFAULTS",
    "INTERPOLATIONS",
    "MAX_SIDE",
    "ImageGeometry",
    "parse_image_size",
]

CROP_MODES = ("center", "squash", "border")
"""timm's ``crop_mode`` values."""
INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "lanczos")
"""Pillow's resampling filters, by timm's and torchvision's names."""
MAX_SIDE = 4096
"""The largest side ``image_size`` accepts (a 4096² RGB image is 48 MiB)."""
DEFAULTS: dict[str, Any] = {
    "image_size": None,
    "crop_mode": "center",
    "crop_pct": 1.0,
    "interpolation": "bilinear",
}
"""The config's geometry options at their defaults (``image_size = None``: the images' own
size, which must then be the same for all)."""


def parse_image_size(value: Any) -> tuple[int, int] | None:
    """``image_size`` as ``(H, W)``: a whole number for a square, ``[H, W]``, or ``None``.

    >>> parse_image_size(64), parse_image_size([32, 48]), parse_image_size(None)
    ((64, 64), (32, 48), None)
    >>> parse_image_size([0, 3])
    Traceback (most recent call last):
    ...
    dpvision.errors.DPVisionError: image_size must be a whole number in [1, 4096] or [H, W] ...
    """
    if value is None:
        return None
    sides = [value, value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        not isinstance(sides, list | tuple)
        or len(sides) != 2
        or not all(
            isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= MAX_SIDE for s in sides
        )
    ):
        raise DPVisionError(
            f"image_size must be a whole number in [1, {MAX_SIDE}] or [H, W] of them, got {value!r}"
        )
    return int(sides[0]), int(sides[1])


@dataclasses.dataclass(frozen=True)
class ImageGeometry:
    """The size every image is brought to (see the module docstring).

    Attributes:
      size: ``(H, W)`` of the images the model takes.
      crop_mode: ``center``, ``squash`` or ``border`` (timm's ``crop_mode``).
      crop_pct: in (0, 1]: resize towards ``size / crop_pct``, then crop ``size``.
      interpolation: ``bilinear``, ``bicubic``, ``nearest`` or ``lanczos``.
    """

    size: tuple[int, int]
    crop_mode: str = "center"
    crop_pct: float = 1.0
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        parse_image_size(self.size)
        if self.crop_mode not in CROP_MODES:
            raise DPVisionError(
                f"crop_mode must be one of {', '.join(CROP_MODES)}, got {self.crop_mode!r}"
            )
        if self.interpolation not in INTERPOLATIONS:
            raise DPVisionError(
                f"interpolation must be one of {', '.join(INTERPOLATIONS)}, "
                f"got {self.interpolation!r}"
            )
        pct = self.crop_pct
        if isinstance(pct, bool) or not isinstance(pct, int | float) or not 0 < pct <= 1:
            raise DPVisionError(f"crop_pct must be in (0, 1], got {pct!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ImageGeometry | None:
        """The geometry of a config (a :class:`~dpvision.config.TrainConfig`'s dict, or a
        model file's recorded config), or ``None`` when it sets no ``image_size``; a config
        that sets crop options without a size is refused (they would do nothing)."""
        size = parse_image_size(config.get("image_size"))
        options = {key: config.get(key, DEFAULTS[key]) for key in DEFAULTS if key != "image_size"}
        if size is None:
            changed = sorted(key for key, value in options.items() if value != DEFAULTS[key])
            if changed:
                raise DPVisionError(
                    f"{changed[0]} needs image_size (the size images are resized to), e.g. "
                    "--set image_size=224"
                )
            return None
        return cls(size, **options)

    def describe(self) -> dict[str, Any]:
        """The geometry as JSON-compatible data (the feature cache's key)."""
        return {
            "image_size": list(self.size),
            "crop_mode": self.crop_mode,
            "crop_pct": float(self.crop_pct),
            "interpolation": self.interpolation,
        }

    def scale_size(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """``(h, w)`` an image of ``image_size`` (H, W) is resized to before the crop."""
        target = tuple(math.floor(s / self.crop_pct) for s in self.size)
        height, width = image_size
        if self.crop_mode == "squash":
            return target[0], target[1]
        if self.crop_mode == "center" and target[0] == target[1]:
            # torchvision's Resize(int): the shorter side to the size, the longer truncated
            side = target[0]
            if height <= width:
                return side, max(side, int(side * width / height))
            return max(side, int(side * height / width)), side
        ratio_h, ratio_w = height / target[0], width / target[1]
        ratio = max(ratio_h, ratio_w) if self.crop_mode == "border" else min(ratio_h, ratio_w)
        return max(1, round(height / ratio)), max(1, round(width / ratio))

    def apply(self, image: Any) -> Any:
        """A Pillow image brought to :attr:`size` (a new image; ``image`` is unchanged).

        Privacy: reads this one image only; releases nothing.
        """
        from PIL import Image

        height, width = image.height, image.width
        scaled = self.scale_size((height, width))
        if scaled != (height, width):
            image = image.resize(
                (scaled[1], scaled[0]), resample=_filter(Image, self.interpolation)
            )
        return _center_crop_or_pad(Image, image, self.size)

    def apply_array(self, images: np.ndarray) -> np.ndarray:
        """uint8 images ``(N, h, w, C)`` (any C) brought to :attr:`size`: ``(N, H, W, C)``,
        each channel of each image resized by :meth:`apply` (Pillow filters each channel
        alone, so an RGB image gives the same pixels as through :meth:`apply` whole).

        Privacy: each output image reads its own input image only; releases nothing.
        """
        from PIL import Image

        images = np.asarray(images)
        if images.ndim != 4 or images.dtype != np.uint8:
            raise DPVisionError(
                f"expected uint8 images (N, H, W, C), got {images.dtype} {images.shape}"
            )
        if images.shape[1:3] == self.size and self.crop_pct == 1:
            return images
        out = np.empty((len(images), *self.size, images.shape[3]), dtype=np.uint8)
        for i, image in enumerate(images):
            for c in range(images.shape[3]):
                channel = Image.fromarray(np.ascontiguousarray(image[..., c]))  # mode L
                out[i, ..., c] = np.asarray(self.apply(channel), dtype=np.uint8)
        return out


def _filter(image_module: Any, name: str) -> Any:
    """Pillow's resampling filter called ``name``."""
    filters = image_module.Resampling
    return {
        "bilinear": filters.BILINEAR,
        "bicubic": filters.BICUBIC,
        "nearest": filters.NEAREST,
        "lanczos": filters.LANCZOS,
    }[name]


def _center_crop_or_pad(image_module: Any, image: Any, size: tuple[int, int]) -> Any:
    """The centre ``size`` (H, W) of ``image``, padded with 0 where it is smaller (timm's
    ``center_crop_or_pad``: the padding's odd pixel on the right and at the bottom, the
    crop's offset ``round((h - H) / 2)`` as torchvision's ``CenterCrop``)."""
    crop_h, crop_w = size
    if image.height < crop_h or image.width < crop_w:
        padded = image_module.new(image.mode, (max(crop_w, image.width), max(crop_h, image.height)))
        left = (crop_w - image.width) // 2 if crop_w > image.width else 0
        top = (crop_h - image.height) // 2 if crop_h > image.height else 0
        padded.paste(image, (left, top))
        image = padded
    if (image.height, image.width) == (crop_h, crop_w):
        return image
    top = round((image.height - crop_h) / 2.0)
    left = round((image.width - crop_w) / 2.0)
    return image.crop((left, top, left + crop_w, top + crop_h))
