"""Small models that each exercise layer kinds of the per-example rules (tests share them).

Every model takes (N, *shape) inputs and returns (N, classes) logits; sizes are arguments so
that the sensitivity tests can draw random layouts.
"""

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpvision.models import FrozenBatchNorm


class ConvZoo(nn.Module):
    """Depthwise Conv2d (circular, 'same') + FrozenBatchNorm, grouped Conv2d (replicate,
    stride 2) + BatchNorm2d in eval mode, Conv1d (groups 2, dilation 2, reflect), Conv3d
    (anisotropic stride), RMSNorm. Input (channels, 8, 8), channels even."""

    def __init__(self, channels: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 3, groups=channels, padding="same")
        self.depthwise.padding_mode = "circular"
        self.frozen = FrozenBatchNorm(channels)
        self.grouped = nn.Conv2d(
            channels, 6, 3, groups=2, stride=2, padding=1, padding_mode="replicate"
        )
        self.bn = nn.BatchNorm2d(6).eval()
        self.conv1d = nn.Conv1d(6, 4, 3, groups=2, dilation=2, padding=2, padding_mode="reflect")
        self.conv3d = nn.Conv3d(1, 2, (2, 3, 3), stride=(1, 2, 1))
        self.rms = nn.RMSNorm(12)
        self.head = nn.Linear(12, classes)
        with torch.no_grad():
            for norm in (self.frozen, self.bn):
                norm.running_mean.uniform_(-0.5, 0.5)
                norm.running_var.uniform_(0.5, 2.0)
                norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.depthwise(x)))  # (N, C, 8, 8)
        h = torch.tanh(self.bn(self.grouped(h)))  # (N, 6, 4, 4)
        seq = torch.tanh(self.conv1d(h.flatten(2)))  # (N, 4, 16)
        vol = torch.tanh(self.conv3d(seq.reshape(-1, 1, 4, 4, 4)))  # (N, 2, 3, 1, 2)
        return self.head(self.rms(vol.flatten(1)))


class LayerScaleBlock(nn.Module):
    """Pre-norm self-attention and MLP, each scaled by a free per-channel parameter; the
    LayerNorm is called twice."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.gamma_mlp = nn.Parameter(torch.full((dim,), 0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.gamma * self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm(x)) * (2 * self.gamma_mlp - 0.5)


class TinyViT(nn.Module):
    """Patch embedding, class token (expand + cat), position embedding (sliced, added twice),
    a TransformerEncoderLayer, a block with layer scales, head. Input (2, 8, 8)."""

    def __init__(self, dim: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.patch = nn.Conv2d(2, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, 8, dim) * 0.1)
        self.encoder = nn.TransformerEncoderLayer(
            dim, 2, 2 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.block = LayerScaleBlock(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)  # (N, 4, dim)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        pos = self.pos_embed[:, : tokens.shape[1] + 1]
        tokens = torch.cat([cls, tokens], dim=1) + pos
        tokens = self.block(self.encoder(tokens)) + 0.5 * pos
        return self.head(tokens[:, 0])


class ConvNeXtBlock(nn.Module):
    """Depthwise 7×7, channels-last LayerNorm, MLP, layer scale (reshaped), residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        h = self.fc2(F.gelu(self.fc1(h))).permute(0, 3, 1, 2)
        return x + h * self.gamma.reshape(1, -1, 1, 1)


class TinyConvNeXt(nn.Module):
    """Stem, two ConvNeXt blocks, pooled head. Input (2, 8, 8)."""

    def __init__(self, dim: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, dim, 2, stride=2)
        self.blocks = nn.Sequential(ConvNeXtBlock(dim), ConvNeXtBlock(dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class CrossAttention(nn.Module):
    """MultiheadAttention between two sequences with a per-example padding mask and a float
    attention mask, its averaged weights used by the output; one with kdim, vdim ≠
    embed_dim, called twice. Input (5, 4)."""

    def __init__(self, dim: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.attn = nn.MultiheadAttention(dim, 3 if dim % 3 == 0 else 2, batch_first=True)
        self.other = nn.MultiheadAttention(dim, 2, kdim=4, vdim=5, batch_first=True)
        self.head = nn.Linear(dim + 5, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.embed(x)  # (N, 5, dim)
        memory = torch.tanh(q[:, :3] * 2)
        pad = x[:, :3, 0] > 1.0  # some keys masked, per example
        pad[:, 0] = False
        mask = torch.triu(torch.full((5, 3), -0.5, dtype=x.dtype), diagonal=1)
        pad_mask = torch.zeros(pad.shape, dtype=x.dtype).masked_fill(pad, float("-inf"))
        out, weights = self.attn(q, memory, memory, key_padding_mask=pad_mask, attn_mask=mask)
        values = x[:, :4, :1].expand(-1, -1, 5)
        out2, _ = self.other(out, x[:, :4], values, need_weights=False)
        out2, _ = self.other(out2, x[:, 1:], values, need_weights=False)
        return self.head(torch.cat([out2.mean(1), weights.flatten(1)[:, :5]], 1))


class MaskedEncoder(nn.Module):
    """A TransformerEncoderLayer with a per-example key padding mask (its attention weights
    unused) and a causal self-attention with a float mask. Input (5, 6)."""

    def __init__(self, dim: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(dim, 2, 8, dropout=0.0, batch_first=True)
        self.attn = nn.MultiheadAttention(dim, 3, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = x[:, :, 0] > 1.0  # some positions masked, per example
        pad[:, 0] = False
        h = self.encoder(x, src_key_padding_mask=pad)
        causal = torch.triu(torch.full((5, 5), float("-inf"), dtype=x.dtype), diagonal=1)
        out, _ = self.attn(h, h, h, attn_mask=causal, need_weights=False)
        return self.head(out.mean(1))


class ScaleShift(nn.Module):
    """A leaf layer no rule knows: x·scale + sin(shift)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, features))
        self.shift = nn.Parameter(torch.linspace(-1.0, 1.0, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + torch.sin(self.shift)


def unknown_leaf(features: int = 4, classes: int = 3) -> nn.Module:
    """Linear, an unknown leaf layer (torch.func on it alone), Linear. Input (features,)."""
    return nn.Sequential(nn.Linear(features, 5), nn.Tanh(), ScaleShift(5), nn.Linear(5, classes))


ZOO = {
    "conv-zoo": (ConvZoo, (4, 8, 8)),
    "vit": (TinyViT, (2, 8, 8)),
    "convnext": (TinyConvNeXt, (2, 8, 8)),
    "cross-attention": (CrossAttention, (5, 4)),
    "masked-encoder": (MaskedEncoder, (5, 6)),
    "unknown-leaf": (unknown_leaf, (4,)),
}
