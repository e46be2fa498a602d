"""Feature preprocessing before a learner: none, per-example GroupNorm, or private
normalisation (:mod:`dpvision.features.normalization`), as the ``[preprocessing]`` table says.
"""

from dataclasses import dataclass

import numpy as np
import torch

from dpvision.accounting import PrivacyLedger
from dpvision.features.normalization import PrivateCentering, PrivateNormalizer, group_normalize


@dataclass(frozen=True)
class PreprocessingConfig:
    """How features are normalised before the learner (see :mod:`dpvision.features.normalization`).

    Attributes:
      kind: ``none``; ``group-norm`` (per example, free); ``private-norm`` (PrivDataNorm,
        private per-channel mean/variance); ``center`` (private mean centering).
      groups: channel groups for ``group-norm``.
      channels: channels of the feature layout (``None``: 81·C for scatternet, C for pixels).
      noise_multiplier: σ of each private statistic (``private-norm``, ``center``).
      mean_clip, square_clip: PrivDataNorm's public clipping thresholds τ_m, τ_s.
      clip_norm: the feature clipping norm for ``center``.
    """

    kind: str = "none"
    groups: int = 27
    channels: int | None = None
    noise_multiplier: float = 8.0
    mean_clip: float = 1.0
    square_clip: float = 1.0
    clip_norm: float = 1.0


PREPROCESSING = ("none", "group-norm", "private-norm", "center")


def preprocess(
    pre: PreprocessingConfig,
    train: np.ndarray,
    test: np.ndarray,
    channels: int,
    ledger: PrivacyLedger,
    seed: int,
    *,
    noise_off: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Applies ``pre`` to train and test features, recording private steps in ``ledger``.

    ``noise_off``: the run is a non-private baseline (ε = ∞ or σ = 0); the private
    statistics are then computed without noise and recorded as non-private.

    Privacy:
      ``group-norm`` is per-example (free). ``private-norm`` and ``center`` release
      statistics of the *training* features with Gaussian noise (see
      :mod:`dpvision.features.normalization`) and record them in ``ledger``; the test
      features are only transformed with those released statistics.
    """
    sigma = 0.0 if noise_off else pre.noise_multiplier
    generator = torch.Generator().manual_seed(seed)
    if pre.kind == "none":
        return train, test
    if pre.kind == "group-norm":
        return (
            group_normalize(train, channels=channels, groups=pre.groups),
            group_normalize(test, channels=channels, groups=pre.groups),
        )
    if pre.kind == "private-norm":
        normalizer = PrivateNormalizer(
            channels=channels,
            noise_multiplier=sigma,
            mean_clip=pre.mean_clip,
            square_clip=pre.square_clip,
        )
        normalizer.fit(train, ledger=ledger, generator=generator)
        return normalizer.transform(train), normalizer.transform(test)
    centering = PrivateCentering(clip_norm=pre.clip_norm, noise_multiplier=sigma)
    centering.fit(train, ledger=ledger, generator=generator)
    return centering.transform(train), centering.transform(test)
