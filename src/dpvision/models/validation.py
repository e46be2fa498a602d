"""Checks that a model keeps examples apart, as per-example clipping requires.

DP-SGD clips each example's gradient, which bounds one example's influence only if the loss
of an example depends on that example alone. Batch normalisation breaks this: in training it
normalises with statistics of the whole batch, and its running statistics are averages over
examples. :func:`validate_model` rejects such layers; :func:`replace_batchnorm` swaps them for
GroupNorm, like Opacus' ``ModuleValidator.fix``, and :func:`freeze_batchnorm` for
:class:`~dpvision.models.layers.FrozenBatchNorm` (pre-trained statistics kept, for
fine-tuning).
"""

import copy

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from dpvision.errors import DPVisionError
from dpvision.models.layers import FrozenBatchNorm


def _layer_name(path: str) -> str:
    return f"layer '{path}'" if path else "the model's root"


def batch_norm_problem(module: nn.Module, where: str) -> str | None:
    """Why the BatchNorm ``module`` at ``where`` mixes examples, with both fixes, or None.

    BatchNorm in training mode normalises with statistics of the whole batch; in evaluation
    mode with running statistics (frozen) it normalises each example on its own, like
    :class:`~dpvision.models.layers.FrozenBatchNorm`.
    """
    if not isinstance(module, _BatchNorm):
        return None
    if not module.training and module.running_mean is not None:
        return None
    channels = int(module.num_features)
    example = (
        f"nn.GroupNorm({_largest_divisor_at_most(channels, 16)}, {channels})"
        if channels > 0
        else "nn.GroupNorm(16, C)"
    )
    fixes = f"with GroupNorm (e.g. {example})"
    if module.running_mean is not None:
        fixes += " or freeze its statistics to fine-tune (freeze_batchnorm(model))"
    return (
        f"replace {type(module).__name__} at {where} {fixes}: BatchNorm mixes examples in a "
        "batch, which breaks per-example clipping"
    )


def model_problems(model: nn.Module) -> list[str]:
    """One line for each layer of ``model`` that mixes examples (see :func:`validate_model`)."""
    problems = []
    for path, module in model.named_modules():
        kind = type(module).__name__
        problem = batch_norm_problem(module, _layer_name(path))
        if problem is not None:  # BatchNorm1d/2d/3d, SyncBatchNorm, lazy variants.
            problems.append(problem)
        elif isinstance(module, _InstanceNorm) and module.track_running_stats:
            problems.append(
                f"replace {kind} at {_layer_name(path)} with one that has "
                "track_running_stats=False (or GroupNorm): its running statistics average "
                "over examples, which breaks per-example clipping"
            )
    return problems


def validate_model(model: nn.Module) -> None:
    """Raises if any layer of ``model`` mixes the examples of a batch.

    Rejected: BatchNorm (``BatchNorm1d/2d/3d``, ``SyncBatchNorm`` and the lazy variants) in
    training mode or without running statistics, and InstanceNorm with
    ``track_running_stats=True``. GroupNorm, LayerNorm, InstanceNorm without running
    statistics, :class:`~dpvision.models.layers.FrozenBatchNorm` and BatchNorm in evaluation
    mode normalise each example on its own and are fine (a trainer that calls
    ``model.train()`` turns BatchNorm back to batch statistics: use
    :func:`freeze_batchnorm` there).

    Args:
        model: The model to check.

    Raises:
        DPVisionError: One line naming the first offending layer's path and what to use
            instead (and how many other layers are affected).

    >>> from torch import nn
    >>> validate_model(nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8)))
    >>> validate_model(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dpvision.errors.DPVisionError: replace BatchNorm2d at layer '1' with GroupNorm (e.g. ...
    """
    problems = model_problems(model)
    if problems:
        more = len(problems) - 1
        plural = "s" if more > 1 else ""
        suffix = f" (and {more} more such layer{plural}; replace_batchnorm(model) fixes them all)"
        raise DPVisionError(problems[0] + (suffix if more else ""))


