"""The rule of ``nn.Embedding``: example i's gradient puts Σ of its output gradients gᵢₜ on
the rows of the tokens xᵢₜ it looked up (none on ``padding_idx``). Its squared norm is the
ghost sum Σₜₜ′ [xᵢₜ = xᵢₜ′] gᵢₜ·gᵢₜ′ (memory B·T²), the (V × d) gradient never formed; the
clipped sum adds cᵢ·gᵢₜ into row xᵢₜ."""

import torch
from torch import nn

from dpvision.per_example.layers.base import Call, LayerTerms, Strategy, register_rule


def _check(module: nn.Module) -> str | None:
    assert isinstance(module, nn.Embedding)
    if module.max_norm is not None:
        return "Embedding with max_norm (it rescales rows in place during forward)"
    if module.sparse:
        return "Embedding with sparse=True (the clipped sum is a dense gradient)"
    return None


@register_rule(nn.Embedding, check=_check)
class EmbeddingTerms(LayerTerms):
    """Embedding: ghost norms over each example's positions; the clipped sum by index_add."""

    def __init__(
        self, module: nn.Module, calls: list[Call], views: int, strategy: Strategy = "auto"
    ) -> None:
        assert isinstance(module, nn.Embedding)
        self.module = module
        tokens, grads = [], []
        for x, g in calls:
            batch = x.shape[0] // views
            tokens.append(x.reshape(batch, -1))  # (B, K·T) token ids
            grads.append(g.reshape(batch, -1, g.shape[-1]))  # (B, K·T, d)
        self.tokens = torch.cat(tokens, dim=1)
        self.grads = torch.cat(grads, dim=1)
        if module.padding_idx is not None:  # PyTorch gives the padding row no gradient
            keep = self.tokens != module.padding_idx
            self.grads = self.grads * keep.unsqueeze(-1).to(self.grads.dtype)
        same = (self.tokens.unsqueeze(2) == self.tokens.unsqueeze(1)).to(self.grads.dtype)
        products = torch.einsum("btd,bsd->bts", self.grads, self.grads)
        self.sq_norms = (same * products).sum((1, 2)).clamp(min=0)

    def clipped_sum(
        self, scale: torch.Tensor, drop: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        grads = self.grads
        if drop is not None:
            grads = grads.masked_fill(drop[:, None, None], 0)
        weighted = grads * scale.to(grads.dtype)[:, None, None]
        out = torch.zeros_like(self.module.weight)
        out.index_add_(0, self.tokens.reshape(-1), weighted.reshape(-1, grads.shape[-1]))
        return {"weight": out}
