"""The rule of affine ``nn.InstanceNorm1d/2d/3d`` without running statistics: each example
and channel is normalised by its own statistics, so the per-example gradients are Σ g ⊙ x̂
(scale) and Σ g (offset) per channel, as for GroupNorm."""

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.per_example.layers.base import SmallRowsTerms, register_rule


def _check(module: nn.Module) -> str | None:
    if getattr(module, "track_running_stats", False):
        return (
            f"{type(module).__name__} with track_running_stats=True (its running statistics "
            "mix examples); use track_running_stats=False"
        )
    return None


@register_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, check=_check)
class InstanceNormTerms(SmallRowsTerms):
    """Affine InstanceNorm: rows (B, C) of Σ g ⊙ x̂ and Σ g over each channel's positions."""

    def parts(self, module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            normalised = F.instance_norm(x, eps=module.eps)  # type: ignore[arg-type]
        flat_g = g.reshape(g.shape[0], g.shape[1], -1)
        return {
            "weight": torch.einsum("bci,bci->bc", flat_g, normalised.reshape_as(flat_g)),
            "bias": flat_g.sum(-1),
        }
