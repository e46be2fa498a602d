"""Private training of deep models (DP-SGD); see :mod:`dpvision.training.per_example`."""

from dpvision.training.per_example import ClippedGradientSum, clipped_gradient_sum

__all__ = ["ClippedGradientSum", "clipped_gradient_sum"]
