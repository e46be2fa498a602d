"""Model names and the one place that builds a model from its name.

``tanh-cnn``, ``scatter-cnn``, ``wrn-DEPTH-WIDTH`` and ``mlp-HIDDEN`` are the names the
config (``learner.model``), encoder files and ``dpvision pretrain`` use. Every model built
here is validated for per-example clipping (:func:`dpvision.models.validate_model`).
"""

import re

from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models.mlp import mlp
from dpvision.models.scatter_cnn import scatter_cnn
from dpvision.models.tanh_cnn import tanh_cnn
from dpvision.models.validation import validate_model
from dpvision.models.wide_resnet import wide_resnet

_WRN = re.compile(r"^wrn-(\d+)-(\d+)$")
_MLP = re.compile(r"^mlp-(\d+)$")
MODELS_HELP = "tanh-cnn, scatter-cnn, wrn-DEPTH-WIDTH (e.g. wrn-16-4), mlp-HIDDEN (e.g. mlp-32)"


def parse_model(name: str) -> tuple[str, dict[str, int]]:
    """``tanh-cnn`` → ("tanh-cnn", {}); ``wrn-16-4`` → ("wrn", {"depth": 16, "width": 4});
    ``mlp-32`` → ("mlp", {"hidden": 32}).

    >>> parse_model("wrn-16-4")
    ('wrn', {'depth': 16, 'width': 4})
    """
    if name in ("tanh-cnn", "scatter-cnn"):
        return name, {}
    match = _WRN.match(name)
    if match:
        depth, width = int(match.group(1)), int(match.group(2))
        if (depth - 4) % 6 or depth < 10 or width < 1:
            raise DPVisionError(f"model {name}: a WRN needs depth = 6n + 4 >= 10 and width >= 1")
        return "wrn", {"depth": depth, "width": width}
    match = _MLP.match(name)
    if match:
        return "mlp", {"hidden": int(match.group(1))}
    raise DPVisionError(f"unknown model {name!r}; choose one of: {MODELS_HELP}")


def wrn_groups(groups: int) -> int:
    """GroupNorm groups a WRN can take: ``groups`` when it divides 16 (the narrowest
    stage's channels), else 16."""
    return groups if 16 % max(groups, 1) == 0 else 16


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, *, groups: int = 27
) -> nn.Module:
    """The model called ``name`` for inputs of ``input_shape``, validated.

    Args:
      name: a model name (:data:`MODELS_HELP`).
      input_shape: (C, H, W) of one input.
      num_classes: outputs of the head (public: from the config or the dataset registry).
      groups: the input GroupNorm groups of ``scatter-cnn`` (0: none), the GroupNorm groups
        of a WRN (see :func:`wrn_groups`).
    """
    kind, sizes = parse_model(name)
    if kind == "tanh-cnn":
        model: nn.Module = tanh_cnn(input_shape, num_classes=num_classes)
    elif kind == "mlp":
        model = mlp(input_shape, num_classes=num_classes, hidden=sizes["hidden"])
    elif kind == "scatter-cnn":
        model = scatter_cnn(input_shape, num_classes=num_classes, groups=groups)
    else:
        model = wide_resnet(
            sizes["depth"],
            sizes["width"],
            num_classes=num_classes,
            groups=wrn_groups(groups),
            in_channels=input_shape[0],
        )
    validate_model(model)
    return model
