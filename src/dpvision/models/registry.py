"""Model specs and the one place that builds a model from its spec.

``tanh-cnn``, ``scatter-cnn``, ``wrn-DEPTH-WIDTH`` and ``mlp-HIDDEN`` are dpvision's own
models; ``timm:NAME``, ``torchvision:NAME`` and ``python:MODULE:CALLABLE`` come from
elsewhere (:mod:`dpvision.models.sources`). These are the specs the config
(``learner.model``), encoder files and ``dpvision pretrain`` use; :class:`ModelSpec` parses
one once, and every function here takes the parsed spec or its text.

:func:`build_network` builds the network as its source defines it (BatchNorm and all, for
loading weights or non-private pre-training); :func:`build_model` then makes it fit for
per-example clipping (:func:`prepare_for_dp`: BatchNorm frozen or replaced by GroupNorm)
and validates it (:func:`dpvision.models.validate_model`).
"""

import inspect

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models.heads import head_name, replace_head
from dpvision.models.mlp import mlp
from dpvision.models.scatter_cnn import scatter_cnn
from dpvision.models.sources import SOURCES
from dpvision.models.spec import MODELS_HELP, ModelSpec
from dpvision.models.tanh_cnn import tanh_cnn
from dpvision.models.validation import freeze_batchnorm, replace_batchnorm, validate_model
from dpvision.models.wide_resnet import wide_resnet

__all__ = [
    "BATCHNORM_MODES",
    "MODELS_HELP",
    "ModelSpec",
    "build_model",
    "build_network",
    "check_forward",
    "check_model",
    "is_external",
    "parse_model",
    "prepare_for_dp",
    "wrn_groups",
]

BATCHNORM_MODES = ("auto", "freeze", "group-norm")
"""What :func:`prepare_for_dp` does with BatchNorm: ``freeze`` (its running statistics, as
pre-trained), ``group-norm`` (fresh GroupNorm layers), ``auto`` (freeze when weights are
loaded, GroupNorm otherwise)."""


def parse_model(name: str | ModelSpec) -> tuple[str, dict[str, int]]:
    """``tanh-cnn`` → ("tanh-cnn", {}); ``wrn-16-4`` → ("wrn", {"depth": 16, "width": 4});
    ``mlp-32`` → ("mlp", {"hidden": 32}); ``timm:resnet18`` → ("timm", {}) (syntax only:
    :func:`check_model` also asks the source). :meth:`ModelSpec.parse` gives the whole spec.

    >>> parse_model("wrn-16-4")
    ('wrn', {'depth': 16, 'width': 4})
    """
    spec = ModelSpec.parse(name)
    return spec.kind, spec.sizes()


def wrn_groups(groups: int) -> int:
    """GroupNorm groups a WRN can take: ``groups`` when it divides 16 (the narrowest
    stage's channels), else 16."""
    return groups if 16 % max(groups, 1) == 0 else 16


def check_model(name: str | ModelSpec) -> ModelSpec:
    """One-line errors for a spec that cannot be built: bad syntax, an unknown name, a
    source whose package is not installed (with the install command). Returns the parsed
    spec."""
    spec = ModelSpec.parse(name)
    if spec.source is not None:
        SOURCES[spec.source].check(spec.name)
    return spec


def is_external(name: str | ModelSpec) -> bool:
    """Whether ``name`` comes from timm, torchvision or a Python factory."""
    return ModelSpec.parse(name).external


