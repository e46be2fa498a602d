"""Feature normalisation: per-example (free) and dataset-level (private).

* :func:`group_normalize` looks at one example at a time, so it costs no privacy.
* :class:`PrivateNormalizer` is PrivDataNorm (Tramèr & Boneh, Algorithm 2 of App. B): the
  per-channel mean and variance of the features, released with Gaussian noise.
* :class:`PrivateCentering` is the private mean centering of Tang et al. (DP-RandP,
  App. G): the mean of clipped features, released with Gaussian noise, then subtracted.

Neither private estimator uses any non-private statistic of the data. The published code of
Tramèr & Boneh sets its clipping thresholds to the *non-private* median of the norms (a
leak the code's comment admits); here the thresholds are public constants that the caller
chooses, with defaults that suit ScatterNet features of images in [0, 1].
"""

from dataclasses import dataclass

import numpy as np
import torch

from dpvision.accounting import PrivacyLedger
from dpvision.data.rows import Rows, row_chunks, rows_per_chunk
from dpvision.errors import DPVisionError
from dpvision.mechanisms import clip_rows, release_gaussian

_CHUNK = 8192
_FIT_CHUNK_BYTES = 2**25  # float64 rows read at a time by the private fits


def group_normalize(
    features: np.ndarray, *, channels: int, groups: int, eps: float = 1e-5
) -> np.ndarray:
    """GroupNorm without affine parameters on flattened (channels × positions) features.

    Each example is standardised by the mean and variance of its own features within each
    group of channels (Tramèr & Boneh's ``GroupNorm(G, K, affine=False)``, G = 27 for
    ScatterNet on Fashion-MNIST).

    Privacy:
      Uses only the example's own values: costs no privacy.
    """
    n, d = features.shape
    if channels < 1 or d % channels or channels % groups:
        raise DPVisionError(
            f"group_normalize needs features divisible into {channels} channels and the "
            f"channels into {groups} groups; got {d} features"
        )
    out = np.empty_like(features, dtype=np.float32)
    for start in range(0, n, _CHUNK):
        x = np.asarray(features[start : start + _CHUNK], dtype=np.float32)
        grouped = x.reshape(len(x), groups, -1)
        mean = grouped.mean(axis=2, keepdims=True)
        var = grouped.var(axis=2, keepdims=True)
        out[start : start + _CHUNK] = ((grouped - mean) / np.sqrt(var + eps)).reshape(len(x), d)
    return out


def _channel_view(x: torch.Tensor, channels: int) -> torch.Tensor:
    return x.reshape(len(x), channels, -1)


