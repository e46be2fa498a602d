"""The rule of ``nn.RMSNorm`` (elementwise affine) on any leading shape (B, …, *shape):
example i's scale gradient is Σ over its positions of g ⊙ x̂, with x̂ = x / rms(x)."""

import math

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.per_example.layers.base import SmallRowsTerms, position_sums, register_rule


@register_rule(nn.RMSNorm)
class RMSNormTerms(SmallRowsTerms):
    """RMSNorm: rows (B, ∏ normalized_shape) of Σₜ gₜ ⊙ x̂ₜ."""

    def parts(self, module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
        assert isinstance(module, nn.RMSNorm)
        shape = tuple(module.normalized_shape)
        with torch.no_grad():
            normalised = F.rms_norm(x, shape, eps=module.eps)
        return {"weight": position_sums(g, normalised, math.prod(shape))}
