"""The checks and defaults ``PrivacyEngine.make_private`` applies to its arguments before any
work: options dpvision does not take, the criterion's reduction, the module's layers and the
optimizer's parameters, the augmentation's public seed.

Privacy:
  Reads only the call's arguments and the model's structure (public); releases nothing.
"""

import math

import numpy as np
import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.mechanisms.clip_policy import CLIP_POLICIES
from dpvision.models import validate_model
from dpvision.per_example.bookkeeping import unsupported_layers

LOSS_REDUCTIONS = ("mean", "sum")
# Opacus' ways of computing per-sample gradients; dpvision's rules serve them all.
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost")


def check_options(
    *,
    clipping: str,
    grad_sample_mode: str,
    batch_first: bool,
    poisson_sampling: bool,
    noise_multiplier: float,
    loss_reduction: str,
    augmult: int,
    ema_decay: float | None,
    max_physical_batch_size: int | None,
) -> None:
    """Refuses, in one line, an argument of ``make_private`` dpvision does not take."""
    if clipping not in CLIP_POLICIES:
        raise DPVisionError(
            f"clipping={clipping!r} is not offered: choose clipping='flat' (each example's "
            "whole gradient clipped to max_grad_norm), 'per_layer' or 'adaptive'"
        )
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise DPVisionError(
            f"unknown grad_sample_mode {grad_sample_mode!r}; choose one of "
            f"{', '.join(GRAD_SAMPLE_MODES)} (all clip alike here)"
        )
    if not batch_first:
        raise DPVisionError(
            "batch_first=False is not offered: keep the examples first in every layer"
        )
    if not poisson_sampling:
        raise DPVisionError(
            "poisson_sampling=False is not offered: the privacy accounting assumes Poisson "
            "sampling, which the private data loader provides"
        )
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise DPVisionError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise DPVisionError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if isinstance(augmult, bool) or not isinstance(augmult, int) or augmult < 0:
        raise DPVisionError(f"augmult must be an integer >= 0, got {augmult!r}")
    if ema_decay is not None and not 0 <= ema_decay < 1:
        raise DPVisionError(f"ema_decay must be in [0, 1) or None, got {ema_decay}")
    if max_physical_batch_size is not None and max_physical_batch_size < 1:
        raise DPVisionError(f"max_physical_batch_size must be >= 1, got {max_physical_batch_size}")


def prepare_criterion(criterion: nn.Module | None, loss_reduction: str) -> nn.Module:
    """The loss (default: cross-entropy), whose reduction must agree with ``loss_reduction``."""
    if criterion is None:
        criterion = nn.CrossEntropyLoss(reduction=loss_reduction)
    reduction = getattr(criterion, "reduction", loss_reduction)
    if reduction not in (loss_reduction, "none"):
        raise DPVisionError(
            f"the criterion reduces by {reduction!r} but loss_reduction is "
            f"{loss_reduction!r}; they must agree"
        )
    return criterion


def check_module(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuses a module a rule refuses (BatchNorm in training mode, ...) and an optimizer
    over parameters that are not the module's trainable ones (updated without privacy)."""
    validate_model(module)
    problems = unsupported_layers(module)
    if problems:
        raise DPVisionError(f"make_private does not support {problems[0]}")
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    if any(id(p) not in trainable for g in optimizer.param_groups for p in g["params"]):
        raise DPVisionError(
            "the optimizer holds parameters that are not trainable parameters of the module; "
            "they would be updated without privacy"
        )


def augment_seed(seed: int | None) -> int:
    """The augmentation's seed from the public ``seed``: the adversary may know it, so it
    draws only the augmentation."""
    return int(np.random.SeedSequence(seed).generate_state(1, np.uint64)[0] >> np.uint64(1))