def _largest_divisor_at_most(channels: int, groups: int) -> int:
    for candidate in range(min(groups, channels), 0, -1):
        if channels % candidate == 0:
            return candidate
    return 1


def _group_norm_for(module: nn.Module, groups: int) -> nn.GroupNorm:
    assert isinstance(module, _BatchNorm | _InstanceNorm)
    channels = int(module.num_features)
    if channels < 1:
        raise DPVisionError(
            f"cannot replace the uninitialised {type(module).__name__}; run one forward pass "
            "through the model first, or use a non-lazy layer"
        )
    if isinstance(module, _InstanceNorm):
        groups = channels  # GroupNorm(C, C) is InstanceNorm without running statistics.
    elif isinstance(module, nn.BatchNorm1d):
        # BatchNorm1d mostly sees (N, C) features, where a group of C/g < C single values
        # would normalise to ±1 or 0; one group normalises each example like LayerNorm.
        groups = 1
    else:
        groups = _largest_divisor_at_most(channels, groups)
    norm = nn.GroupNorm(groups, channels, eps=module.eps, affine=module.affine)
    norm.train(module.training)
    return norm


def replace_batchnorm(model: nn.Module, groups: int = 16) -> nn.Module:
    """Returns a copy of ``model`` in which no layer mixes examples, for DP-SGD.

    Every ``BatchNorm2d``, ``BatchNorm3d`` and ``SyncBatchNorm`` with C channels becomes
    ``nn.GroupNorm(g, C)``, where g is the largest divisor of C that is at most ``groups``
    (so ``min(groups, C)`` whenever it divides C), with the same ``eps`` and ``affine``.
    ``BatchNorm1d`` becomes ``nn.GroupNorm(1, C)``: on (N, C) features, smaller groups would
    hold too few values to normalise (a group of one value always becomes 0). Like
    Opacus' ``ModuleValidator.fix``, the new layers start fresh (scale 1, offset 0): the
    BatchNorm statistics and parameters are not carried over. InstanceNorm layers with
    running statistics become ``nn.GroupNorm(C, C)``, which is InstanceNorm without them.
    ``model`` itself is left unchanged.

    Args:
        model: The model to fix.
        groups: The preferred number of GroupNorm groups (16 in De et al.).

    Returns:
        The fixed copy; :func:`validate_model` accepts it.

    Raises:
        DPVisionError: ``groups`` is not a positive integer, or a lazy BatchNorm is still
            uninitialised.
    """
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise DPVisionError(f"groups must be a positive integer, got {groups!r}")

    def needs_fix(module: nn.Module) -> bool:
        return isinstance(module, _BatchNorm) or (
            isinstance(module, _InstanceNorm) and module.track_running_stats
        )

    if needs_fix(model):
        return _group_norm_for(model, groups)
    fixed = copy.deepcopy(model)
    for _, parent in list(fixed.named_modules()):
        for name, child in list(parent.named_children()):
            if needs_fix(child):
                setattr(parent, name, _group_norm_for(child, groups))
    return fixed


def freeze_batchnorm(model: nn.Module) -> nn.Module:
    """Returns a copy of ``model`` whose BatchNorm layers use their running statistics only.

    Every ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` becomes a
    :class:`~dpvision.models.layers.FrozenBatchNorm` with its statistics, ``eps``, scale and
    offset: the model computes what it computed in evaluation mode, in training mode too,
    and the scale and offset stay trainable (per-example clipping has a rule for them). The
    way to fine-tune a pre-trained CNN with DP-SGD without re-learning normalisation from
    scratch (:func:`replace_batchnorm` starts fresh GroupNorm layers instead). ``model``
    itself is left unchanged.

    Raises:
        DPVisionError: a BatchNorm without running statistics (nothing to freeze).
    """
    if isinstance(model, _BatchNorm):
        return FrozenBatchNorm.from_batch_norm(model)
    frozen = copy.deepcopy(model)
    for _, parent in list(frozen.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _BatchNorm):
                replacement = FrozenBatchNorm.from_batch_norm(child)
                replacement.train(child.training)
                setattr(parent, name, replacement)
    return frozen
