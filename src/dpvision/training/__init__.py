"""Private training of deep models (DP-SGD).

* :mod:`dpvision.training.per_example` — per-example clipped gradient sums (torch.func);
* :mod:`dpvision.training.engine` — one logical DP-SGD step over physical micro-batches,
  noise once per logical step, and the parameter EMA.
"""

from dpvision.training.bookkeeping import (
    ClippingMethod,
    bookkeeping_clipped_gradient_sum,
    clip_and_sum,
    supports_bookkeeping,
)
from dpvision.training.engine import DPSGDStep, ParameterEMA, ema_decay
from dpvision.training.per_example import ClippedGradientSum, clipped_gradient_sum

__all__ = [
    "ClippedGradientSum",
    "ClippingMethod",
    "DPSGDStep",
    "ParameterEMA",
    "bookkeeping_clipped_gradient_sum",
    "clip_and_sum",
    "clipped_gradient_sum",
    "ema_decay",
    "supports_bookkeeping",
]
