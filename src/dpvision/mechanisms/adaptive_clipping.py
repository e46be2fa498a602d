"""Adaptive (quantile) clipping: the clip norm follows a quantile of the per-example norms
(Andrew, Thakkar, McMahan & Ramaswamy, NeurIPS 2021; Opacus ``AdaClipDPOptimizer``, TF
Privacy ``QuantileAdaptiveClipSumQuery``).

Each step t clips to C_t and releases, besides the noisy clipped sum, the number of
examples whose gradient norm was at most C_t, with Gaussian noise of standard deviation
σ_b (sensitivity 1). The clip norm then moves geometrically towards the target quantile γ:
C_{t+1} = C_t · exp(−η (b̃_t − γ)), b̃_t the noisy count over the expected batch qN.

Privacy: the pair (sum / C_t, count) has sensitivity (1, 1) in units of its own noise
(σ_s and σ_b), so one step is exactly one Gaussian mechanism with noise multiplier σ, where
1/σ² = 1/σ_s² + 1/σ_b² (Andrew et al., Theorem 1). The run calibrates σ for its target ε
as for flat clipping; the sum then gets σ_s = (σ⁻² − σ_b⁻²)^(−1/2) > σ, and the ledger
records one Poisson-sampled Gaussian step of multiplier σ for both releases.

>>> clip = AdaptiveClipping(initial=1.0, count_noise=5.0)
>>> round(clip.sum_noise_multiplier(1.0), 4)  # a little more noise on the sum
1.0206
"""

import math
from dataclasses import dataclass, field

import torch

from dpvision.accounting import PrivacyLedger
from dpvision.errors import DPVisionError
from dpvision.mechanisms.noise import NoiseGenerator, gaussian_noise, observe_release
from dpvision.mechanisms.secure import noise_source


@dataclass
class AdaptiveClipping:
    """The clip norm of adaptive clipping, and its private update.

    Attributes:
      initial: C₀ > 0.
      target_quantile: γ in (0, 1), the share of examples meant to stay unclipped (Opacus
        ``target_unclipped_quantile``).
      learning_rate: η > 0 of the geometric update (Opacus ``clipbound_learning_rate``).
      count_noise: σ_b, the standard deviation of the noise on the unclipped count (Opacus
        ``unclipped_num_std``); Andrew et al. suggest the expected batch size over 20.
      min_clip, max_clip: C stays within them (Opacus ``min_clipbound``/``max_clipbound``).
      clip: C_t, the current clip norm.
    """

    initial: float
    count_noise: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    min_clip: float = 1e-6
    max_clip: float = 1e6
    clip: float = field(init=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.initial) and self.initial > 0):
            raise DPVisionError(f"the initial clip norm must be > 0, got {self.initial}")
        if not 0 < self.target_quantile < 1:
            raise DPVisionError(
                f"target_unclipped_quantile must be in (0, 1), got {self.target_quantile}"
            )
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise DPVisionError(f"clipbound_learning_rate must be > 0, got {self.learning_rate}")
        if not (math.isfinite(self.count_noise) and self.count_noise > 0):
            raise DPVisionError(f"unclipped_num_std must be > 0, got {self.count_noise}")
        if not 0 < self.min_clip <= self.initial <= self.max_clip:
            raise DPVisionError(
                f"need 0 < min_clipbound <= max_grad_norm <= max_clipbound, got "
                f"{self.min_clip}, {self.initial}, {self.max_clip}"
            )
        self.clip = float(self.initial)

    def sum_noise_multiplier(self, sigma: float) -> float:
        """σ_s of the clipped sum, so that the sum and the count together are one Gaussian
        release of multiplier ``sigma`` (0 stays 0: the noise is off)."""
        if sigma == 0:
            return 0.0
        if not self.count_noise > sigma:
            raise DPVisionError(
                f"adaptive clipping needs unclipped_num_std > the noise multiplier "
                f"({self.count_noise:g} <= {sigma:.4g}): set learner.unclipped_num_std above "
                f"it (e.g. {2 * sigma:.3g}) or raise learner.batch_size"
            )
        return 1.0 / math.sqrt(sigma**-2 - self.count_noise**-2)

    def update(
        self,
        unclipped: torch.Tensor,
        *,
        expected_batch_size: float,
        generator: NoiseGenerator,
        noise: bool = True,
    ) -> float:
        """Releases the unclipped count with N(0, σ_b²) (none when ``noise`` is off), moves C
        towards the target quantile and returns the new C.

        Privacy:
          Releases ``unclipped`` (the number of examples of the batch whose norm was at most
          C_t, all ranks' shares summed: sensitivity 1) + N(0, σ_b²); the caller records it
          together with the clipped sum (see the module docstring). C_{t+1} is
          post-processing of that release.
        """
        count = unclipped.to(torch.float64).reshape(1)
        count = observe_release(count, l2_sensitivity=1.0, released="unclipped count")
        if noise:
            count = count + gaussian_noise(
                (1,),
                l2_sensitivity=1.0,
                noise_multiplier=self.count_noise,
                dtype=torch.float64,
                device=count.device,
                generator=generator,
            )
        share = float(count[0]) / expected_batch_size
        moved = self.clip * math.exp(-self.learning_rate * (share - self.target_quantile))
        self.clip = min(self.max_clip, max(self.min_clip, moved))
        return self.clip

    def unclipped(self, norms: torch.Tensor) -> torch.Tensor:
        """The number of per-example norms at most C_t (exact and private: release it only
        through :meth:`release`), on the norms' device: no copy to the host per batch."""
        return (norms <= self.clip).sum().to(torch.float64)

    def release(
        self,
        unclipped: torch.Tensor,
        *,
        sigma: float | None,
        sample_rate: float,
        expected_batch_size: float,
        ledger: PrivacyLedger,
        generator: NoiseGenerator,
        released: str,
    ) -> None:
        """Releases the step's unclipped count (all ranks' shares already summed), moves C
        (:meth:`update`), and records the clipped sum released with σ_s and this count as
        the one Gaussian release of multiplier ``sigma`` they are together (None or 0: the
        noise is off, recorded as a non-private release).

        Privacy: see the module docstring; the entry is written after both noises are drawn.
        """
        noise = bool(sigma)
        self.update(
            unclipped, expected_batch_size=expected_batch_size, generator=generator, noise=noise
        )
        name = f"{released} and unclipped count (adaptive clipping)"
        if not noise:
            ledger.record_non_private(released=f"{name} without noise")
            return
        assert sigma is not None
        ledger.record(
            noise_multiplier=sigma,
            sample_rate=sample_rate,
            released=name,
            noise_source=noise_source(generator),
        )

    def state_dict(self) -> dict[str, float]:
        """C_t, for checkpoints."""
        return {"clip": self.clip}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restores C_t."""
        self.clip = float(state["clip"])
