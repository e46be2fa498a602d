"""The rule of affine ``nn.GroupNorm``: per-example gradients of the scale (Σ g ⊙ x̂) and the
offset (Σ g) are small, so they are formed directly."""

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.per_example.layers.base import (
    Call,
    LayerTerms,
    Strategy,
    grouped,
    register_rule,
    trainable,
)


@register_rule(nn.GroupNorm)
class GroupNormTerms(LayerTerms):
    """Affine GroupNorm: per-example gradients Σ g ⊙ x̂ (scale) and Σ g (offset) are small."""

    def __init__(
        self, module: nn.Module, calls: list[Call], views: int, strategy: Strategy = "auto"
    ) -> None:
        assert isinstance(module, nn.GroupNorm)
        self.rows: dict[str, torch.Tensor] = {}
        for x, g in calls:
            with torch.no_grad():
                normalised = F.group_norm(x, module.num_groups, eps=module.eps)
            flat_g = g.reshape(g.shape[0], g.shape[1], -1)
            parts = {
                "weight": torch.einsum("bci,bci->bc", flat_g, normalised.reshape_as(flat_g)),
                "bias": flat_g.sum(-1),
            }
            for name, rows in parts.items():
                if trainable(getattr(module, name)):
                    summed = grouped(rows, views)
                    self.rows[name] = self.rows[name] + summed if name in self.rows else summed
        first = calls[0][0]
        self.sq_norms = first.new_zeros(first.shape[0] // views)
        for rows in self.rows.values():
            self.sq_norms = self.sq_norms + rows.pow(2).sum(1)

    def clipped_sum(
        self, scale: torch.Tensor, drop: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        out = {}
        for name, rows in self.rows.items():
            if drop is not None:
                rows = rows.masked_fill(drop[:, None], 0)
            out[name] = scale.to(rows.dtype) @ rows
        return out
