"""The one DP-SGD release: clipped sum → noise once → ÷ qN → optimizer → EMA (De et al., Alg. 1).

Everything that trains with DP-SGD goes through :func:`noisy_step`: the ``dpvision train``
step (:class:`~dpvision.training.DPSGDStep`), the Opacus-style
:class:`~dpvision.privacy_engine.DPOptimizer`, the linear head of
:class:`~dpvision.learners.DPSGDLinear` and the audit's stacked runs. Its input is a
:class:`~dpvision.mechanisms.clipped_sum.ClippedGradientSum`, which states its own L2
sensitivity; the noise is scaled to that stated sensitivity, never to a separately typed C.
The clip policy (:mod:`dpvision.mechanisms.clip_policy`) says what else the step releases
and writes its ledger entry.

The logical batch (Poisson-sampled, expected size qN) may be split into physical
micro-batches to fit in memory; their clipped sums are added and the Gaussian noise
N(0, (σΔ)²) is added **once** per logical step, then the total is divided by the public
expected batch size qN. Splitting is therefore a memory knob that never changes the noise.
"""

import dataclasses
import math
from collections.abc import Mapping

import torch

from dpvision.accounting import PrivacyLedger
from dpvision.averaging import ParameterEMA
from dpvision.distributed import Workers
from dpvision.errors import DPVisionError
from dpvision.mechanisms.clip_policy import ClipPolicy
from dpvision.mechanisms.clipped_sum import ClippedGradientSum
from dpvision.mechanisms.noise import (
    NoiseGenerator,
    gaussian_noise,
    observe_release,
    report_released,
)
from dpvision.profiling import phase

RELEASED = "DP-SGD clipped gradient sum"


@dataclasses.dataclass(frozen=True)
class GradientRelease:
    """The public parameters of one DP-SGD release.

    Attributes:
      noise_multiplier: σ ≥ 0 of the step (0: no noise, recorded as a non-private release);
        the clip policy may give the clipped sum a share of it
        (:meth:`~dpvision.mechanisms.clip_policy.ClipPolicy.noise_multiplier`).
      sample_rate: q, the Poisson rate the logical batches are drawn with.
      expected_batch_size: qN, the public divisor of the noisy sum.
      normalize_update: also divide by the sensitivity (jax_privacy's
        ``rescale_to_unit_norm``, the normalised DP-SGD of De et al.).
      released: what the ledger calls the release.
    """

    noise_multiplier: float
    sample_rate: float
    expected_batch_size: float
    normalize_update: bool = False
    released: str = RELEASED

    def __post_init__(self) -> None:
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise DPVisionError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if not 0 < self.sample_rate <= 1:
            raise DPVisionError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if not self.expected_batch_size > 0:
            raise DPVisionError(f"expected_batch_size must be > 0, got {self.expected_batch_size}")


@dataclasses.dataclass
class ReleaseContext:
    """Where a DP-SGD step's release goes and what it draws from.

    Attributes:
      ledger: where every logical step is recorded.
      generator: the noise generator; under ``torchrun`` seeded identically on every rank.
      workers: the processes sharing each logical step (default: this process alone); the
        clipped sums are all-reduced before the noise, which every rank draws identically.
      ema: a parameter average to update after each step, or None.
    """

    ledger: PrivacyLedger
    generator: NoiseGenerator = None
    workers: Workers = dataclasses.field(default_factory=Workers)
    ema: ParameterEMA | None = None


@torch.no_grad()
def privatize_gradients(
    sums_and_params: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    l2_sensitivity: float,
    noise_multiplier: float,
    divisor: float,
    generator: NoiseGenerator,
    released: str = RELEASED,
) -> None:
    """Adds the noise of one logical step to clipped sums and sets each parameter's ``.grad``.

    ``.grad = (Σᵢ clip(gᵢ) + N(0, (σΔ)² I)) / divisor``, Δ = ``l2_sensitivity``, σ =
    ``noise_multiplier``, the noise drawn once for each parameter in the order given.
    Modifies the sums in place.

    Privacy:
      Releases the clipped sums over all parameters together with Gaussian noise of
      multiplier σ and L2 sensitivity Δ (the clipped sum's stated sensitivity): one
      Gaussian release, which the caller records (:func:`noisy_step` through its clip
      policy). The division by the public ``divisor`` is post-processing.
    """
    for index, (total, param) in enumerate(sums_and_params):
        total = observe_release(
            total, l2_sensitivity=l2_sensitivity, released=released, part=index > 0
        )
        if noise_multiplier > 0:
            total += gaussian_noise(
                total.shape,
                l2_sensitivity=l2_sensitivity,
                noise_multiplier=noise_multiplier,
                dtype=total.dtype,
                device=total.device,
                generator=generator,
            )
        report_released(total, l2_sensitivity=l2_sensitivity, released=released, part=index > 0)
        param.grad = total / divisor


@torch.no_grad()
def noisy_step(
    clipped: ClippedGradientSum,
    params: Mapping[str, torch.Tensor],
    *,
    release: GradientRelease,
    policy: ClipPolicy,
    optimizer: torch.optim.Optimizer,
    context: ReleaseContext,
    keep_grad: bool = False,
) -> None:
    """The one DP-SGD update of a logical batch, from its clipped sum.

    Sums the ranks' shares (``context.workers``), adds the noise once with
    :func:`privatize_gradients` at the sensitivity ``clipped`` states and the policy's
    share of σ, lets the policy release what else it needs and record the step, steps
    ``optimizer``, clears the gradients (``keep_grad``: leaves the privatised gradient in
    ``.grad``, as a torch optimizer does) and updates ``context.ema``. ``params`` (name →
    parameter) may be stacked tensors of many independent runs (the audit), each getting
    its own noise.

    Privacy:
      One Poisson-sampled Gaussian release of ``clipped`` (sensitivity
      ``clipped.l2_sensitivity``, σ and q of ``release``; with adaptive clipping together
      with the unclipped count), recorded in ``context.ledger`` by the policy after the
      noise is drawn; the rest is post-processing.
    """
    totals = [clipped.grads[name] for name in params]
    # Exact sums over every rank's share, then the noise once (Algorithm 1). No count of the
    # batch's examples or of its non-finite gradients is kept: both are private.
    context.workers.all_reduce_(totals)
    sensitivity = clipped.l2_sensitivity
    with phase("noise"):
        privatize_gradients(
            list(zip(totals, params.values(), strict=True)),
            l2_sensitivity=sensitivity,
            noise_multiplier=policy.noise_multiplier(release.noise_multiplier),
            divisor=release.expected_batch_size * (sensitivity if release.normalize_update else 1),
            generator=context.generator,
            released=release.released,
        )
        policy.record(
            context.ledger,
            noise_multiplier=release.noise_multiplier,
            sample_rate=release.sample_rate,
            expected_batch_size=release.expected_batch_size,
            released=release.released,
            generator=context.generator,
            workers=context.workers,
        )
    with phase("optimizer"):
        optimizer.step()
        if not keep_grad:
            optimizer.zero_grad(set_to_none=True)
        if context.ema is not None:
            context.ema.update()
