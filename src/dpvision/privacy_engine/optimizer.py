"""The optimizer wrapper: clipped sum per physical chunk, the one DP-SGD update per logical
batch (:func:`dpvision.training.engine.noisy_step`)."""

import copy
import warnings
from typing import Any

import torch
from torch import nn

from dpvision.accounting import PrivacyLedger
from dpvision.errors import DPVisionError
from dpvision.mechanisms.adaptive_clipping import AdaptiveClipping
from dpvision.mechanisms.noise import NoiseGenerator
from dpvision.per_example.bookkeeping import clip_terms, trainable_params, unclipped_mismatch
from dpvision.per_example.groups import GroupNorms
from dpvision.per_example.layers import layer_terms
from dpvision.per_example.reference import ClippedGradientSum
from dpvision.per_example.tape import ActivationTape, UnsupportedError
from dpvision.training.engine import (
    GradientRelease,
    ParameterEMA,
    adaptive_noisy_step,
    noisy_step,
)


class DPOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: clipped sum, noise once per logical batch, division by qN.

    The wrapped optimizer's ``param_groups``, ``state`` and ``defaults`` are shared, so
    learning-rate schedulers work on this object as on the original.

    Args:
      optimizer: the user's optimizer over the module's parameters.
      module: the (unwrapped) module whose parameters are privatised.
      tape: the hooks recording that module's activations and output gradients.
      noise_multiplier: σ ≥ 0 (0: no noise, and the ledger records a non-private release).
      max_grad_norm: C.
      sample_rate: q, the Poisson rate of the logical batches.
      num_examples: N; the noisy sum is divided by the public qN.
      ledger: where each logical step is recorded.
      generator: the noise generator (None: torch's global generator).
      views: K, consecutive rows per example (1 without augmentation multiplicity).
      loss_reduction: ``"mean"`` or ``"sum"``, how the user's loss reduces over the rows of a
        physical batch (its output gradients are rescaled to per-example gradients).
      normalize_update: also divide by C (jax_privacy's ``rescale_to_unit_norm``).
      ema_decay: decay of a parameter EMA updated after each logical step, or None.
      groups: per-layer clip norms (``clipping="per_layer"``); C is then √(Σ C_g²).
      adaptive: adaptive clipping (``clipping="adaptive"``): C follows a quantile of the
        per-example norms; each step also releases the unclipped count, and σ is split
        between the sum and the count (:mod:`dpvision.mechanisms.adaptive_clipping`).

    Privacy:
      Each logical step releases Σᵢ clip(gᵢ, C) + N(0, (σC)² I) over the examples of one
      Poisson batch (gᵢ the mean of example i's K view-gradients, all trainable parameters
      together), L2 sensitivity C under add/remove-one, recorded as one Poisson-sampled
      Gaussian step at rate q. Physical chunks only accumulate the clipped sum; the noise is
      drawn once per logical batch. Division by qN, the optimizer and the EMA are
      post-processing. Non-finite per-example gradients contribute zero.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        module: nn.Module,
        tape: ActivationTape,
        noise_multiplier: float,
        max_grad_norm: float,
        sample_rate: float,
        num_examples: int,
        ledger: PrivacyLedger,
        generator: NoiseGenerator = None,
        views: int = 1,
        loss_reduction: str = "mean",
        normalize_update: bool = False,
        ema_decay: float | None = None,
        groups: GroupNorms | None = None,
        adaptive: AdaptiveClipping | None = None,
    ) -> None:
        # Not calling Optimizer.__init__: the state lives in the wrapped optimizer (as Opacus).
        self.original_optimizer = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.module, self.tape, self.ledger, self.generator = module, tape, ledger, generator
        self.groups = groups
        self.max_grad_norm = float(max_grad_norm if groups is None else groups.l2_sensitivity)
        self.adaptive, self.sigma = adaptive, float(noise_multiplier)
        if adaptive is not None:
            self.max_grad_norm = adaptive.clip
        self._unclipped = torch.zeros((), dtype=torch.float64)
        self.release = GradientRelease(
            noise_multiplier=(
                self.sigma if adaptive is None else adaptive.sum_noise_multiplier(self.sigma)
            ),
            sample_rate=sample_rate,
            expected_batch_size=sample_rate * num_examples,
            normalize_update=normalize_update,
        )
        self.views, self.loss_reduction = views, loss_reduction
        self.params = trainable_params(module)
        self.ema = None if ema_decay is None else ParameterEMA(module, ema_decay)
        self.summed = ClippedGradientSum.zeros(self.params, l2_sensitivity=self.max_grad_norm)
        self.steps = 0
        self._skip_next = False
        # (logical batch, whether this chunk ends it), announced by the private data loader.
        self._chunk: tuple[int, bool] | None = None
        self._pending: int | None = None  # the logical batch whose clipped sum is held
        self._batches = 0

    def ema_model(self) -> nn.Module:
        """A copy of the module with the averaged (EMA) parameters, in evaluation mode.

        The copy has no recording hooks: use it for evaluation, saving or serving. Its
        parameters are post-processing of the noisy releases (no privacy cost).
        """
        if self.ema is None:
            raise DPVisionError(
                "no parameter EMA: pass ema_decay (e.g. 0.999) to PrivacyEngine.make_private"
            )
        inert = ActivationTape(nn.Identity())
        model = copy.deepcopy(self.module, {id(self.tape): inert})
        for layer in model.modules():  # drop the copied recording hooks, keep any others
            for key, hook in list(layer._forward_hooks.items()):
                if getattr(hook, "__self__", None) is inert:
                    del layer._forward_hooks[key]
                    layer._forward_hooks_with_kwargs.pop(key, None)
        return self.ema.copy_to(model).eval()

    @property
    def noise_multiplier(self) -> float:
        """σ (as Opacus' ``DPOptimizer.noise_multiplier``)."""
        return self.release.noise_multiplier

    @property
    def sample_rate(self) -> float:
        """q, the Poisson rate of the logical batches."""
        return self.release.sample_rate

    @property
    def expected_batch_size(self) -> float:
        """qN, the public divisor of the noisy sum."""
        return self.release.expected_batch_size

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Marks the next :meth:`step` as a physical chunk that is not the last of its batch.

        For loops that do their own chunking; the private data loader signals for you.
        """
        self._skip_next = do_skip

    def new_logical_batch(self) -> int:
        """A fresh id for the chunks of one logical batch (used by the data loader)."""
        self._batches += 1
        return self._batches

    def announce_chunk(self, batch: int, last: bool) -> None:
        """The next :meth:`step` is a chunk of logical batch ``batch`` (``last``: its end)."""
        self._chunk = (batch, last)

    def discard_pending(self, batch: int | None = None) -> None:
        """Drops the clipped sum of an unfinished logical batch (``batch``: only that one).

        Nothing of it was released or recorded, so dropping it costs no privacy; mixing it
        into the next batch's release would let its examples count twice.
        """
        if self._pending is None or (batch is not None and self._pending != batch):
            return
        warnings.warn(
            "a logical batch was left before its last physical chunk: its clipped sum was "
            "discarded (nothing of it was released or recorded)",
            stacklevel=3,
        )
        self.summed = ClippedGradientSum.zeros(self.params, l2_sensitivity=self.max_grad_norm)
        self._unclipped = torch.zeros((), dtype=torch.float64)
        self._pending = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' ``.grad`` (the accumulated clipped sum is kept)."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state."""
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the wrapped optimizer's state."""
        self.original_optimizer.load_state_dict(state_dict)

    def _accumulate(self) -> None:
        """Adds the clipped sum of the physical batch the hooks recorded, then forgets it.

        Raises:
          DPVisionError: the recorded pass cannot be clipped per example (see the message).
        """
        tape = self.tape
        try:
            calls = list(tape.calls())
        except DPVisionError as error:
            tape.clear()
            raise DPVisionError(f"PrivacyEngine does not support {error}") from None
        passes, pass_rows = tape.gradient_passes(), list(tape.pass_rows)
        captured = tape.parameter_grads
        tape.clear()
        for param in self.params.values():
            param.grad = None  # the exact gradient of private data never outlives the step
        if len(passes) > 1:
            raise DPVisionError(
                f"{len(passes)} forward passes reached one optimizer.step(), and their rows would "
                "be clipped as the same examples: call optimizer.step() after each backward (the "
                "private data loader's chunks accumulate), or run passes over the same examples "
                "inside `with model.same_examples():`"
            )
        if not passes:
            return
        rows = pass_rows[passes[0]]
        for path, module, pairs in calls:
            seen = [n for call in pairs for n in tape.rows(module, call) if n != rows]
            if seen:
                raise DPVisionError(
                    f"PrivacyEngine does not support layer {path or 'the root'} seeing "
                    f"{seen[0]} rows in a pass over {rows}: it folds positions into the "
                    "batch or is not batch-first; keep the examples first in every layer "
                    "with trainable parameters"
                )
        if rows == 0:
            return
        batch = rows // self.views
        try:
            with tape.paused():  # a rule that recomputes its layer must not be recorded
                terms = [
                    (path, layer_terms(module, pairs, self.views)) for path, module, pairs in calls
                ]
        except UnsupportedError as error:
            raise DPVisionError(f"PrivacyEngine does not support {error}") from None
        if captured is not None:
            whole = {name: captured.get(name) for name in self.params}
            reason = unclipped_mismatch(terms, whole, batch)
            if reason is not None:
                raise DPVisionError(f"PrivacyEngine does not support {reason}")
        # Observed output gradients are (1/rows)·Σₖ∇ℓ (mean) or Σₖ∇ℓ (sum); the clipped unit
        # is the view mean (1/K)·Σₖ∇ℓ.
        scale = batch if self.loss_reduction == "mean" else 1.0 / self.views
        try:
            clipped = clip_terms(
                terms,
                self.params,
                batch,
                max_grad_norm=self.max_grad_norm,
                grad_scale=scale,
                groups=self.groups,
            )
        except UnsupportedError as error:
            raise DPVisionError(f"PrivacyEngine does not support {error}") from None
        self.summed.add_(clipped)
        if self.adaptive is not None:  # exact and private: only its noisy release is used
            self._unclipped = self._unclipped + self.adaptive.unclipped(clipped.norms)

    def _release(self) -> None:
        """The one DP-SGD update (:func:`~dpvision.training.engine.noisy_step`) of the
        accumulated clipped sum: noise once, divide by qN (and C), step, record, update
        the EMA."""
        apply = {
            "release": self.release,
            "optimizer": self.original_optimizer,
            "ledger": self.ledger,
            "generator": self.generator,
            "ema": self.ema,
            "keep_grad": True,
        }
        if self.adaptive is None:
            noisy_step(self.summed, self.params, **apply)
        else:
            unclipped, self._unclipped = self._unclipped, torch.zeros((), dtype=torch.float64)
            adaptive_noisy_step(
                self.summed, self.params, unclipped, self.adaptive, sigma=self.sigma, **apply
            )
            self.max_grad_norm = self.adaptive.clip
        self.summed = ClippedGradientSum.zeros(self.params, l2_sensitivity=self.max_grad_norm)
        self.steps += 1

    def step(self, closure: Any = None) -> Any:
        """Accumulates this physical batch; at the end of a logical batch, takes the step.

        Call it once per batch of the private data loader, *empty batches included*: an
        empty logical batch still gets its noise and its ledger entry.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._chunk is not None:
            batch, last = self._chunk
        else:  # a loop of its own: one logical batch, unless signal_skip_step said otherwise
            batch, last = _MANUAL, not self._skip_next
        self._chunk, self._skip_next = None, False
        if self._pending is not None and self._pending != batch:
            self.discard_pending()
        self._accumulate()
        if not last:
            self._pending = batch
            return loss
        self._pending = None
        self._release()
        return loss


_MANUAL = 0  # the logical-batch id of steps not announced by the private data loader
