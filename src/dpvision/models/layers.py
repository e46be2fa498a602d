"""Weight-standardised convolution, the convolution of De et al.'s DP-SGD WideResNets.

:class:`WSConv2d` follows ``WSConv2D`` in jax_privacy
(``jax_privacy/src/training/image_classification/models/common.py``): scaled weight
standardisation with a learnable per-channel gain and an always-present bias. The weight is
standardised in :meth:`WSConv2d.forward`, so gradients (and per-example gradients) flow
through the standardisation, exactly as in the JAX code.
"""

import math
from typing import Literal

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.errors import DPVisionError

# Haiku's VarianceScaling(1.0, "fan_in", "truncated_normal") divides the standard deviation by
# the std of a unit normal truncated to [-2, 2], so the truncated draws have std 1/√fan_in.
_TRUNCATED_NORMAL_STD = 0.87962566103423978


def variance_scaling_(weight: torch.Tensor, fan_in: int) -> torch.Tensor:
    """Fills ``weight`` in place like Haiku's ``VarianceScaling(1.0)``: std 1/√fan_in.

    The draws are from a normal distribution truncated at two standard deviations and rescaled
    so that their standard deviation is 1/√fan_in.

    Args:
        weight: The parameter to fill.
        fan_in: The number of inputs of each output unit.

    Returns:
        ``weight``, filled.
    """
    std = 1.0 / math.sqrt(fan_in) / _TRUNCATED_NORMAL_STD
    with torch.no_grad():
        return nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std)


def same_padding(size: int, kernel_size: int, stride: int) -> tuple[int, int]:
    """TensorFlow/Haiku ``SAME`` padding of one spatial dimension: (before, after).

    The output has ``ceil(size / stride)`` positions; when the total padding is odd, the extra
    row or column goes after (for example a 3×3 convolution with stride 2 on an even size pads
    0 before and 1 after).

    >>> same_padding(32, 3, 2)
    (0, 1)
    >>> same_padding(32, 3, 1)
    (1, 1)
    """
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel_size - size, 0)
    return total // 2, total - total // 2


class WSConv2d(nn.Module):
    """2-D convolution with scaled weight standardisation, a learnable gain and a bias.

    Follows jax_privacy's ``WSConv2D`` (De et al., 2022, "Unlocking High-Accuracy
    Differentially Private Image Classification through Scale"). The weight used in the
    convolution is

        ŵ = (w − mean) · gain / sqrt(max(fan_in · var, 1e-4)),

    where the mean and the biased variance are taken per output channel over
    (C_in, kH, kW) and ``fan_in = C_in · kH · kW``. ``weight`` starts as Haiku's
    ``VarianceScaling(1.0)`` (truncated normal with std 1/√fan_in), ``gain`` at one and
    ``bias`` at zero.

    Args:
        in_channels: Input channels C_in.
        out_channels: Output channels C_out.
        kernel_size: Side of the square kernel.
        stride: Stride of the convolution.
        padding: Zero padding on each side, or ``"same"`` for TensorFlow/Haiku ``SAME`` padding
            (output size ``ceil(input / stride)``, any odd extra padding after), as in
            jax_privacy.
        eps: Lower bound on ``fan_in · var`` (1e-4 in jax_privacy).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int | Literal["same"] = 0,
        eps: float = 1e-4,
    ) -> None:
        super().__init__()
        if min(in_channels, out_channels, kernel_size, stride) < 1:
            raise DPVisionError(
                "WSConv2d needs positive in_channels, out_channels, kernel_size and stride, got "
                f"{in_channels}, {out_channels}, {kernel_size}, {stride}"
            )
        if padding != "same" and (not isinstance(padding, int) or padding < 0):
            raise DPVisionError(
                f"WSConv2d padding must be a non-negative integer or 'same', got {padding!r}"
            )
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.stride = stride
        self.padding: int | Literal["same"] = padding
        self.eps = eps
        self.fan_in = in_channels * kernel_size * kernel_size
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size, kernel_size))
        self.gain = nn.Parameter(torch.ones(out_channels, 1, 1, 1))
        self.bias = nn.Parameter(torch.zeros(out_channels))
        variance_scaling_(self.weight, self.fan_in)

    def standardized_weight(self) -> torch.Tensor:
        """The weight ŵ that the convolution uses (differentiable in weight and gain)."""
        mean = self.weight.mean(dim=(1, 2, 3), keepdim=True)
        var = self.weight.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        scale = torch.rsqrt(torch.clamp(var * self.fan_in, min=self.eps)) * self.gain
        return self.weight * scale - mean * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Convolves ``x`` (N, C_in, H, W) with the standardised weight and adds the bias."""
        weight = self.standardized_weight()
        if self.padding == "same":
            top, bottom = same_padding(x.shape[-2], self.kernel_size, self.stride)
            left, right = same_padding(x.shape[-1], self.kernel_size, self.stride)
            if top or bottom or left or right:
                x = F.pad(x, (left, right, top, bottom))
            return F.conv2d(x, weight, self.bias, stride=self.stride)
        return F.conv2d(x, weight, self.bias, stride=self.stride, padding=self.padding)

    def extra_repr(self) -> str:
        """Describes the layer in ``print(model)``."""
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding!r}"
        )


class FrozenBatchNorm(nn.Module):
    """BatchNorm with frozen running statistics and a trainable affine (scale and offset).

    For fine-tuning a pre-trained CNN with DP-SGD: every example is normalised with the
    statistics the pre-training left, in training as in evaluation, so no example's output
    depends on another's. Unlike torchvision's ``FrozenBatchNorm2d``, ``weight`` and ``bias``
    stay parameters (trainable unless you freeze them). Its ``state_dict`` keys are
    BatchNorm's, so pre-trained checkpoints load unchanged.

    Args:
        num_features: Channels C (dimension 1 of the input).
        eps: Added to the variance.
    """

    running_mean: torch.Tensor
    running_var: torch.Tensor

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.num_features, self.eps = num_features, eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    @classmethod
    def from_batch_norm(cls, norm: nn.modules.batchnorm._BatchNorm) -> "FrozenBatchNorm":
        """The frozen copy of ``norm``: its statistics, its affine (ones and zeros if none)."""
        if norm.running_mean is None or norm.running_var is None:
            raise DPVisionError(
                f"cannot freeze {type(norm).__name__} without running statistics "
                "(track_running_stats=False); replace it with GroupNorm instead"
            )
        frozen = cls(int(norm.num_features), eps=float(norm.eps))
        with torch.no_grad():
            frozen.running_mean.copy_(norm.running_mean)
            frozen.running_var.copy_(norm.running_var)
            tracked = norm.num_batches_tracked
            if isinstance(tracked, torch.Tensor):
                frozen.get_buffer("num_batches_tracked").copy_(tracked)
            if norm.affine:
                frozen.weight.copy_(norm.weight)
                frozen.bias.copy_(norm.bias)
        return frozen.to(norm.running_mean.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises ``x`` (N, C, ...) with the running statistics, then scales and offsets."""
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
        )

    def extra_repr(self) -> str:
        """Describes the layer in ``print(model)``."""
        return f"{self.num_features}, eps={self.eps}"
