"""The one DP-SGD update: clipped sum → noise once → ÷ qN → optimizer → EMA (De et al., Alg. 1).

Everything that trains with DP-SGD goes through :func:`noisy_step`: the ``dpvision train``
loop (:class:`DPSGDStep`), the Opacus-style :class:`~dpvision.privacy_engine.DPOptimizer`,
and the audit's stacked runs. Its input is a :class:`~dpvision.per_example.ClippedGradientSum`,
which states its own L2 sensitivity; the noise is scaled to that stated sensitivity, never
to a separately typed C.

The logical batch (Poisson-sampled, expected size qN) may be split into physical
micro-batches to fit in memory; their clipped sums are added and the Gaussian noise
N(0, (σΔ)²) is added **once** per logical step, then the total is divided by the public
expected batch size qN. Splitting is therefore a memory knob that never changes the noise.
"""

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from dpvision.accounting import PrivacyLedger
from dpvision.averaging import ema_decay
from dpvision.distributed import Workers
from dpvision.errors import DPVisionError
from dpvision.mechanisms import gaussian_noise, observe_release, report_released
from dpvision.mechanisms.adaptive_clipping import AdaptiveClipping
from dpvision.mechanisms.noise import NoiseGenerator
from dpvision.mechanisms.secure import noise_source
from dpvision.per_example import CLIPPING_METHODS, ClippedGradientSum, clip_and_sum
from dpvision.per_example.groups import GroupNorms
from dpvision.profiling import phase
from dpvision.training.buffers import BufferWatch

RELEASED = "DP-SGD clipped gradient sum"


