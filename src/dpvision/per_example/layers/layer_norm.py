"""The rule of ``nn.LayerNorm`` (elementwise affine) on any leading shape (B, …, *shape):
example i's gradients are Σ over its positions of g ⊙ x̂ (scale) and g (offset)."""

import math

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.per_example.layers.base import SmallRowsTerms, position_sums, register_rule


@register_rule(nn.LayerNorm)
class LayerNormTerms(SmallRowsTerms):
    """LayerNorm: rows (B, ∏ normalized_shape) of Σₜ gₜ ⊙ x̂ₜ and Σₜ gₜ."""

    def parts(self, module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
        assert isinstance(module, nn.LayerNorm)
        shape = tuple(module.normalized_shape)
        with torch.no_grad():
            normalised = F.layer_norm(x, shape, eps=module.eps)
        size = math.prod(shape)
        return {
            "weight": position_sums(g, normalised, size),
            "bias": g.reshape(g.shape[0], -1, size).sum(1),
        }
