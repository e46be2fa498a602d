"""The rule of affine ``nn.GroupNorm``: per-example gradients of the scale (Σ g ⊙ x̂) and the
offset (Σ g) are small, so they are formed directly."""

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.per_example.layers.base import SmallRowsTerms, register_rule


@register_rule(nn.GroupNorm)
class GroupNormTerms(SmallRowsTerms):
    """Affine GroupNorm: per-example gradients Σ g ⊙ x̂ (scale) and Σ g (offset) per channel."""

    def parts(self, module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
        assert isinstance(module, nn.GroupNorm)
        with torch.no_grad():
            normalised = F.group_norm(x, module.num_groups, eps=module.eps)
        flat_g = g.reshape(g.shape[0], g.shape[1], -1)
        return {
            "weight": torch.einsum("bci,bci->bc", flat_g, normalised.reshape_as(flat_g)),
            "bias": flat_g.sum(-1),
        }
