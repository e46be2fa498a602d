"""Private training of deep models (DP-SGD), below the commands that run it.

* :mod:`dpvision.training.engine` — the one DP-SGD update (:func:`noisy_step`): noise once
  per logical step at the clipped sum's stated sensitivity, the optimizer, the EMA;
* :mod:`dpvision.training.options` — the typed ``[learner]`` options of ``dp-sgd``;
* :mod:`dpvision.training.batching`, :mod:`~dpvision.training.evaluation`,
  :mod:`~dpvision.training.memory`, :mod:`~dpvision.training.checkpoint`,
  :mod:`~dpvision.training.optimizers` — the parts of a training loop;
* :mod:`dpvision.training.transfer` and :mod:`~dpvision.training.pretrain` — DP-RandP's
  phases and its Phase I pre-training on synthetic images.

Per-example clipping itself lives in :mod:`dpvision.per_example`.
"""

from dpvision.averaging import ema_decay
from dpvision.mechanisms.adaptive_clipping import AdaptiveClipping
from dpvision.training.engine import (
    DPSGDStep,
    GradientRelease,
    ParameterEMA,
    noisy_step,
    privatize_gradients,
)

__all__ = [
    "AdaptiveClipping",
    "DPSGDStep",
    "GradientRelease",
    "ParameterEMA",
    "ema_decay",
    "noisy_step",
    "privatize_gradients",
]
