"""The transformer-era models of the DP-SGD speed benchmark, in plain PyTorch (no timm).

* :class:`ViT`: ViT-Tiny-like — a 4×4 patch embedding, a class token and learned position
  embeddings (free parameters), pre-norm blocks of ``nn.MultiheadAttention`` and a GELU MLP,
  a final LayerNorm and a Linear head (timm's ``vit_tiny_patch16_224`` shape: width 192,
  3 heads, MLP ratio 4; here patch 4 on 32×32 inputs).
* :class:`ConvNeXt`: a ConvNeXt-like block stack — a strided stem, blocks of depthwise 7×7
  convolution, channels-last LayerNorm, a GELU MLP and a layer scale (a free parameter),
  with residuals; mean-pooled LayerNorm and Linear head.

Both take (N, 3, 32, 32) images and return (N, classes) logits.
"""

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """ViT-Tiny-like classifier of 32×32 images (see the module docstring)."""

    def __init__(
        self, depth: int = 6, dim: int = 192, heads: int = 3, patch: int = 4, classes: int = 10
    ) -> None:
        super().__init__()
        tokens = (32 // patch) ** 2
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class ConvNeXtBlock(nn.Module):
    """x + γ ⊙ MLP(LayerNorm(depthwise 7×7 conv(x))), channels-last inside."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        h = self.fc2(F.gelu(self.fc1(h))) * self.gamma
        return x + h.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """ConvNeXt-like classifier of 32×32 images (see the module docstring)."""

    def __init__(self, depth: int = 4, dim: int = 64, stem: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, stem, stride=stem)
        self.blocks = nn.Sequential(*(ConvNeXtBlock(dim) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.stem(x)).mean((2, 3))))
