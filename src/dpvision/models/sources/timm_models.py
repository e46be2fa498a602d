"""``timm:NAME`` — a timm architecture with random weights, sized for the task.

timm builds the classifier for ``num_classes`` and adapts the stem to ``in_chans``; its
``pretrained`` flag stays off, so nothing is downloaded: weights come from ``learner.init``.
"""

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


def build(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``timm.create_model(name, pretrained=False, num_classes=…, in_chans=C)``."""
    check(name)
    timm = require("timm", f"timm:{name}")
    model: nn.Module = timm.create_model(
        name, pretrained=False, num_classes=num_classes, in_chans=int(input_shape[0])
    )
    return model
