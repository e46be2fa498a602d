"""Feature preprocessing before a learner: none, per-example GroupNorm, or private
normalisation (:mod:`dpvision.features.normalization`), as the ``[preprocessing]`` table says.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from dpvision.accounting import PrivacyLedger
from dpvision.data.rows import Rows, row_chunks, rows_per_chunk
from dpvision.features.normalization import PrivateCentering, PrivateNormalizer, group_normalize
from dpvision.mechanisms.noise import NoiseGenerator


@dataclass(frozen=True)
class PreprocessingConfig:
    """How features are normalised before the learner (see :mod:`dpvision.features.normalization`).

    Attributes:
      kind: ``none``; ``group-norm`` (per example, free); ``private-norm`` (PrivDataNorm,
        private per-channel mean/variance); ``center`` (private mean centering); ``auto``
        (the default): group-norm for ScatterNet features of a feature learner, else none
        (:func:`dpvision.recipes.default_preprocessing`), resolved when the config is.
      groups: channel groups for ``group-norm``.
      channels: channels of the feature layout (``None``: 81·C for scatternet, C for pixels).
      noise_multiplier: σ of each private statistic (``private-norm``, ``center``).
      mean_clip, square_clip: PrivDataNorm's public clipping thresholds τ_m, τ_s.
      clip_norm: the feature clipping norm for ``center``.
    """

    kind: str = "auto"
    groups: int = 27
    channels: int | None = None
    noise_multiplier: float = 8.0
    mean_clip: float = 1.0
    square_clip: float = 1.0
    clip_norm: float = 1.0

    def filled(self, chosen: dict[str, Any]) -> "PreprocessingConfig":
        """This config with a recipe's ``chosen`` options where it left them to the recipe:
        the kind, and every option still at its default (an option the user set is kept)."""
        default = PreprocessingConfig()
        unset = {f.name for f in fields(self) if getattr(self, f.name) == getattr(default, f.name)}
        return replace(self, **{k: v for k, v in chosen.items() if k == "kind" or k in unset})


PREPROCESSING = ("none", "group-norm", "private-norm", "center")

CHUNK_BYTES = 2**25
"""Bytes of float32 rows transformed at a time."""


@dataclass(frozen=True)
class FittedPreprocessing:
    """A run's preprocessing after it was fitted: applies to any features, e.g. the test set
    or new images at prediction time (:mod:`dpvision.runs.saved`).

    ``statistics`` are the released statistics (``mean``, and ``var`` for
    ``private-norm``): post-processing of the noisy releases recorded in the run's ledger,
    so keeping or publishing them costs nothing more.
    """

    config: PreprocessingConfig
    channels: int
    statistics: dict[str, np.ndarray]

    def transform(self, features: "np.ndarray | Rows") -> np.ndarray:
        """The transformed features, as one new float32 array (``none``: the array itself,
        or the rows of a :class:`~dpvision.data.rows.Rows` read into one array).

        ``features`` is read once, :data:`CHUNK_BYTES` at a time (a read-only memory map's
        pages are let go as it is read), and written into the one output array: no other
        copy of the rows is made.
        """
        if self.config.kind == "none":
            if not isinstance(features, Rows):
                return features
            dtype = np.result_type(*(array.dtype for array, _ in features.parts))
            return _read_all(features, np.dtype(dtype))
        return _read_all(features, np.dtype(np.float32), self._apply)

    def _apply(self, chunk: np.ndarray) -> np.ndarray:
        """The transform of a float32 chunk of rows."""
        kind = self.config.kind
        if kind == "group-norm":
            return group_normalize(chunk, channels=self.channels, groups=self.config.groups)
        if kind == "private-norm":
            normalizer = PrivateNormalizer(channels=self.channels, noise_multiplier=0.0)
            normalizer.mean_, normalizer.var_ = self.statistics["mean"], self.statistics["var"]
            return normalizer.transform(chunk)
        centering = PrivateCentering(clip_norm=self.config.clip_norm, noise_multiplier=0.0)
        centering.mean_ = self.statistics["mean"]
        return centering.transform(chunk)


def _read_all(
    features: "np.ndarray | Rows",
    dtype: np.dtype,
    apply: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """The rows of ``features``, each chunk passed through ``apply``, in one array of
    ``dtype`` (without ``apply``, the array itself when they are all of one array's rows)."""
    whole = isinstance(features, Rows) and len(features.parts) == 1
    if apply is None and whole and features.parts[0][1] is None:
        return features.parts[0][0]
    out = np.empty(features.shape, dtype=dtype)
    done = 0
    per_chunk = rows_per_chunk(features, CHUNK_BYTES, dtype.itemsize)
    for chunk in row_chunks(features, per_chunk, dtype):
        out[done : done + len(chunk)] = chunk if apply is None else apply(chunk)
        done += len(chunk)
    return out


def preprocess(
    pre: PreprocessingConfig,
    train: "np.ndarray | Rows",
    test: "np.ndarray | Rows",
    channels: int,
    ledger: PrivacyLedger,
    generator: NoiseGenerator,
    *,
    noise_off: bool = False,
) -> tuple[np.ndarray, np.ndarray, FittedPreprocessing]:
    """Applies ``pre`` to train and test features, recording private steps in ``ledger``;
    returns them and the fitted preprocessing (for new features).

    ``train`` and ``test`` may be :class:`~dpvision.data.rows.Rows` of larger arrays (a
    run's training rows of the cached features, its held-out rows then the test set): each
    is read in chunks into the one array returned for it.

    ``generator``: the noise's, a stream of the run's secret randomness (or the secure
    mode's CSPRNG).
    ``noise_off``: the run is a non-private baseline (ε = ∞ or σ = 0); the private
    statistics are then computed without noise and recorded as non-private.

    Privacy:
      ``group-norm`` is per-example (free). ``private-norm`` and ``center`` release
      statistics of the *training* features with Gaussian noise (see
      :mod:`dpvision.features.normalization`) and record them in ``ledger``; the test
      features are only transformed with those released statistics.
    """
    sigma = 0.0 if noise_off else pre.noise_multiplier
    statistics: dict[str, np.ndarray] = {}
    if pre.kind == "private-norm":
        normalizer = PrivateNormalizer(
            channels=channels,
            noise_multiplier=sigma,
            mean_clip=pre.mean_clip,
            square_clip=pre.square_clip,
        )
        normalizer.fit(train, ledger=ledger, generator=generator)
        statistics = {"mean": normalizer.mean_, "var": normalizer.var_}
    elif pre.kind == "center":
        centering = PrivateCentering(clip_norm=pre.clip_norm, noise_multiplier=sigma)
        centering.fit(train, ledger=ledger, generator=generator)
        statistics = {"mean": centering.mean_}
    fitted = FittedPreprocessing(pre, channels, statistics)
    return fitted.transform(train), fitted.transform(test), fitted
