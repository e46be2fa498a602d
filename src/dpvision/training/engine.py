"""One logical DP-SGD step over any number of physical micro-batches (De et al., Alg. 1).

The logical batch (Poisson-sampled, expected size qN) may be split into physical
micro-batches to fit in memory; clipped gradient sums are accumulated over them and the
Gaussian noise N(0, (σC)²) is added **once** per logical step, then the total is divided by
the public expected batch size qN. Splitting is therefore a memory knob that never changes
the noise. The privatised gradient is handed to any torch optimizer (SGD, momentum, Adam),
and an exponential moving average of the parameters can follow each logical step.
"""

import math
from collections.abc import Callable, Iterable

import torch

from dpvision.accounting import PrivacyLedger
from dpvision.distributed import Workers
from dpvision.errors import DPVisionError
from dpvision.mechanisms import gaussian_noise, observe_release
from dpvision.training.per_example import ClippedGradientSum, clipped_gradient_sum

CLIPPING_METHODS = ("auto", "bookkeeping", "vmap")


def ema_decay(decay: float, step: int) -> float:
    """min(μ, (1 + t)/(10 + t)): the warm-up of jax_privacy and TAN, t the logical step."""
    return min(decay, (1 + step) / (10 + step))


@torch.no_grad()
def privatize_gradients(
    sums_and_params: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: float,
    normalize_update: bool,
    ledger: PrivacyLedger,
    sample_rate: float,
    generator: torch.Generator | None,
    released: str,
) -> None:
    """Adds the noise of one logical step to clipped sums and sets each parameter's ``.grad``.

    ``.grad = (Σᵢ clip(gᵢ, C) + N(0, (σC)² I)) / (qN)`` (also divided by C with
    ``normalize_update``), the noise drawn once for each parameter in the order given.
    Modifies the sums in place.

    Privacy:
      Releases the clipped sums over all parameters together with Gaussian noise of
      multiplier σ and L2 sensitivity C, one Poisson-sampled Gaussian step at rate q, and
      records it in ``ledger`` (σ = 0: a non-private release, recorded as such). The
      division by the public qN is post-processing.
    """
    divisor = expected_batch_size * (max_grad_norm if normalize_update else 1.0)
    for index, (total, param) in enumerate(sums_and_params):
        total = observe_release(
            total, l2_sensitivity=max_grad_norm, released=released, part=index > 0
        )
        if noise_multiplier > 0:
            total += gaussian_noise(
                total.shape,
                l2_sensitivity=max_grad_norm,
                noise_multiplier=noise_multiplier,
                dtype=total.dtype,
                device=total.device,
                generator=generator,
            )
        param.grad = total / divisor
    if noise_multiplier > 0:
        # The noise on all parameters together is one Gaussian release of sensitivity C.
        ledger.record(
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            l2_sensitivity=max_grad_norm,
            released=released,
        )
    else:
        ledger.record_non_private(released=f"{released} without noise")


class ParameterEMA:
    """Exponential moving average of a model's parameters, updated once per logical step."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.step = 0
        self.shadow = {k: v.detach().clone() for k, v in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        mu = ema_decay(self.decay, self.step)
        for name, param in model.named_parameters():
            self.shadow[name].mul_(mu).add_(param.detach(), alpha=1 - mu)
        self.step += 1

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
        linear, convolution and group-norm layers, the torch.func reference otherwise),
        ``bookkeeping`` or ``vmap``. All give the same clipped sum.
      normalize_update: jax_privacy's ``rescale_to_unit_norm`` (the normalised DP-SGD of
        De et al.): the noisy sum is divided by C as well, so the update no longer scales
        with C. The release and its sensitivity are unchanged.

    Privacy:
      Each call releases Σᵢ clip(gᵢ, C) + N(0, (σC)² I) over the examples of one Poisson
      batch (all ranks' shares together), L2 sensitivity C, recorded as one
      Poisson-sampled Gaussian step at rate q.
      Everything after (division by qN, the optimizer, the EMA) is post-processing. With
      σ = 0 nothing is private and the ledger says so (a non-private baseline).
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
        generator: torch.Generator,
        views: bool = False,
        clipping: str = "auto",
        normalize_update: bool = False,
        workers: Workers | None = None,
    ) -> None:
        if clipping not in CLIPPING_METHODS:
            raise DPVisionError(
                f"unknown clipping {clipping!r}; choose one of {', '.join(CLIPPING_METHODS)}"
            )
        if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise DPVisionError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.noise_multiplier, self.max_grad_norm = noise_multiplier, max_grad_norm
        self.sample_rate, self.num_examples = sample_rate, num_examples
        self.ledger, self.generator, self.views = ledger, generator, views
        self.clipping, self.normalize_update = clipping, normalize_update
        self.workers = workers or Workers()

    def __call__(self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Applies one logical step whose examples arrive as (inputs, targets) micro-batches.

        An empty logical batch is an empty iterable: it still gets its noise. Under
        ``torchrun`` every rank calls this with its own share of the batch.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        names = [k for k, p in self.model.named_parameters() if p.requires_grad]
        total = [torch.zeros_like(p) for p in params]
        for inputs, targets in micro_batches:
            if len(inputs) == 0:
                continue
            clipped = self._clip(inputs, targets)
            for acc, name in zip(total, names, strict=True):
                acc += clipped.grads[name]
        # Exact sums over every rank's share, then the noise once (Algorithm 1). No count of
        # the batch's examples or of its non-finite gradients is kept: both are private.
        self.workers.all_reduce_(total)
        privatize_gradients(
            list(zip(total, params, strict=True)),
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm,
            expected_batch_size=self.sample_rate * self.num_examples,
            normalize_update=self.normalize_update,
            ledger=self.ledger,
            sample_rate=self.sample_rate,
            generator=self.generator,
            released="DP-SGD clipped gradient sum",
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _clip(self, inputs: torch.Tensor, targets: torch.Tensor) -> ClippedGradientSum:
        if self.clipping == "vmap":
            return clipped_gradient_sum(
                self.model,
                self.loss_fn,
                inputs,
                targets,
                max_grad_norm=self.max_grad_norm,
                views=self.views,
            )
        from dpvision.training.bookkeeping import clip_and_sum

        return clip_and_sum(
            self.model,
            self.loss_fn,
            inputs,
            targets,
            max_grad_norm=self.max_grad_norm,
            views=self.views,
            method=self.clipping,
        )
