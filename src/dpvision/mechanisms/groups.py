"""Group-wise (per-layer) clipping: a clip norm per group of parameters.

Flat clipping bounds each example's whole gradient by C. Group-wise clipping (Opacus
``clipping="per_layer"``, JAX Privacy's per-PyTree norms, FastDP's group-wise clipping)
bounds each example's gradient *restricted to group g* by C_g, so every group can be
clipped, and released, as soon as its own gradients exist. One example then moves the
joint release by at most √(Σ_g C_g²): that is the sensitivity the noise is scaled to.

Here a group is a layer: the module that owns a trainable parameter (``fc1.weight`` and
``fc1.bias`` are the group ``fc1``). ``per_layer(model, C)`` gives every one of the G
groups C/√G, so the sensitivity, and hence the noise, is that of flat clipping at C.

>>> from torch import nn
>>> groups = per_layer(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)), 1.0)
>>> layer, norm = groups.norms[0]
>>> len(groups.norms), layer, round(norm, 4)
(2, '0', 0.7071)
>>> round(groups.l2_sensitivity, 6)
1.0
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.mechanisms import clipping


def group_of(name: str) -> str:
    """The group (layer) of a parameter name: its module path (``""`` for the root)."""
    return name.rpartition(".")[0]


@dataclass(frozen=True)
class GroupNorms:
    """Clip norms C_g of the groups, in the order of the model's parameters.

    Attributes:
      norms: (group, C_g) pairs.
    """

    norms: tuple[tuple[str, float], ...]

    def __post_init__(self) -> None:
        for group, norm in self.norms:
            if not (math.isfinite(norm) and norm > 0):
                raise DPVisionError(f"the clip norm of group {group!r} must be > 0, got {norm}")

    @property
    def l2_sensitivity(self) -> float:
        """√(Σ_g C_g²): how far one example can move the joint clipped sum."""
        return math.sqrt(sum(norm * norm for _, norm in self.norms))

    def norm(self, group: str) -> float:
        """C_g."""
        for name, value in self.norms:
            if name == group:
                return value
        raise DPVisionError(f"no clip norm for the parameters of {group or 'the root'}")

    def factors(
        self, sq_norms: Mapping[str, torch.Tensor], keep: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Per-example clip factors of each group, min(1, C_g/‖g_{i,g}‖), from each group's
        squared per-example norms; zero where ``keep`` is false.

        Privacy:
          Releases nothing; with these factors each example adds at most C_g to group g,
          √(Σ_g C_g²) to the whole sum.
        """
        return {
            group: clipping.clip_factors(sq.sqrt(), self.norm(group), keep)
            for group, sq in sq_norms.items()
        }


def per_layer(model: nn.Module, max_grad_norm: float | Sequence[float]) -> GroupNorms:
    """One group per layer with trainable parameters, in parameter order.

    ``max_grad_norm``: a number C (each of the G groups gets C/√G: the sensitivity stays C)
    or one norm per group.
    """
    groups = list(
        dict.fromkeys(group_of(n) for n, p in model.named_parameters() if p.requires_grad)
    )
    if not groups:
        raise DPVisionError("per-layer clipping needs a model with trainable parameters")
    if isinstance(max_grad_norm, int | float):
        share = float(max_grad_norm) / math.sqrt(len(groups))
        return GroupNorms(tuple((group, share) for group in groups))
    norms = [float(norm) for norm in max_grad_norm]
    if len(norms) != len(groups):
        raise DPVisionError(
            f"per-layer clipping takes one max_grad_norm per layer with trainable parameters "
            f"({len(groups)}: {', '.join(g or '<root>' for g in groups)}), got {len(norms)}"
        )
    return GroupNorms(tuple(zip(groups, norms, strict=True)))
