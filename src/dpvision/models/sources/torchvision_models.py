"""``torchvision:NAME`` — a torchvision architecture with random weights, sized for the task.

``torchvision.models.get_model(NAME, weights=None, num_classes=…)``: nothing is downloaded;
weights come from ``learner.init``. torchvision's classification models take 3-channel
images; grayscale datasets need ``timm:`` (``in_chans``) or a ``python:`` factory.
"""

from collections.abc import Mapping
from typing import Any

from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models.sources._extra import require


def check(name: str) -> None:
    """One-line errors for a missing torchvision or a name it does not know."""
    torchvision = require("torchvision", f"torchvision:{name}")
    known = torchvision.models.list_models(module=torchvision.models)
    if name not in known:
        close = [k for k in known if k.startswith(name[:3])][:5]
        hint = f"; close names: {', '.join(close)}" if close else ""
        raise DPVisionError(f"torchvision has no classification model {name!r}{hint}")


def build(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    args: Mapping[str, Any] | None = None,
) -> nn.Module:
    """``torchvision.models.get_model(name, weights=None, num_classes=…, **args)``
    (``args``: ``learner.model_args``, e.g. ``image_size`` of a ViT)."""
    check(name)
    if int(input_shape[0]) != 3:
        raise DPVisionError(
            f"torchvision:{name} takes 3-channel images, the dataset's have {input_shape[0]}: "
            f"use timm:{name} (it adapts the stem) or a python: factory"
        )
    torchvision = require("torchvision", f"torchvision:{name}")
    try:
        model: nn.Module = torchvision.models.get_model(
            name, weights=None, num_classes=num_classes, **dict(args or {})
        )
    except (TypeError, ValueError, AssertionError) as error:
        if not args:
            raise
        raise DPVisionError(
            f"torchvision:{name} does not take learner.model_args = {dict(args)} "
            f"({type(error).__name__}: {error})"
        ) from None
    return model