@dataclass
class PrivateNormalizer:
    """PrivDataNorm: standardise each channel by a privately released mean and variance.

    Features are flattened (channels × positions), e.g. ScatterNet's (81·C, h, w).

    Args:
      channels: K, the number of channels.
      noise_multiplier: σ_norm for each of the two releases (Tramèr & Boneh use 8); 0 computes
        the exact statistics and records a non-private release (ε = ∞).
      mean_clip: τ_m, the L2 bound on each example's per-channel spatial-mean vector.
      square_clip: τ_s, the L2 bound on each example's per-channel mean-of-squares vector.
      eps: added to the variance before the square root.

    Privacy:
      Two full-batch Gaussian releases, each with noise multiplier σ_norm (add/remove-one):
      Σᵢ clip(mᵢ, τ_m) + N(0, (σ_norm τ_m)² I) and Σᵢ clip(sᵢ, τ_s) + N(0, (σ_norm τ_s)² I),
      with L2 sensitivities τ_m and τ_s. Both are divided by n (treated as public). The
      variance max(E[s] − E[m]², 0) and the standardisation are post-processing.
    """

    channels: int
    noise_multiplier: float = 8.0
    mean_clip: float = 1.0
    square_clip: float = 1.0
    eps: float = 1e-5

    def fit(
        self,
        features: "np.ndarray | Rows",
        *,
        ledger: PrivacyLedger,
        generator: torch.Generator | None = None,
    ) -> "PrivateNormalizer":
        """Releases the noisy statistics (recorded in ``ledger``) and keeps them.

        ``features``: an (n, d) array, or :class:`~dpvision.data.rows.Rows` of one (read in
        chunks; a read-only memory map's pages are let go)."""
        n, d = features.shape
        if d % self.channels:
            raise DPVisionError(f"{d} features do not split into {self.channels} channels")
        mean_sum = torch.zeros(self.channels, dtype=torch.float64)
        square_sum = torch.zeros(self.channels, dtype=torch.float64)
        per_chunk = rows_per_chunk(features, _FIT_CHUNK_BYTES)
        for chunk in row_chunks(features, per_chunk, np.float64):
            x = _channel_view(torch.from_numpy(chunk), self.channels)
            mean_sum += clip_rows(x.mean(dim=2), self.mean_clip).sum(dim=0)
            square_sum += clip_rows((x * x).mean(dim=2), self.square_clip).sum(dim=0)
        common = {
            "noise_multiplier": self.noise_multiplier or None,  # 0: the non-private baseline
            "ledger": ledger,
            "generator": generator,
        }
        mean_sum = release_gaussian(
            mean_sum,
            l2_sensitivity=self.mean_clip,
            released="PrivDataNorm per-channel means",
            **common,
        )
        square_sum = release_gaussian(
            square_sum,
            l2_sensitivity=self.square_clip,
            released="PrivDataNorm per-channel mean squares",
            **common,
        )
        self.mean_ = (mean_sum / n).numpy()
        self.var_ = np.maximum((square_sum / n).numpy() - self.mean_**2, 0.0)
        return self

    def transform(self, features: np.ndarray) -> np.ndarray:
        """(x − mean)/√(var + eps) per channel; channels whose variance is 0 become 0."""
        if not hasattr(self, "mean_"):
            raise DPVisionError("PrivateNormalizer is not fitted: call fit first")
        n, d = features.shape
        positions = d // self.channels
        mean = np.repeat(self.mean_, positions).astype(np.float32)
        scale = np.where(self.var_ > 0, 1.0 / np.sqrt(self.var_ + self.eps), 0.0)
        scale = np.repeat(scale, positions).astype(np.float32)
        out = np.empty((n, d), dtype=np.float32)
        for start in range(0, n, _CHUNK):
            out[start : start + _CHUNK] = (features[start : start + _CHUNK] - mean) * scale
        return out


@dataclass
class PrivateCentering:
    """Subtract a privately released mean (DP-RandP, App. G).

    Args:
      clip_norm: C, the L2 bound on each feature vector for the mean.
      noise_multiplier: σ of the release; 0 uses the exact mean (recorded as non-private).

    Privacy:
      One full-batch Gaussian release: Σᵢ clip(xᵢ, C) + N(0, (σC)² I), L2 sensitivity C
      (add/remove-one), divided by n (treated as public). Centering is post-processing.
    """

    clip_norm: float = 1.0
    noise_multiplier: float = 8.0

    def fit(
        self,
        features: "np.ndarray | Rows",
        *,
        ledger: PrivacyLedger,
        generator: torch.Generator | None = None,
    ) -> "PrivateCentering":
        """Releases the noisy mean (recorded in ``ledger``) and keeps it; ``features`` as in
        :meth:`PrivateNormalizer.fit`."""
        n, d = features.shape
        total = torch.zeros(d, dtype=torch.float64)
        for chunk in row_chunks(features, rows_per_chunk(features, _FIT_CHUNK_BYTES), np.float64):
            total += clip_rows(torch.from_numpy(chunk), self.clip_norm).sum(dim=0)
        total = release_gaussian(
            total,
            l2_sensitivity=self.clip_norm,
            noise_multiplier=self.noise_multiplier or None,  # 0: the exact mean, non-private
            ledger=ledger,
            released="feature mean for centering",
            generator=generator,
        )
        self.mean_ = (total / n).numpy().astype(np.float32)
        return self

    def transform(self, features: np.ndarray) -> np.ndarray:
        if not hasattr(self, "mean_"):
            raise DPVisionError("PrivateCentering is not fitted: call fit first")
        return np.asarray(features, dtype=np.float32) - self.mean_