def build_network(
    name: str | ModelSpec, input_shape: tuple[int, ...], num_classes: int, *, groups: int = 27
) -> nn.Module:
    """The network ``name`` for inputs of ``input_shape`` with ``num_classes`` outputs, as
    its source defines it (not yet validated for per-example clipping).

    A ``python:`` factory whose output does not have ``num_classes`` logits gets its last
    ``nn.Linear`` replaced by a fresh one (found with one forward pass of zeros: public).

    Args:
      name: a model spec (:data:`MODELS_HELP`), parsed or not (:class:`ModelSpec`).
      input_shape: (C, H, W) of one input.
      num_classes: outputs of the head (public: from the config or the dataset registry).
      groups: the input GroupNorm groups of ``scatter-cnn`` (0: none), the GroupNorm groups
        of a WRN (see :func:`wrn_groups`).
    """
    spec = ModelSpec.parse(name)
    if spec.source is not None:
        model = SOURCES[spec.source].build(spec.name, tuple(input_shape), num_classes, spec.kwargs)
        if spec.source == "python":
            model = _fit_outputs(model, spec.text, input_shape, num_classes)
        return model
    if spec.kind == "tanh-cnn":
        return tanh_cnn(input_shape, num_classes=num_classes)
    if spec.kind == "mlp":
        assert spec.hidden is not None
        return mlp(input_shape, num_classes=num_classes, hidden=spec.hidden)
    if spec.kind == "scatter-cnn":
        return scatter_cnn(input_shape, num_classes=num_classes, groups=groups)
    assert spec.depth is not None
    assert spec.width is not None
    return wide_resnet(
        spec.depth,
        spec.width,
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
        raise DPVisionError(_mismatch(ModelSpec.parse(name), model, input_shape, error)) from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise DPVisionError(f"{name} must return logits of shape (N, classes)")
    if out.shape[1] != num_classes:
        head = model.get_submodule(head_name(model))
        assert isinstance(head, nn.Linear)
        replace_head(model, nn.Linear(head.in_features, num_classes))
    return model


def check_forward(
    spec: str | ModelSpec, model: nn.Module, input_shape: tuple[int, ...], num_classes: int
) -> None:
    """Refuses, in one line naming the fixes, a network that cannot take one batch of
    zeros of ``input_shape`` or does not give ``num_classes`` logits: a timm ViT built for
    224×224 images given 32×32 ones fails here, before any training step, not in the
    middle of the first one.

    The forward runs in evaluation mode without gradients (one zero input: microseconds for
    the Tanh CNN, milliseconds for a WRN-16-4), and ``model``'s mode is restored.

    Privacy: the input is zeros of the public shape; nothing about the data is used.
    """
    spec = ModelSpec.parse(spec)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, *input_shape, device=_device_of(model)))
    except Exception as error:
        raise DPVisionError(_mismatch(spec, model, input_shape, error)) from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise DPVisionError(
            f"{spec} gives {got} for one input of shape {tuple(input_shape)}, not "
            f"(1, {num_classes}) logits: it must return the logits of each input"
        )


def _device_of(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _mismatch(
    spec: ModelSpec, model: nn.Module, input_shape: tuple[int, ...], error: Exception
) -> str:
    """The one line for a network that fails on inputs of ``input_shape``: what it takes
    (a timm model's ``pretrained_cfg``), and both fixes: the image size (``image_size``),
    the model's own size argument (``learner.model_args``).
    """
    channels, *size = (int(v) for v in input_shape)
    shown = f"{'×'.join(map(str, size))} ({channels} channels)"
    takes = _size_it_takes(model)
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
    if takes is not None:
        what = f"takes {'×'.join(str(v) for v in takes)} images, these are {shown}"
        image_fix = f"set image_size = {takes[-1]}"
    else:
        what = f"cannot take images of {shown}"
        image_fix = "set image_size to the size it takes"
    names = _init_parameters(model)
    size_args = [n for n in ("img_size", "image_size", "input_size") if n in names]
    if size_args:
        value = size[-1] if len(set(size)) == 1 else list(size)
        args_fix = f"learner.model_args = {{{size_args[0]} = {value}}}"
    else:
        args_fix = "learner.model_args with the size argument its constructor takes"
    return f"{spec} {what} ({reason}): {image_fix}, or give {args_fix}"


def _size_it_takes(model: nn.Module) -> tuple[int, int] | None:
    """The (height, width) a network takes, where it says: the size it was built for (a
    timm ViT's ``patch_embed.img_size``, which ``model_args = {img_size = …}`` sets), else
    its ``pretrained_cfg``'s input size (what its weights were trained at)."""
    built = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if isinstance(built, (tuple, list)) and len(built) == 2:
        return int(built[0]), int(built[1])
    cfg = getattr(model, "pretrained_cfg", None)
    takes = cfg.get("input_size") if isinstance(cfg, dict) else None
    if isinstance(takes, (tuple, list)) and len(takes) == 3:
        return int(takes[1]), int(takes[2])
    return None


def _init_parameters(model: nn.Module) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(type(model).__init__).parameters)
    except (TypeError, ValueError):
        return ()


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
    name: str | ModelSpec,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    groups: int = 27,
    batchnorm: str = "group-norm",
) -> nn.Module:
    """The model called ``name`` for inputs of ``input_shape``, fit for DP-SGD and validated
    (:func:`build_network`, then :func:`prepare_for_dp`; dpvision's own models have no
    BatchNorm)."""
    spec = ModelSpec.parse(name)
    model = build_network(spec, input_shape, num_classes, groups=groups)
    if not spec.external:
        validate_model(model)
        return model
    return prepare_for_dp(model, batchnorm, groups=16)
