"""The rule of ``nn.PReLU``: y = max(0, x) + a·min(0, x), so example i's gradient of a is
Σ g ⊙ min(0, x), over everything (one a) or per channel (dimension 1)."""

import torch
from torch import nn

from dpvision.per_example.layers.base import SmallRowsTerms, register_rule


@register_rule(nn.PReLU)
class PReLUTerms(SmallRowsTerms):
    """PReLU: rows (B, num_parameters) of Σ g ⊙ min(0, x)."""

    def parts(self, module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
        assert isinstance(module, nn.PReLU)
        products = g * x.detach().clamp(max=0)
        if module.num_parameters == 1:
            return {"weight": products.reshape(products.shape[0], -1).sum(1, keepdim=True)}
        channels = products.reshape(products.shape[0], products.shape[1], -1)
        return {"weight": channels.sum(-1)}