@dataclasses.dataclass(frozen=True)
class GradientRelease:
    """The public parameters of one DP-SGD release.

    Attributes:
      noise_multiplier: σ ≥ 0 (0: no noise, recorded as a non-private release).
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


@torch.no_grad()
def privatize_gradients(
    sums_and_params: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    l2_sensitivity: float,
    release: GradientRelease,
    ledger: PrivacyLedger,
    generator: NoiseGenerator,
) -> None:
    """Adds the noise of one logical step to clipped sums and sets each parameter's ``.grad``.

    ``.grad = (Σᵢ clip(gᵢ) + N(0, (σΔ)² I)) / (qN)`` (also divided by Δ with
    ``normalize_update``), Δ = ``l2_sensitivity``, the noise drawn once for each parameter in
    the order given. Modifies the sums in place.

    Privacy:
      Releases the clipped sums over all parameters together with Gaussian noise of
      multiplier σ and L2 sensitivity Δ (the clipped sum's stated sensitivity), one
      Poisson-sampled Gaussian step at rate q, and records it in ``ledger`` (σ = 0: a
      non-private release, recorded as such). The division by the public qN is
      post-processing.
    """
    sigma = release.noise_multiplier
    divisor = release.expected_batch_size * (l2_sensitivity if release.normalize_update else 1.0)
    for index, (total, param) in enumerate(sums_and_params):
        total = observe_release(
            total, l2_sensitivity=l2_sensitivity, released=release.released, part=index > 0
        )
        if sigma > 0:
            total += gaussian_noise(
                total.shape,
                l2_sensitivity=l2_sensitivity,
                noise_multiplier=sigma,
                dtype=total.dtype,
                device=total.device,
                generator=generator,
            )
        report_released(
            total, l2_sensitivity=l2_sensitivity, released=release.released, part=index > 0
        )
        param.grad = total / divisor
    if sigma > 0:
        # The noise on all parameters together is one Gaussian release of sensitivity Δ.
        ledger.record(
            noise_multiplier=sigma,
            sample_rate=release.sample_rate,
            l2_sensitivity=l2_sensitivity,
            released=release.released,
            noise_source=noise_source(generator),
        )
    else:
        ledger.record_non_private(released=f"{release.released} without noise")


class ParameterEMA:
    """Exponential moving average of a module's parameters, updated once per logical step."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.step = 0
        self.model = model
        self.shadow = {k: v.detach().clone() for k, v in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module | None = None) -> None:
        """Moves the average towards the parameters of ``model`` (default: the module it
        was made for)."""
        mu = ema_decay(self.decay, self.step)
        for name, param in (model or self.model).named_parameters():
            if param.requires_grad:  # a frozen parameter's average is itself, bit for bit
                self.shadow[name].mul_(mu).add_(param.detach(), alpha=1 - mu)
        self.step += 1

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> torch.nn.Module:
        """Writes the averaged parameters into ``model`` (a copy of the averaged module)."""
        for name, param in model.named_parameters():
            param.copy_(self.shadow[name])
        return model

    def state_dict(self) -> dict[str, object]:
        """The decay, the step count and the averaged parameters, for checkpoints."""
        return {"decay": self.decay, "step": self.step, "shadow": dict(self.shadow)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restores :meth:`state_dict`."""
        shadow = state["shadow"]
        assert isinstance(shadow, dict)
        for name, value in shadow.items():
            self.shadow[name].copy_(value)
        self.step = int(state["step"])  # type: ignore[call-overload]


@torch.no_grad()
def noisy_step(
    clipped: ClippedGradientSum,
    params: Mapping[str, torch.Tensor],
    *,
    release: GradientRelease,
    optimizer: torch.optim.Optimizer,
    ledger: PrivacyLedger,
    generator: NoiseGenerator,
    ema: ParameterEMA | None = None,
    workers: Workers | None = None,
    keep_grad: bool = False,
) -> None:
    """The one DP-SGD update of a logical batch, from its clipped sum.

    Sums the ranks' shares (``workers``), adds the noise once with
    :func:`privatize_gradients` at the sensitivity ``clipped`` states, steps ``optimizer``,
    clears the gradients (``keep_grad``: leaves the privatised gradient in ``.grad``, as a
    torch optimizer does) and updates ``ema``. ``params`` (name → parameter) may be stacked
    tensors of many independent runs (the audit), each getting its own noise.

    Privacy:
      One Poisson-sampled Gaussian release of ``clipped`` (sensitivity
      ``clipped.l2_sensitivity``, σ and q of ``release``), recorded in ``ledger``; the rest
      is post-processing.
    """
    totals = [clipped.grads[name] for name in params]
    # Exact sums over every rank's share, then the noise once (Algorithm 1). No count of the
    # batch's examples or of its non-finite gradients is kept: both are private.
    (workers or Workers()).all_reduce_(totals)
    with phase("noise"):
        privatize_gradients(
            list(zip(totals, params.values(), strict=True)),
            l2_sensitivity=clipped.l2_sensitivity,
            release=release,
            ledger=ledger,
            generator=generator,
        )
    with phase("optimizer"):
        optimizer.step()
        if not keep_grad:
            optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update()


class DPSGDStep:
    """Privatises and applies one logical step of DP-SGD.

    Args:
      model: a module validated for per-example gradients (no BatchNorm).
      optimizer: any torch optimizer over ``model``'s parameters.
      loss_fn: per-example loss ``loss_fn(outputs, targets)`` (reduction "none").
      noise_multiplier: σ.
      max_grad_norm: C.
      sample_rate: q, the Poisson rate the logical batches were drawn with.
      num_examples: N; the clipped sum is divided by the public qN.
      ledger: where every logical step is recorded.
      generator: the noise generator; under ``torchrun`` it must be seeded identically on
        every rank.
      workers: the processes sharing each logical step (default: this process alone).
        Each rank passes its own share of the logical batch; the clipped sums are
        all-reduced before the noise, which every rank then draws identically, once.
      views: whether inputs carry K augmented views per example, (B, K, ...).
      clipping: how per-example gradients are clipped: ``auto`` (book-keeping norms for
        the layers it supports, the torch.func reference otherwise), ``bookkeeping`` or
        ``vmap``. All give the same clipped sum.
      normalize_update: see :class:`GradientRelease`.
      ema: a parameter average of ``model`` to update after each step.
      precision: the autocast dtype of the forward and backward passes (``torch.bfloat16``)
        or None (float32). Per-example norms, clip factors, the clipped sum and the noise
        are float32 either way (:func:`~dpvision.per_example.clip_and_sum`).
      groups: group-wise clipping (:func:`~dpvision.per_example.per_layer`): each layer's
        part of an example's gradient is clipped to its own C_g; the sensitivity, and the
        noise, are then √(Σ C_g²) (``max_grad_norm`` is unused).

    Privacy:
      Each call releases Σᵢ clip(gᵢ, C) + N(0, (σC)² I) over the examples of one Poisson
      batch (all ranks' shares together), L2 sensitivity C (√(Σ C_g²) with ``groups``),
      recorded as one Poisson-sampled Gaussian step at rate q (:func:`noisy_step`).
      Everything after (division by qN, the optimizer, the EMA) is post-processing. With
      σ = 0 nothing is private and the ledger says so (a non-private baseline). A buffer
      of ``model`` written during a step (BatchNorm's running statistics, an activation
      observer) would publish an exact statistic of the batch with the model and is refused
      (:class:`~dpvision.training.buffers.BufferWatch`).
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        noise_multiplier: float,
        max_grad_norm: float,
        sample_rate: float,
        num_examples: int,
        ledger: PrivacyLedger,
        generator: NoiseGenerator,
        views: bool = False,
        clipping: str = "auto",
        normalize_update: bool = False,
        workers: Workers | None = None,
        ema: ParameterEMA | None = None,
        precision: torch.dtype | None = None,
        groups: GroupNorms | None = None,
        adaptive: AdaptiveClipping | None = None,
    ) -> None:
        if clipping not in CLIPPING_METHODS:
            raise DPVisionError(
                f"unknown clipping {clipping!r}; choose one of {', '.join(CLIPPING_METHODS)}"
            )
        if adaptive is not None and groups is not None:
            raise DPVisionError("adaptive clipping is flat: it cannot be combined with per-layer")
        self.adaptive = adaptive
        self.sigma = noise_multiplier
        self.release = GradientRelease(
            # Adaptive clipping: the sum's share σ_s of the step's σ (the count has the rest).
            noise_multiplier=(
                noise_multiplier
                if adaptive is None
                else adaptive.sum_noise_multiplier(noise_multiplier)
            ),
            sample_rate=sample_rate,
            expected_batch_size=sample_rate * num_examples,
            normalize_update=normalize_update,
        )
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.max_grad_norm = max_grad_norm
        self.ledger, self.generator, self.views = ledger, generator, views
        self.clipping, self.ema, self.precision = clipping, ema, precision
        self.groups = groups
        self.sensitivity = max_grad_norm if groups is None else groups.l2_sensitivity
        self.workers = workers or Workers()
        self.buffer_watch = BufferWatch(model)

    def __call__(self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Applies one logical step whose examples arrive as (inputs, targets) micro-batches.

        An empty logical batch is an empty iterable: it still gets its noise. Under
        ``torchrun`` every rank calls this with its own share of the batch.

        Raises:
          DPVisionError: a buffer of the model changed during the forward and backward
            passes (before anything is released).
        """
        params = {k: p for k, p in self.model.named_parameters() if p.requires_grad}
        adaptive = self.adaptive
        clip = self.max_grad_norm if adaptive is None else adaptive.clip
        sensitivity = self.sensitivity if adaptive is None else clip
        total = ClippedGradientSum.zeros(params, l2_sensitivity=sensitivity)
        like = next(iter(params.values()))
        unclipped = torch.zeros((), dtype=torch.float64, device=like.device)
        if self.buffer_watch.model is not self.model:  # a caller swapped the model
            self.buffer_watch = BufferWatch(self.model)
        self.buffer_watch.start()
        for inputs, targets in micro_batches:
            if len(inputs) == 0:
                continue
            part = clip_and_sum(
                self.model,
                self.loss_fn,
                inputs,
                targets,
                max_grad_norm=clip,
                views=self.views,
                method=self.clipping,
                precision=self.precision,
                groups=self.groups,
            )
            total.add_(part)
            if adaptive is not None:  # exact and private: only its noisy release is used
                unclipped += adaptive.unclipped(part.norms).to(unclipped.device)
        self.buffer_watch.check()  # before the noisy release: nothing of this batch is out yet
        apply = {
            "optimizer": self.optimizer,
            "ledger": self.ledger,
            "generator": self.generator,
            "ema": self.ema,
            "workers": self.workers,
        }
        if adaptive is None:
            noisy_step(total, params, release=self.release, **apply)
        else:
            adaptive_noisy_step(
                total, params, unclipped, adaptive, release=self.release, sigma=self.sigma, **apply
            )


def adaptive_noisy_step(
    clipped: ClippedGradientSum,
    params: Mapping[str, torch.Tensor],
    unclipped: torch.Tensor,
    adaptive: AdaptiveClipping,
    *,
    release: GradientRelease,
    sigma: float,
    ledger: PrivacyLedger,
    generator: NoiseGenerator,
    **apply: Any,
) -> None:
    """:func:`noisy_step` with adaptive clipping: the clipped sum (at C_t, noise multiplier
    σ_s of ``release``) and the unclipped count (noise σ_b), then the new clip norm.

    Privacy:
      The sum (sensitivity C_t, σ_s) and the count of the batch's examples with norm at
      most C_t (all ranks' shares summed; sensitivity 1, σ_b) are one Gaussian release of
      multiplier ``sigma`` (1/σ² = 1/σ_s² + 1/σ_b²,
      :mod:`dpvision.mechanisms.adaptive_clipping`), recorded once in ``ledger`` at rate q
      after both noises are drawn (σ = 0: a non-private release, recorded as such).
    """
    alone = PrivacyLedger()  # the sum's own entry, replaced by the entry of both
    noisy_step(clipped, params, release=release, ledger=alone, generator=generator, **apply)
    (apply.get("workers") or Workers()).all_reduce_([unclipped])
    adaptive.release(
        unclipped,
        sigma=sigma,
        sample_rate=release.sample_rate,
        expected_batch_size=release.expected_batch_size,
        ledger=ledger,
        generator=generator,
        released=release.released,
    )
