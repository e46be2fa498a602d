"""Wide ResNets with GroupNorm and weight standardisation, for large-batch DP-SGD.

:class:`WideResNet` follows ``WideResNet`` in jax_privacy
(``jax_privacy/src/training/image_classification/models/cifar.py``), the network of De et al.
(2022), "Unlocking High-Accuracy Differentially Private Image Classification through Scale":
pre-activation blocks in the order activation → GroupNorm → weight-standardised convolution,
no batch normalisation, and TensorFlow ``SAME`` padding.
"""

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models._common import check_num_classes
from dpvision.models.layers import WSConv2d, variance_scaling_


class _Block(nn.Module):
    """One residual block: two (ReLU → GroupNorm → 3×3 WSConv) units plus the skip path.

    In the first block of a stage (``projection=True``) the skip path is a strided 1×1 WSConv
    of GroupNorm(ReLU(x)), with its own GroupNorm; otherwise it is the identity.
    """

    def __init__(
        self, in_channels: int, out_channels: int, stride: int, projection: bool, groups: int
    ) -> None:
        super().__init__()
        self.act = nn.ReLU()
        self.skip: nn.Module = nn.Identity()
        if projection:
            self.skip = nn.Sequential(
                nn.ReLU(),
                nn.GroupNorm(groups, in_channels),
                WSConv2d(in_channels, out_channels, 1, stride=stride, padding="same"),
            )
        self.norm_0 = nn.GroupNorm(groups, in_channels)
        self.conv_0 = WSConv2d(in_channels, out_channels, 3, stride=stride, padding="same")
        self.norm_1 = nn.GroupNorm(groups, out_channels)
        self.conv_1 = WSConv2d(out_channels, out_channels, 3, stride=1, padding="same")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns residual(x) + skip(x)."""
        out: torch.Tensor = self.conv_0(self.norm_0(self.act(x)))
        out = self.conv_1(self.norm_1(self.act(out)))
        skip: torch.Tensor = self.skip(x)
        return out + skip


class WideResNet(nn.Module):
    """WRN-depth-width with GroupNorm and WSConv2d, as in jax_privacy (De et al., 2022).

    Structure: a 3×3 WSConv stem with 16 channels; three stages of ``(depth − 4) / 6`` blocks
    with 16·width, 32·width and 64·width channels and strides 1, 2, 2 (see ``_Block``: each
    unit is ReLU → GroupNorm → 3×3 WSConv; the first block of every stage has a 1×1 WSConv
    skip path of GroupNorm(ReLU(x))); then ReLU → GroupNorm → global mean pool → linear.
    All convolutions use TensorFlow ``SAME`` padding; the linear head starts as Haiku's
    ``VarianceScaling(1.0)`` with a zero bias.

    WRN-16-4 with 3 input channels and 10 classes has 2,753,818 parameters (including the
    WSConv gains and the GroupNorm scales and offsets); WRN-10-1 has 78,938.

    Args:
        depth: Total depth; ``(depth − 4)`` must be a positive multiple of 6 (10, 16, 22, 28,
            40, ...).
        width: Width multiplier k.
        num_classes: Number of output logits.
        groups: Groups of every GroupNorm (16 in De et al.); must divide 16 · width.
        in_channels: Channels of the input images.

    Raises:
        DPVisionError: A depth that is not 6·n + 4, a non-positive width or in_channels,
            ``groups`` not dividing the channel counts, or fewer than two classes.
    """

    def __init__(
        self,
        depth: int = 16,
        width: int = 4,
        num_classes: int = 10,
        groups: int = 16,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 10 or (depth - 4) % 6:
            raise DPVisionError(
                f"WideResNet depth must be 6·n + 4 with n ≥ 1 (10, 16, 22, 28, 40, ...), "
                f"got {depth!r}"
            )
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise DPVisionError(f"WideResNet width must be a positive integer, got {width!r}")
        if isinstance(in_channels, bool) or not isinstance(in_channels, int) or in_channels < 1:
            raise DPVisionError(f"in_channels must be a positive integer, got {in_channels!r}")
        num_classes = check_num_classes(num_classes)
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or 16 % groups:
            raise DPVisionError(
                f"WideResNet groups must divide 16 (the stem's channels), got {groups!r}; "
                "De et al. use 16"
            )
        self.depth = depth
        self.width = width
        self.num_classes = num_classes
        blocks_per_stage = (depth - 4) // 6

        self.stem = WSConv2d(in_channels, 16, 3, stride=1, padding="same")
        stages: list[nn.Module] = []
        channels = 16
        for stage, stride in enumerate((1, 2, 2)):
            out_channels = 16 * (2**stage) * width
            blocks: list[nn.Module] = []
            for index in range(blocks_per_stage):
                blocks.append(
                    _Block(
                        channels,
                        out_channels,
                        stride=stride if index == 0 else 1,
                        projection=index == 0,
                        groups=groups,
                    )
                )
                channels = out_channels
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.final_act = nn.ReLU()
        self.final_norm = nn.GroupNorm(groups, channels)
        self.head = nn.Linear(channels, num_classes)
        variance_scaling_(self.head.weight, channels)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps images (N, C, H, W) to logits (N, num_classes)."""
        out = self.stages(self.stem(x))
        out = self.final_norm(self.final_act(out))
        result: torch.Tensor = self.head(out.mean(dim=(-2, -1)))
        return result


def wide_resnet(
    depth: int = 16, width: int = 4, num_classes: int = 10, groups: int = 16, in_channels: int = 3
) -> WideResNet:
    """Builds WRN-depth-width as in jax_privacy (De et al., 2022); WRN-16-4 by default.

    Args:
        depth: Total depth, 6·n + 4.
        width: Width multiplier.
        num_classes: Number of output logits.
        groups: Groups of every GroupNorm; must divide 16.
        in_channels: Channels of the input images.

    Returns:
        The network, in training mode.

    Raises:
        DPVisionError: An invalid depth, width, group count or class count.
    """
    return WideResNet(depth, width, num_classes, groups, in_channels)
