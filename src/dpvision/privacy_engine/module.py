"""The user's module wrapped with the hooks that per-example clipping needs (Opacus'
``GradSampleModule``)."""

import contextlib
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.per_example.batch_layout import (
    EXACT_ROUNDOFF,
    batch_tensor,
    check_batch_layout,
    mixed_rows,
    perturbed,
    probe_arithmetic,
    roundoff,
    row_length,
    signature,
)
from dpvision.per_example.bookkeeping import trainable_params
from dpvision.per_example.layers.base import output_tensors
from dpvision.per_example.tape import ActivationTape
from dpvision.privacy_engine.loss import OutputGate, PerExampleLoss, row_sizes
from dpvision.training.buffers import BufferWatch


class PrivateModule(nn.Module):
    """The user's module, with the hooks that record what per-example clipping needs.

    ``forward`` is the wrapped module's; the module itself is ``_module`` (as in Opacus'
    ``GradSampleModule``), so its ``state_dict`` keys carry a ``_module.`` prefix.

    Each forward pass in training mode with autograd on is one pass over the examples of
    its first tensor argument (rows first, K consecutive rows per example). The first pass
    of every input shape is probed (:mod:`dpvision.per_example.batch_layout`): a layer that
    does not see one row per example, or an output that mixes examples, is refused there,
    and the coming backward pass checks that every parameter gets its whole gradient
    through its layer. In evaluation mode nothing is recorded and any batch size is fine.

    Every recorded pass is then checked for mixing *as it ran*: the module runs once more
    without gradients on the same batch with one example changed (the largest, by several
    times its size), from the random state the pass started from (the same dropout masks,
    the same coin of a model that mixes rows at random), and a row of another example that
    changed refuses the pass before anything of it is released; a model that starts mixing
    at step 1000, or at one step in two, is refused at that step. The cost is one forward
    pass without gradients per step. The outputs come back through an
    :class:`~dpvision.privacy_engine.loss.OutputGate`, which checks the gradient that
    reaches them and makes it exact (:mod:`dpvision.privacy_engine.loss`); the size of each
    input row is kept for the step to compare with the rows the data loader yielded.

    Privacy:
      A recorded pass (its probe, its re-run and its backward pass included) must leave the
      module's buffers, and the tensors its attributes hold, as they were: a buffer it
      writes (BatchNorm's running statistics in training mode, an activation observer) or a
      plain tensor attribute (a running mean without ``register_buffer``) would keep an
      exact statistic of the private batch for later passes (and the ``state_dict``), and
      is refused (:class:`~dpvision.training.buffers.BufferWatch`).
    """

    def __init__(
        self, module: nn.Module, tape: ActivationTape, views: int, gate: OutputGate | None = None
    ) -> None:
        super().__init__()
        self._module = module
        self._tape = tape
        self.views = views
        self._gate = gate if gate is not None else OutputGate("mean")
        self._checked: dict[Any, int] = {}  # signature → values per row of its pass
        self._same_examples = False
        self._buffer_watch = BufferWatch(module, what="the module")
        self._check_queued = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the wrapped module; with K views, rows must come in whole examples.

        In evaluation mode (``model.eval()``) or under ``torch.no_grad()`` it is the plain
        module: any batch size, nothing recorded.

        Raises:
          DPVisionError: the batch is not whole examples, a layer does not keep them apart,
            or the pass wrote one of the module's buffers (see the message).
        """
        if not torch.is_grad_enabled() or not self.training or not self.hooks_enabled:
            with self._tape.paused():
                return self._module(*args, **kwargs)
        batch = batch_tensor(args, kwargs)
        if batch is None or batch.dim() == 0:
            raise DPVisionError(
                "the private module needs the examples as a tensor argument, one row each"
            )
        rows = batch.shape[0]
        if rows % self.views:
            raise DPVisionError(
                f"the batch has {rows} rows, not a multiple of augmult K = {self.views}: feed the "
                "batches of the private data loader unchanged"
            )
        self._tape.begin_pass(rows, same_examples=self._same_examples)
        # From before the probe: it runs on these private rows too, and it writes back the
        # buffers its passes moved, not the attributes.
        self._buffer_watch.start()
        key = signature(self._module, args, kwargs)
        if key not in self._checked and rows >= 2 * self.views:
            self._checked[key] = check_batch_layout(
                self._module, self._tape.layers, args, kwargs, views=self.views
            )
            self._tape.capture_parameter_grads(trainable_params(self._module))
        # Every tensor argument is compared with the loader's fields at the step (every pass
        # over the same examples): batch statistics passed as arguments are not the data.
        sizes = []
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
                sizes.append(row_sizes(value))
            elif isinstance(value, torch.Tensor) and value.is_floating_point():
                raise DPVisionError(
                    f"the private module got a floating-point tensor of shape "
                    f"{tuple(value.shape)} that is not one row per example: a batch statistic "
                    "would reach every example's output; pass constants as buffers of the model"
                )
        state = _random_state(batch.device)
        output = self._module(*args, **kwargs)
        self._buffer_watch.check()
        if rows >= 2 * self.views:  # sizes[0]: the batch's, the first tensor argument
            length = self._checked[key] + sum(map(row_length, output_tensors(output)))
            self._check_rows_apart(args, kwargs, output, state, sizes[0][:, 0], length)
        self._gate.inputs.setdefault(len(self._tape.pass_rows) - 1, []).extend(sizes)
        gated = self._gate.gated(output, rows, len(self._tape.pass_rows) - 1)
        for tensor in _grad_tensors(gated):  # the watch again when the backward pass ends
            tensor.register_hook(self._queue_check)  # type: ignore[no-untyped-call]
        return gated

    def _queue_check(self, grad: torch.Tensor) -> None:
        """From the backward pass through an output: checks the watch once it ends, since a
        gradient hook that keeps a statistic of the batch's gradients on the module (an
        attribute, a buffer) would reach the next steps as a forward write would."""
        if not self._check_queued:
            self._check_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._check_backward)

    def _check_backward(self) -> None:
        """Refuses (here, and at the step) a backward pass that wrote the module's state.

        Privacy:
          Releases nothing: the error names a buffer or attribute, never a value.
        """
        self._check_queued = False
        try:
            self._buffer_watch.check(during="backward pass")
        except DPVisionError as error:
            self._gate.refusal = str(error)  # a step on this pass is refused too
            raise

    def per_example_loss(self, criterion: Any, *, weight: float = 1.0) -> PerExampleLoss:
        """``criterion`` (per-row losses, ``reduction="none"``) evaluated one example at a
        time, with the loss reduction of ``make_private`` and a public ``weight``: the way
        to train with class weights, ``ignore_index``, label smoothing, an auxiliary head or
        a loss of your own (see :class:`~dpvision.privacy_engine.loss.PerExampleLoss`)."""
        return PerExampleLoss(
            criterion,
            self._gate,
            loss_reduction=self._gate.loss_reduction,
            views=self.views,
            weight=weight,
        )

    def _check_rows_apart(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        state: Any,
        row_size: torch.Tensor,
        length: int,
    ) -> None:
        """Refuses this pass if, run again from its random state with one example changed,
        an output row of another example changes (see the class docstring). ``row_size``:
        Σ|x| of each row of the batch; ``length``: the values per row the pass computes (the
        n of the rounding tolerance, :func:`~dpvision.per_example.batch_layout.mixed_rows`).

        In IEEE float32 (or float64) the pass's own output is compared with the re-run. In a
        lower precision (autocast, TF32 or bf16 float32 products), whose rounding could hide
        mixing, both are re-run in IEEE float32 (the layout probe's arithmetic) from the
        pass's random state: one forward pass more, without gradients."""
        batch = batch_tensor(args, kwargs)
        assert batch is not None
        # The example of largest size changed by several times its size, and (from three
        # examples on) the smallest made larger than any: a guard that divides by the
        # batch's maximum once an outlier is in, or a median, then moves for the others.
        sizes = row_size.reshape(-1, self.views).sum(1)
        changed_examples = [int(sizes.argmax())]
        changed = perturbed(batch, self.views, changed_examples[0], strength=8.0)
        if changed is None:
            return
        if len(sizes) >= 3:
            smallest = int(sizes.argmin())
            if smallest != changed_examples[0]:
                largest = float(batch.abs().max()) if batch.is_floating_point() else 0.0
                both = perturbed(changed, self.views, smallest, strength=8.0 * (1.0 + largest))
                if both is not None:
                    changed, changed_examples = both, [*changed_examples, smallest]
        rows = batch.shape[0]

        def swap(value: Any) -> Any:
            if value is batch:
                return changed
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
                moved = value
                for example in changed_examples:  # the same examples in every argument
                    other = perturbed(moved, self.views, example, strength=8.0)
                    moved = moved if other is None else other
                return moved
            return value

        swapped_args = tuple(swap(a) for a in args)
        swapped_kwargs = {k: swap(v) for k, v in kwargs.items()}
        # A model that drew no random numbers also runs without one other example: its other
        # rows must not move when the batch is one example smaller.
        keep, dropped = None, None
        if _same_state(state, _random_state(batch.device)) and rows // self.views >= 4:
            dropped = max(set(range(rows // self.views)) - set(changed_examples))
            keep = torch.ones(rows, dtype=torch.bool, device=batch.device)
            keep[dropped * self.views : (dropped + 1) * self.views] = False

            def drop(value: Any) -> Any:
                is_rows = isinstance(value, torch.Tensor) and value.dim() > 0
                return value[keep] if is_rows and value.shape[0] == rows else value

            swapped_args = tuple(drop(a) for a in swapped_args)
            swapped_kwargs = {k: drop(v) for k, v in swapped_kwargs.items()}
        after = _random_state(batch.device)
        unit = roundoff(self._module, batch.device, batch)
        try:
            reference = output
            arithmetic: Any = contextlib.nullcontext()
            if unit > EXACT_ROUNDOFF:
                arithmetic = probe_arithmetic(self._module, batch.device)
                _set_random_state(batch.device, state)
                with torch.no_grad(), self._tape.paused(), arithmetic:
                    unit = roundoff(self._module, batch.device, batch)
                    reference = self._module(*args, **kwargs)
                arithmetic = probe_arithmetic(self._module, batch.device)
            _set_random_state(batch.device, state)
            with torch.no_grad(), self._tape.paused(), arithmetic:
                again = self._module(*swapped_args, **swapped_kwargs)
        finally:
            _set_random_state(batch.device, after)
        self._buffer_watch.check()  # the extra pass may not write a buffer either
        examples = [e - int(dropped is not None and e > dropped) for e in changed_examples]
        for before, moved in zip(output_tensors(reference), output_tensors(again), strict=False):
            if not (before.dim() and before.shape[0] == rows):
                continue
            before = before.detach() if keep is None else before.detach()[keep]
            if before.shape == moved.shape and mixed_rows(
                before, moved, self.views, examples, unit=unit, length=length
            ):
                self._tape.clear()
                raise DPVisionError(
                    "the model mixed examples in this pass: an output row of another "
                    "example changed when one example changed or the batch lost one (mixup "
                    "across the batch, a batch statistic, a mode switched on during training); "
                    "per-example clipping needs every example's output to depend on it alone"
                )

    @contextmanager
    def same_examples(self) -> Iterator[None]:
        """Forward passes in this block are over the same examples as the pass before.

        By default every forward pass is a new set of examples, and two passes before one
        ``optimizer.step()`` are refused (their rows j would be clipped as one example).
        For a second loss on the *same* batch (the rows again under other dropout masks, as
        in R-Drop), run the extra passes inside this block: each example's gradient is then
        the sum over the passes, clipped once. Every pass must be over the rows the data
        loader yielded (checked at the step, up to a cast): views made in the loop are
        refused, since nothing shows they are per-example; make them with ``augmult`` and
        relate an example's K views in ``model.per_example_loss``.
        """
        self._same_examples = True
        try:
            yield
        finally:
            self._same_examples = False

    def disable_hooks(self) -> None:
        """Opacus' ``disable_hooks``: forward passes run the plain module and record nothing,
        for a non-private forward and backward (a public batch, a probe). An
        ``optimizer.step()`` over such a pass is refused: it has no per-example gradients to
        clip, and the exact gradient is never released. :meth:`enable_hooks` turns them back
        on."""
        self._gate.hooks_enabled = False

    def enable_hooks(self) -> None:
        """Opacus' ``enable_hooks``: forward passes in training mode are recorded again."""
        self._gate.hooks_enabled = True

    @property
    def hooks_enabled(self) -> bool:
        """Opacus' ``GradSampleModule.hooks_enabled``: whether passes are recorded (shared
        with the optimizer, which refuses a step while they are off)."""
        return self._gate.hooks_enabled

    def remove_hooks(self) -> None:
        """Detaches the recording hooks (the module then trains without privacy)."""
        self._tape.detach()


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an output (tensors in tuples, lists, dicts, dataclasses) that a
    backward pass can reach."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, field.name) for field in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, tuple | list):
        return [t for item in value for t in _grad_tensors(item)]
    return []


def _random_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch's random state on the CPU and on ``device``'s CUDA generator."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.random.get_rng_state(), cuda


def _same_state(
    one: tuple[torch.Tensor, torch.Tensor | None], other: tuple[torch.Tensor, torch.Tensor | None]
) -> bool:
    """Whether two random states are the same (no random number was drawn in between)."""
    return all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(one, other, strict=True)
    )


def _set_random_state(
    device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]
) -> None:
    cpu, cuda = state
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
