"""Private training of deep models (DP-SGD), below the commands that run it.

* :mod:`dpvision.training.engine` — :class:`DPSGDStep`, the step of ``dpvision train``:
  clipped sums of a logical batch's micro-batches, then the one DP-SGD release
  (:func:`~dpvision.mechanisms.gradient_release.noisy_step`, re-exported here with
  :class:`GradientRelease`, :class:`ReleaseContext` and :class:`ParameterEMA`);
* :mod:`dpvision.training.options` — the typed ``[learner]`` options of ``dp-sgd``;
* :mod:`dpvision.training.batching`, :mod:`~dpvision.training.evaluation`,
  :mod:`~dpvision.training.memory`, :mod:`~dpvision.training.checkpoint`,
  :mod:`~dpvision.training.optimizers` — the parts of a training loop;
* :mod:`dpvision.training.transfer` and :mod:`~dpvision.training.pretrain` — DP-RandP's
  phases and its Phase I pre-training on synthetic images.

Per-example clipping itself lives in :mod:`dpvision.per_example`.
"""

from dpvision.averaging import ParameterEMA, ema_decay
from dpvision.mechanisms.adaptive_clipping import AdaptiveClipping
from dpvision.mechanisms.gradient_release import (
    GradientRelease,
    ReleaseContext,
    noisy_step,
    privatize_gradients,
)
from dpvision.training.engine import DPSGDStep

__all__ = [
    "AdaptiveClipping",
    "DPSGDStep",
    "GradientRelease",
    "ParameterEMA",
    "ReleaseContext",
    "ema_decay",
    "noisy_step",
    "privatize_gradients",
]
