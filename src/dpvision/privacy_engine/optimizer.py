"""The optimizer wrapper: clipped sum per physical chunk, the one DP-SGD update per logical
batch (:func:`dpvision.training.engine.noisy_step`)."""

import copy
import dataclasses
import warnings
from typing import Any

import torch
from torch import nn

from dpvision.accounting import PrivacyLedger
from dpvision.averaging import ParameterEMA
from dpvision.errors import DPVisionError
from dpvision.mechanisms.clip_policy import ClipPolicy
from dpvision.mechanisms.clipped_sum import ClippedGradientSum
from dpvision.mechanisms.gradient_release import GradientRelease, ReleaseContext, noisy_step
from dpvision.mechanisms.noise import NoiseGenerator
from dpvision.per_example.bookkeeping import trainable_params, unclipped_mismatch
from dpvision.per_example.clip_terms import clip_terms
from dpvision.per_example.layers import layer_terms, low_precision
from dpvision.per_example.precision import exact_arithmetic
from dpvision.per_example.tape import ActivationTape, UnsupportedError
from dpvision.privacy_engine.chunk import Chunk
from dpvision.privacy_engine.loss import ACCUMULATE, OutputGate


class DPOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: clipped sum, noise once per logical batch, division by qN.

    The wrapped optimizer's ``param_groups``, ``state`` and ``defaults`` are shared, so
    learning-rate schedulers work on this object as on the original.

    Args:
      optimizer: the user's optimizer over the module's parameters.
      module: the (unwrapped) module whose parameters are privatised.
      tape: the hooks recording that module's activations and output gradients.
      release: σ (0: no noise, and the ledger records a non-private release), q and the
        public divisor qN of the noisy sum (:class:`GradientRelease`).
      policy: how each example's gradient is clipped (:mod:`dpvision.mechanisms.clip_policy`:
        flat at C, per layer, or adaptive, where each step also releases the unclipped
        count and σ is split between the sum and the count).
      context: the ledger each logical step is recorded in, the noise generator (None:
        torch's global generator) and the parameter EMA (:class:`ReleaseContext`).
      views: K, consecutive rows per example (1 without augmentation multiplicity).
      loss_reduction: ``"mean"`` or ``"sum"``, how the user's loss reduces over the rows of a
        physical batch (its output gradients are rescaled to per-example gradients).
      gate: the private module's :class:`~dpvision.privacy_engine.loss.OutputGate`: a pass
        whose output gradient it did not accept is refused.

    Every step must be on a chunk the private data loader announced, with as many rows as
    it yielded: a step on a batch of the loop's own (another loader, one fixed batch) would
    be accounted as a Poisson sample it is not, and is refused unless
    :meth:`declare_sampling` said how such batches are drawn.

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
        release: GradientRelease,
        policy: ClipPolicy,
        context: ReleaseContext,
        views: int = 1,
        loss_reduction: str = "mean",
        gate: OutputGate | None = None,
    ) -> None:
        # Not calling Optimizer.__init__: the state lives in the wrapped optimizer (as Opacus).
        self.original_optimizer = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.module, self.tape = module, tape
        self.release, self.policy, self.context = release, policy, context
        self.policy.noise_multiplier(release.noise_multiplier)  # refuses a σ it cannot split
        self.views, self.loss_reduction = views, loss_reduction
        self.gate = gate if gate is not None else OutputGate(loss_reduction)
        self._declared: GradientRelease | None = None  # steps on the loop's own batches
        self.params = trainable_params(module)
        self.summed = ClippedGradientSum.zeros(self.params, l2_sensitivity=policy.l2_sensitivity)
        self.steps = 0
        self._skip_next = False
        # The chunk the private data loader yielded last, until a step takes it.
        self._chunk: Chunk | None = None
        self._pending: int | None = None  # the logical batch whose clipped sum is held
        self._batches = 0
        self._released: int | None = None  # the logical batch released last

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
    def ledger(self) -> PrivacyLedger:
        """Where each logical step is recorded."""
        return self.context.ledger

    @property
    def generator(self) -> NoiseGenerator:
        """The noise generator (as Opacus' ``DPOptimizer.generator``)."""
        return self.context.generator

    @property
    def ema(self) -> ParameterEMA | None:
        """The parameter EMA updated after each logical step, or None."""
        return self.context.ema

    @property
    def max_grad_norm(self) -> float:
        """C of the next step (√(Σ C_g²) per layer, C_t adaptive)."""
        return self.policy.max_grad_norm

    @property
    def noise_multiplier(self) -> float:
        """σ of the clipped sum (as Opacus' ``DPOptimizer.noise_multiplier``; with adaptive
        clipping the sum's share σ_s of the step's σ)."""
        return self.policy.noise_multiplier(self.release.noise_multiplier)

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

    def announce_chunk(self, batch: int, last: bool, chunk: Any) -> None:
        """The next :meth:`step` is on ``chunk`` (as yielded), a part of logical batch
        ``batch`` (``last``: its end).

        Raises:
          DPVisionError: the chunk announced before was never stepped on (a loop that
            skips batches, e.g. the empty ones or those of a high loss, would release a
            number of steps that depends on the data, and the ledger would count fewer).
        """
        self.check_stepped()
        self._chunk = Chunk.of(batch, last, chunk)

    def check_stepped(self) -> None:
        """Raises if the loop went on past the chunk yielded last without stepping on it
        (or after a step on it that was refused).

        A loop that *leaves* the loader (``break``, ``return``) before stepping is not
        refused: its chunk may still be stepped on, and the loader's next pass starts with
        that logical batch again (:class:`~dpvision.privacy_engine.data_loader.DPDataLoader`).
        When to stop is the loop's choice; a stop decided on the private training loss is
        not accounted (docs: what PrivacyEngine assumes).

        Raises:
          DPVisionError: a batch was skipped (``continue`` past it, or past a refused step:
            which batches are released would depend on the data, e.g. the empty ones or
            those of high loss).
        """
        if self._chunk is not None and not self._chunk.left:
            self._chunk = None
            raise DPVisionError(SKIPPED)

    def leave(self, batch: int) -> None:
        """The loop left the loader during logical batch ``batch`` (the loader was closed)."""
        if self._chunk is not None and self._chunk.batch == batch:
            self._chunk.left = True

    def holds(self, batch: int) -> bool:
        """Whether the clipped sum of some chunks of logical batch ``batch`` (not its last)
        is held, waiting for the rest."""
        return self._pending is not None and self._pending == batch

    def released(self, batch: int) -> bool:
        """Whether logical batch ``batch`` of the private data loader was released (its
        last chunk stepped on; the loader's batches are released in the order drawn)."""
        return self._released is not None and self._released >= batch

    def declare_sampling(self, sample_rate: float) -> None:
        """Lets the steps that follow use batches this loop draws itself, accounted at rate q.

        Declare only what is true: each batch is a Poisson sample of the N examples at rate
        ``sample_rate``, drawn from randomness the adversary cannot replay (not from a
        published seed); or, with ``sample_rate=1``, each step sees any examples the loop
        chooses *without looking at the data*, each at most once (all N, one fixed batch
        for every step): such steps are accounted as Gaussian releases without
        amplification by sampling (10 steps on one fixed batch at σ = 1: ε = 17.9 at
        δ = 1e-5 by PLD, not the 2.85 of 10 Poisson steps at q = 0.1). The ledger records
        every such step at this rate; steps on the private data loader's batches keep the
        loader's rate. With adaptive clipping the declared steps use the loader's σ split.

        Raises:
          DPVisionError: ``sample_rate`` is not in (0, 1].
        """
        if isinstance(sample_rate, bool) or not 0 < float(sample_rate) <= 1:
            raise DPVisionError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        rate = float(sample_rate)
        self._declared = dataclasses.replace(
            self.release,
            sample_rate=rate,
            # N: the public qN over q, a whole number up to rounding.
            expected_batch_size=rate
            * round(self.release.expected_batch_size / self.release.sample_rate),
        )

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
        self.policy.discard()
        self._pending = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' ``.grad`` (the accumulated clipped sum is kept)."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state."""
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the wrapped optimizer's state (torch rebinds its ``state`` and
        ``param_groups``: this object shares the new ones)."""
        self.original_optimizer.load_state_dict(state_dict)
        self.state = self.original_optimizer.state
        self.param_groups = self.original_optimizer.param_groups

    def _accumulate(self, announced: "Chunk | None") -> None:
        """Adds the clipped sum of the physical batch the hooks recorded, then forgets it.

        ``announced``: the chunk the private data loader yielded (None for a step on the
        loop's own batch, declared with :meth:`declare_sampling`).

        Raises:
          DPVisionError: the recorded pass cannot be clipped per example, its loss was not
            verified, or it is not over the loader's chunk (see the message).
        """
        tape, gate = self.tape, self.gate
        try:
            calls = list(tape.calls())
        except DPVisionError as error:
            tape.clear()
            gate.clear()
            raise DPVisionError(f"PrivacyEngine does not support {error}") from None
        passes, pass_rows = tape.gradient_passes(), list(tape.pass_rows)
        captured = tape.parameter_grads
        refusal, verified = gate.refusal, set(gate.verified)
        labels, inputs, targets = dict(gate.labels), dict(gate.inputs), dict(gate.targets)
        tape.clear()
        gate.clear()
        for param in self.params.values():
            param.grad = None  # the exact gradient of private data never outlives the step
        if len(passes) > 1:
            raise DPVisionError(
                f"{len(passes)} forward passes reached one optimizer.step(), and their rows would "
                "be clipped as the same examples: call optimizer.step() after each backward (the "
                "private data loader's chunks accumulate), or run passes over the same examples "
                "inside `with model.same_examples():`"
            )
        if refusal is not None:
            raise DPVisionError(refusal)
        if not passes:
            if announced is not None and announced.rows > 0 and not pass_rows:
                raise DPVisionError(
                    "no forward pass was recorded over this batch: the private module runs "
                    "without recording in evaluation mode, under torch.no_grad() or after "
                    "model.disable_hooks(); call model.train() (and model.enable_hooks()) "
                    "before the private forward pass"
                )
            return
        if passes[0] not in verified:
            raise DPVisionError(
                "the gradient reached the model's layers without passing through its "
                "output (a loss on an intermediate activation, or the loss computed inside "
                "forward): PrivacyEngine verifies the loss at the output the private module "
                "returns; compute the loss from that output"
            )
        rows = pass_rows[passes[0]]
        if announced is not None:
            announced.check(
                rows,
                inputs.get(passes[0], []),
                labels.get(passes[0], []),
                targets.get(passes[0], []),
            )
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
        device = next(iter(self.params.values())).device if self.params else None
        with exact_arithmetic(device):
            self._clip(calls, captured, batch)

    def _clip(self, calls: list[Any], captured: Any, batch: int) -> None:
        """The clipped sum of one recorded pass, added to :attr:`summed`."""
        tape = self.tape
        # A forward pass under autocast recorded low-precision values; layer_terms upcasts
        # them or hands them to a rule that keeps norms and sums consistent in float32.
        low = any(low_precision(pairs) for _, _, pairs in calls)
        try:
            with tape.paused():  # a rule that recomputes its layer must not be recorded
                terms = [
                    (path, layer_terms(module, pairs, self.views)) for path, module, pairs in calls
                ]
        except UnsupportedError as error:
            raise DPVisionError(f"PrivacyEngine does not support {error}") from None
        if captured is not None:
            whole = {name: captured.get(name) for name in self.params}
            # The whole gradients were rounded to the low precision by autocast's kernels.
            reason = unclipped_mismatch(terms, whole, batch, tolerance=20.0 if low else 1.0)
            if reason is not None:
                raise DPVisionError(f"PrivacyEngine does not support {reason}")
        # Observed output gradients are (1/rows)·Σₖ∇ℓ (mean) or Σₖ∇ℓ (sum); the clipped unit
        # is the view mean (1/K)·Σₖ∇ℓ.
        scale = batch if self.loss_reduction == "mean" else 1.0 / self.views
        try:
            clipped = clip_terms(terms, self.params, batch, policy=self.policy, grad_scale=scale)
        except UnsupportedError as error:
            raise DPVisionError(f"PrivacyEngine does not support {error}") from None
        self.summed.add_(clipped)
        self.policy.observe(clipped.norms)  # private: only a policy's noisy release uses it

    def _release(self, release: GradientRelease) -> None:
        """The one DP-SGD update (:func:`~dpvision.mechanisms.gradient_release.noisy_step`)
        of the accumulated clipped sum: noise once, divide by qN (and C), step, record,
        update the EMA."""
        noisy_step(
            self.summed,
            self.params,
            release=release,
            policy=self.policy,
            optimizer=self.original_optimizer,
            context=self.context,
            keep_grad=True,
        )
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
        if not self.gate.hooks_enabled:
            self.tape.clear()
            self.gate.clear()
            for param in self.params.values():
                param.grad = None  # the exact gradient of the unrecorded pass goes nowhere
            raise DPVisionError(
                "optimizer.step() while model.disable_hooks() is in effect: that pass "
                "recorded no per-example gradients to clip; call model.enable_hooks() "
                "before the private forward pass"
            )
        announced: Chunk | None
        if self._chunk is not None:
            announced = self._chunk
            batch, last, release = announced.batch, announced.last, self.release
        elif self._declared is not None:  # the loop's own batches, as declared
            batch, last, announced = _MANUAL, not self._skip_next, None
            release = self._declared
        else:
            self.tape.clear()
            self.gate.clear()
            raise DPVisionError(
                "optimizer.step() on a batch that did not come from the private data loader: "
                "the accountant assumes Poisson batches of that loader. Iterate the loader "
                "make_private returned (one step per batch it yields), or declare how your "
                "batches are drawn with optimizer.declare_sampling(sample_rate)"
            )
        self._skip_next = False
        if self._pending is not None and self._pending != batch:
            self.discard_pending()
        # A refused step leaves its chunk un-stepped: a loop that catches the error and
        # goes on to the next batch skipped this one (refused at the next chunk).
        self._accumulate(announced)
        self._chunk = None
        if not last:
            self._pending = batch
            return loss
        self._pending = None
        self._release(release)
        if announced is not None:
            self._released = batch
        return loss


SKIPPED = (
    "a batch of the private data loader was skipped: call optimizer.step() once for every "
    "batch it yields, empty ones included (which batches are released would depend on the "
    "data, and nothing accounts for it). " + ACCUMULATE
)
_MANUAL = 0  # the logical-batch id of steps not announced by the private data loader
