"""``timm:NAME`` — a timm architecture with random weights, sized for the task.

timm builds the classifier for ``num_classes`` and adapts the stem to ``in_chans``; its
``pretrained`` flag stays off, so nothing is downloaded: weights come from ``learner.init``.
"""

from collections.abc import Mapping
from typing import Any

from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models.sources._extra import require


def check(name: str) -> None:
    """One-line errors for a missing timm or an architecture timm does not know."""
    timm = require("timm", f"timm:{name}")
    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:5]
        hint = f"; close names: {', '.join(close)}" if close else ""
        raise DPVisionError(f"timm has no model {name!r}{hint}")


def build(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    args: Mapping[str, Any] | None = None,
) -> nn.Module:
    """``timm.create_model(name, pretrained=False, num_classes=…, in_chans=C, **args)``
    (``args``: ``learner.model_args``, e.g. ``img_size``, ``patch_size``,
    ``drop_path_rate``)."""
    check(name)
    timm = require("timm", f"timm:{name}")
    try:
        model: nn.Module = timm.create_model(
            name,
            pretrained=False,
            num_classes=num_classes,
            in_chans=int(input_shape[0]),
            **dict(args or {}),
        )
    except (TypeError, ValueError, AssertionError) as error:
        if not args:
            raise
        raise DPVisionError(
            f"timm:{name} does not take learner.model_args = {dict(args)} "
            f"({type(error).__name__}: {error})"
        ) from None
    return model


def default_geometry(name: str, model_args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The image geometry (``image_size``, ``crop_mode``, ``crop_pct``, ``interpolation``;
    :mod:`dpvision.data.resize`) timm's ``pretrained_cfg`` gives ``timm:NAME``, or ``{}``.

    ``learner.model_args.img_size`` given: that size (the model is built for it), the crop
    options left to the config. Otherwise, a model whose input size is fixed
    (``fixed_input_size``, ViTs): the cfg's ``input_size``, ``crop_pct``, ``crop_mode`` and
    ``interpolation`` (timm's ``resolve_data_config``); a model that takes any size
    (convnets): ``{}``, the images keep their own size. Reads timm's registry only: nothing
    is downloaded.

    Privacy: public (the model's name and arguments only).
    """
    img_size = (model_args or {}).get("img_size")
    if img_size is not None:
        return {"image_size": img_size}
    check(name)
    timm = require("timm", f"timm:{name}")
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not cfg.fixed_input_size:
        return {}
    found: dict[str, Any] = {"image_size": [int(s) for s in cfg.input_size[-2:]]}
    if cfg.crop_mode in ("center", "squash", "border"):
        found["crop_mode"] = cfg.crop_mode
    if cfg.crop_pct is not None:
        found["crop_pct"] = min(1.0, float(cfg.crop_pct))
    if cfg.interpolation in ("bilinear", "bicubic", "nearest", "lanczos"):
        found["interpolation"] = cfg.interpolation
    return found


def default_statistics(name: str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The per-channel ``(mean, std)`` timm's ``pretrained_cfg`` gives ``timm:NAME``'s
    pre-trained weights (ImageNet's for most), or ``None``. Reads timm's registry only.

    Privacy: public (the model's name only).
    """
    check(name)
    timm = require("timm", f"timm:{name}")
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or cfg.mean is None or cfg.std is None:
        return None
    return tuple(float(v) for v in cfg.mean), tuple(float(v) for v in cfg.std)
