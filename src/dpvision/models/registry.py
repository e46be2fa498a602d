"""Model specs and the one place that builds a model from its spec.

``tanh-cnn``, ``scatter-cnn``, ``wrn-DEPTH-WIDTH`` and ``mlp-HIDDEN`` are dpvision's own
models; ``timm:NAME``, ``torchvision:NAME`` and ``python:MODULE:CALLABLE`` come from
elsewhere (:mod:`dpvision.models.sources`). These are the specs the config
(``learner.model``), encoder files and ``dpvision pretrain`` use.

:func:`build_network` builds the network as its source defines it (BatchNorm and all, for
loading weights or non-private pre-training); :func:`build_model` then makes it fit for
per-example clipping (:func:`prepare_for_dp`: BatchNorm frozen or replaced by GroupNorm)
and validates it (:func:`dpvision.models.validate_model`).
"""

import re

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models.heads import head_name, replace_head
from dpvision.models.mlp import mlp
from dpvision.models.scatter_cnn import scatter_cnn
from dpvision.models.sources import EXTERNAL_HELP, SOURCES, split_spec
from dpvision.models.tanh_cnn import tanh_cnn
from dpvision.models.validation import freeze_batchnorm, replace_batchnorm, validate_model
from dpvision.models.wide_resnet import wide_resnet

_WRN = re.compile(r"^wrn-(\d+)-(\d+)$")
_MLP = re.compile(r"^mlp-(\d+)$")
MODELS_HELP = (
    "tanh-cnn, scatter-cnn, wrn-DEPTH-WIDTH (e.g. wrn-16-4), mlp-HIDDEN (e.g. mlp-32), "
    + EXTERNAL_HELP
)
BATCHNORM_MODES = ("auto", "freeze", "group-norm")
"""What :func:`prepare_for_dp` does with BatchNorm: ``freeze`` (its running statistics, as
pre-trained), ``group-norm`` (fresh GroupNorm layers), ``auto`` (freeze when weights are
loaded, GroupNorm otherwise)."""


def parse_model(name: str) -> tuple[str, dict[str, int]]:
    """``tanh-cnn`` → ("tanh-cnn", {}); ``wrn-16-4`` → ("wrn", {"depth": 16, "width": 4});
    ``mlp-32`` → ("mlp", {"hidden": 32}); ``timm:resnet18`` → ("timm", {}) (syntax only:
    :func:`check_model` also asks the source).

    >>> parse_model("wrn-16-4")
    ('wrn', {'depth': 16, 'width': 4})
    """
    source, _ = split_spec(name)
    if source is not None:
        return source, {}
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


def check_model(name: str) -> None:
    """One-line errors for a spec that cannot be built: bad syntax, an unknown name, a
    source whose package is not installed (with the install command)."""
    parse_model(name)
    source, rest = split_spec(name)
    if source is not None:
        SOURCES[source].check(rest)


def is_external(name: str) -> bool:
    """Whether ``name`` comes from timm, torchvision or a Python factory."""
    return split_spec(name)[0] is not None


def build_network(
    name: str, input_shape: tuple[int, ...], num_classes: int, *, groups: int = 27
) -> nn.Module:
    """The network ``name`` for inputs of ``input_shape`` with ``num_classes`` outputs, as
    its source defines it (not yet validated for per-example clipping).

    A ``python:`` factory whose output does not have ``num_classes`` logits gets its last
    ``nn.Linear`` replaced by a fresh one (found with one forward pass of zeros: public).

    Args:
      name: a model spec (:data:`MODELS_HELP`).
      input_shape: (C, H, W) of one input.
      num_classes: outputs of the head (public: from the config or the dataset registry).
      groups: the input GroupNorm groups of ``scatter-cnn`` (0: none), the GroupNorm groups
        of a WRN (see :func:`wrn_groups`).
    """
    kind, sizes = parse_model(name)
    if kind in SOURCES:
        source, rest = split_spec(name)
        assert source is not None
        model = SOURCES[source].build(rest, tuple(input_shape), num_classes)
        if source == "python":
            model = _fit_outputs(model, name, input_shape, num_classes)
        return model
    if kind == "tanh-cnn":
        return tanh_cnn(input_shape, num_classes=num_classes)
    if kind == "mlp":
        return mlp(input_shape, num_classes=num_classes, hidden=sizes["hidden"])
    if kind == "scatter-cnn":
        return scatter_cnn(input_shape, num_classes=num_classes, groups=groups)
    return wide_resnet(
        sizes["depth"],
        sizes["width"],
        num_classes=num_classes,
        groups=wrn_groups(groups),
        in_channels=input_shape[0],
    )


def _fit_outputs(
    model: nn.Module, name: str, input_shape: tuple[int, ...], num_classes: int
) -> nn.Module:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, *input_shape))
    except Exception as error:
        raise DPVisionError(
            f"{name} cannot take inputs of shape {tuple(input_shape)}: {error}"
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise DPVisionError(f"{name} must return logits of shape (N, classes)")
    if out.shape[1] != num_classes:
        head = model.get_submodule(head_name(model))
        assert isinstance(head, nn.Linear)
        replace_head(model, nn.Linear(head.in_features, num_classes))
    return model


def prepare_for_dp(model: nn.Module, batchnorm: str = "group-norm", groups: int = 16) -> nn.Module:
    """``model`` with no layer that mixes examples, validated.

    Args:
      model: a network from :func:`build_network` (weights loaded, if any).
      batchnorm: ``freeze`` (:func:`~dpvision.models.freeze_batchnorm`: the running
        statistics stay, the scale and offset train) or ``group-norm``
        (:func:`~dpvision.models.replace_batchnorm`: fresh GroupNorm layers).
      groups: the preferred GroupNorm groups for ``group-norm``.
    """
    if batchnorm not in ("freeze", "group-norm"):
        raise DPVisionError(f"batchnorm must be freeze or group-norm, got {batchnorm!r}")
    fixed = freeze_batchnorm(model) if batchnorm == "freeze" else replace_batchnorm(model, groups)
    validate_model(fixed)
    return fixed


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    groups: int = 27,
    batchnorm: str = "group-norm",
) -> nn.Module:
    """The model called ``name`` for inputs of ``input_shape``, fit for DP-SGD and validated
    (:func:`build_network`, then :func:`prepare_for_dp`; dpvision's own models have no
    BatchNorm)."""
    model = build_network(name, input_shape, num_classes, groups=groups)
    if not is_external(name):
        validate_model(model)
        return model
    return prepare_for_dp(model, batchnorm, groups=16)
