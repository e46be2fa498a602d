"""The DP-SGD step of ``dpvision train``: per-example clipped sums of the micro-batches of a
logical batch, then the one release of :func:`dpvision.mechanisms.gradient_release.noisy_step`.
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dpvision.accounting import PrivacyLedger
from dpvision.distributed import Workers
from dpvision.errors import DPVisionError
from dpvision.mechanisms.clip_policy import ClipPolicy, make_clip_policy
from dpvision.mechanisms.clipped_sum import ClippedGradientSum
from dpvision.mechanisms.gradient_release import GradientRelease, ReleaseContext, noisy_step
from dpvision.per_example import CLIPPING_METHODS, clip_and_sum
from dpvision.training.buffers import BufferWatch


class DPSGDStep:
    """Privatises and applies one logical step of DP-SGD.

    Args:
      model: a module validated for per-example gradients (no BatchNorm).
      optimizer: any torch optimizer over ``model``'s parameters.
      loss_fn: per-example loss ``loss_fn(outputs, targets)`` (reduction "none").
      release: σ, q, the public divisor qN (:class:`GradientRelease`).
      policy: how each example's gradient is clipped
        (:mod:`dpvision.mechanisms.clip_policy`: flat, per layer or adaptive).
      context: the ledger, the noise generator, the ranks sharing each step (each passes
        its own share of the logical batch; the clipped sums are all-reduced before the
        noise, which every rank draws identically, once) and the parameter EMA.
      views: whether inputs carry K augmented views per example, (B, K, ...).
      method: how per-example gradients are computed: ``auto`` (book-keeping norms for the
        layers it supports, the torch.func reference otherwise), ``bookkeeping`` or
        ``vmap``. All give the same clipped sum.
      precision: the autocast dtype of the forward and backward passes (``torch.bfloat16``)
        or None (float32). Per-example norms, clip factors, the clipped sum and the noise
        are float32 either way (:func:`~dpvision.per_example.clip_and_sum`).

    Privacy:
      Each call releases Σᵢ clip(gᵢ) + N(0, (σΔ)² I) over the examples of one Poisson
      batch (all ranks' shares together), Δ the policy's sensitivity (C, √(Σ C_g²) per
      layer, C_t adaptive, with the unclipped count), recorded as one Poisson-sampled
      Gaussian step at rate q (:func:`~dpvision.mechanisms.gradient_release.noisy_step`).
      Everything after (division by qN, the optimizer, the EMA) is post-processing. With
      σ = 0 nothing is private and the ledger says so (a non-private baseline). A buffer
      of ``model`` written during a step (BatchNorm's running statistics, an activation
      observer) would publish an exact statistic of the batch with the model and is refused
      (:class:`~dpvision.training.buffers.BufferWatch`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        release: GradientRelease,
        policy: ClipPolicy,
        context: ReleaseContext,
        views: bool = False,
        method: str = "auto",
        precision: torch.dtype | None = None,
    ) -> None:
        if method not in CLIPPING_METHODS:
            raise DPVisionError(
                f"unknown clipping {method!r}; choose one of {', '.join(CLIPPING_METHODS)}"
            )
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.release, self.policy, self.context = release, policy, context
        self.views, self.method, self.precision = views, method, precision
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
        policy = self.policy
        total = ClippedGradientSum.zeros(params, l2_sensitivity=policy.l2_sensitivity)
        if self.buffer_watch.model is not self.model:  # a caller swapped the model
            self.buffer_watch = BufferWatch(self.model)
        self.buffer_watch.start()
        try:
            for inputs, targets in micro_batches:
                if len(inputs) == 0:
                    continue
                part = clip_and_sum(
                    self.model,
                    self.loss_fn,
                    inputs,
                    targets,
                    policy=policy,
                    views=self.views,
                    method=self.method,
                    precision=self.precision,
                )
                total.add_(part)
                policy.observe(part.norms)  # private; only a policy's noisy release uses it
            self.buffer_watch.check()  # before the noisy release: nothing of it is out yet
        except BaseException:
            policy.discard()  # this batch is not released: its count must not reach the next
            raise
        noisy_step(
            total,
            params,
            release=self.release,
            policy=policy,
            optimizer=self.optimizer,
            context=self.context,
        )

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        sample_rate: float,
        num_examples: int,
        ledger: PrivacyLedger,
        generator: Any = None,
        clipping: str = "flat",
        **options: Any,
    ) -> "DPSGDStep":
        """A step from Opacus-style numbers: σ, C, q, N and ``clipping`` (``flat``,
        ``per_layer``, ``adaptive``; with adaptive clipping's options as in
        :func:`~dpvision.mechanisms.clip_policy.make_clip_policy`). The other ``options`` are
        the constructor's (``views``, ``method``, ``precision``), :class:`ReleaseContext`'s
        (``workers``, ``ema``) and ``normalize_update``.
        """
        context = ReleaseContext(
            ledger=ledger,
            generator=generator,
            workers=options.pop("workers", None) or Workers(),
            ema=options.pop("ema", None),
        )
        release = GradientRelease(
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            expected_batch_size=sample_rate * num_examples,
            normalize_update=options.pop("normalize_update", False),
        )
        step = {key: options.pop(key) for key in ("views", "method", "precision") if key in options}
        policy = make_clip_policy(
            clipping,
            max_grad_norm,
            expected_batch_size=release.expected_batch_size,
            model=model,
            **options,
        )
        return cls(
            model, optimizer, loss_fn, release=release, policy=policy, context=context, **step
        )
