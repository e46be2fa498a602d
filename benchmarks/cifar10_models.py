"""The WRN variants of De et al.'s ablation (seed 003, Table 2), for ``benchmarks/cifar10.py``.

``learner.model = "python:benchmarks/cifar10_models.py:wrn"`` with ``learner.model_args =
{depth = 10, width = 1, group_norm = false, standardize = false}``: dpvision's Wide ResNet
(:mod:`dpvision.models.wide_resnet`, GroupNorm and weight-standardised convolutions) with its
GroupNorms replaced by the identity (``group_norm = false``: the paper's baseline "WRN without
batch normalization") and/or its convolutions by plain ``nn.Conv2d`` with the same
initialisation, padding and stride (``standardize = false``). Both ``true`` is the WRN
``wrn-DEPTH-WIDTH`` builds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.models.layers import WSConv2d, same_padding
from dpvision.models.wide_resnet import wide_resnet


class _SamePadConv(nn.Module):
    """A plain ``nn.Conv2d`` behind TensorFlow ``SAME`` padding (what WSConv2d pads)."""

    def __init__(self, conv: WSConv2d) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.same = conv.kernel_size, conv.stride, conv.padding
        padding = 0 if conv.padding == "same" else conv.padding
        self.conv = nn.Conv2d(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, padding
        )
        self.conv.weight.data.copy_(conv.weight.data)
        self.conv.bias.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.same == "same":
            top, bottom = same_padding(x.shape[-2], self.kernel_size, self.stride)
            left, right = same_padding(x.shape[-1], self.kernel_size, self.stride)
            x = F.pad(x, (left, right, top, bottom))
        return self.conv(x)


def _swap(module: nn.Module, group_norm: bool, standardize: bool) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.GroupNorm) and not group_norm:
            setattr(module, name, nn.Identity())
        elif isinstance(child, WSConv2d) and not standardize:
            setattr(module, name, _SamePadConv(child))
        else:
            _swap(child, group_norm, standardize)


def wrn(
    num_classes: int,
    in_chans: int,
    depth: int = 16,
    width: int = 4,
    group_norm: bool = True,
    standardize: bool = True,
) -> nn.Module:
    """A ``wrn-DEPTH-WIDTH`` with or without its GroupNorms and weight standardisation."""
    model = wide_resnet(depth, width, num_classes=num_classes, groups=16, in_channels=in_chans)
    _swap(model, group_norm, standardize)
    return model
