"""Mechanisms: the noise actually added to what dpvision releases (torch).

The accounting side (:mod:`dpvision.accounting`) *describes* mechanisms; this side *runs*
them. Each function here takes the L2 sensitivity of the value it privatises and derives
the noise from it, so the sensitivity is stated once, next to the value it bounds.
"""

from dpvision.mechanisms.adaptive_clipping import AdaptiveClipping
from dpvision.mechanisms.clipping import clip_factors, clip_rows
from dpvision.mechanisms.noise import (
    Release,
    add_gaussian_noise,
    add_symmetric_gaussian_noise_,
    gaussian_noise,
    observe_release,
    observing_releases,
    release_gaussian,
    report_released,
    watching_released,
)
from dpvision.mechanisms.sampling import PoissonSampler
from dpvision.mechanisms.secure import SecureRandom

__all__ = [
    "AdaptiveClipping",
    "PoissonSampler",
    "Release",
    "SecureRandom",
    "add_gaussian_noise",
    "add_symmetric_gaussian_noise_",
    "clip_factors",
    "clip_rows",
    "gaussian_noise",
    "observe_release",
    "observing_releases",
    "release_gaussian",
    "report_released",
    "watching_released",
]
