"""The activation tape: forward hooks that record, for every layer with trainable
parameters, its inputs and where its output gradients will come from.

Book-keeping clipping (:mod:`dpvision.per_example.bookkeeping`) and the Opacus-style
:class:`~dpvision.privacy_engine.PrivateModule` read per-example quantities off it.

Privacy: records intermediate values of one batch for the clipping that follows; releases
nothing.
"""

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from dpvision.errors import DPVisionError
from dpvision.per_example.layers import (
    Call,
    Claim,
    ParameterTaps,
    UnsupportedError,
    claims,
    output_tensors,
)

__all__ = ["ActivationTape", "UnsupportedError", "tracked_layers"]


def tracked_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module whose trainable parameters a rule clips."""
    return [(claim.path, claim.module) for claim in claims(model)]


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple | list):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _versions(value: Any) -> list[tuple[torch.Tensor, int]]:
    if isinstance(value, torch.Tensor):
        return [(value, value._version)]
    if isinstance(value, tuple | list):
        return [pair for v in value for pair in _versions(v)]
    if isinstance(value, dict):
        return [pair for v in value.values() for pair in _versions(v)]
    return []


class ActivationTape:
    """Forward hooks that record each claimed layer's calls and its output-gradient sources.

    What a call leaves depends on how its module is claimed
    (:func:`~dpvision.per_example.layers.claims`): a *layer* its input tensor and one output
    gradient, a *unit* (a layer for the ``torch.func`` rule) all its arguments and the
    gradient of each output, an owner of *free* parameters the per-row stand-ins that
    :class:`~dpvision.per_example.layers.ParameterTaps` made during its ``forward``, and
    their gradients.

    In ``edges`` mode the tape keeps the autograd edge of every watched tensor, for
    ``torch.autograd.grad(loss, tape.edges)`` (in-place changes of an output later in the
    forward pass do not disturb it). In ``hooks`` mode it registers a tensor hook on each,
    so that an ordinary ``loss.backward()`` delivers the gradients (this is what
    :class:`~dpvision.privacy_engine.PrivacyEngine` uses). Calls made without autograd
    (``torch.no_grad()``, evaluation) are not recorded.

    In ``edges`` mode, :attr:`on_ready` (if set before the backward pass) is called with a
    module as soon as every watched output of all its calls has its gradient, while the
    backward pass goes on: the caller can compute that layer's terms and :meth:`forget` its
    records, so that its inputs are freed as the backward passes instead of at its end.

    Args:
      model: the model whose layers to watch.
      mode: ``"edges"`` or ``"hooks"``.
    """

    def __init__(self, model: nn.Module, mode: str = "edges") -> None:
        if mode not in ("edges", "hooks"):
            raise ValueError(f"mode must be 'edges' or 'hooks', got {mode!r}")
        self.mode = mode
        self.claims: list[Claim] = claims(model)
        self.layers = [(claim.path, claim.module) for claim in self.claims]
        self.kinds = {claim.module: claim.kind for claim in self.claims}
        # Layers whose rule also reads their output: their calls are ((input, output), grad).
        self.with_outputs = {c.module for c in self.claims if c.rule.with_output}
        # What each call left (see the class docstring); None when no input tensor came.
        self.inputs: dict[nn.Module, list[Any]] = defaultdict(list)
        # The forward pass each call belongs to (see begin_pass), and each pass's rows.
        self.call_pass: dict[nn.Module, list[int]] = defaultdict(list)
        self.pass_rows: list[int] = []
        # module → call index → output slot → gradient
        self.grads: dict[nn.Module, dict[int, dict[int, torch.Tensor]]] = defaultdict(dict)
        self.edges: list[GradientEdge] = []
        self._edge_owners: list[tuple[nn.Module, int, int]] = []
        self._handles: list[Any] = []
        self._active: dict[nn.Module, list[ParameterTaps | None]] = defaultdict(list)
        self._paused = False
        # Whole gradients of the parameters, captured on passes that verify book-keeping.
        self.parameter_grads: dict[str, torch.Tensor] | None = None
        self._parameter_handles: list[Any] = []
        # Edges mode: watched outputs still without a gradient, per module; on_ready.
        self._waiting: dict[nn.Module, int] = defaultdict(int)
        self.on_ready: Callable[[nn.Module], None] | None = None
        self._forgotten: set[nn.Module] = set()

    def attach(self) -> None:
        """Registers the forward hooks (idempotent)."""
        if self._handles:
            return
        for claim in self.claims:
            module = claim.module
            if claim.kind == "free":
                self._handles += [
                    module.register_forward_pre_hook(self._enter, with_kwargs=True),
                    module.register_forward_hook(self._leave, always_call=True),
                ]
            else:
                self._handles.append(module.register_forward_hook(self._record, with_kwargs=True))

    def detach(self) -> None:
        """Removes every hook and forgets what was recorded."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()

    def clear(self) -> None:
        """Forgets the recorded inputs and gradients (after each step)."""
        self.inputs.clear()
        self.grads.clear()
        self.call_pass.clear()
        self.pass_rows = []
        self.edges, self._edge_owners = [], []
        self._waiting.clear()
        self._forgotten.clear()
        for handle in self._parameter_handles:
            handle.remove()
        self._parameter_handles, self.parameter_grads = [], None

    def capture_parameter_grads(self, params: Mapping[str, torch.Tensor]) -> None:
        """Also records each parameter's whole gradient in the coming backward passes.

        :func:`unclipped_mismatch` compares it with the layers' unclipped sums, which
        reveals a parameter used outside its layer's ``forward``.
        """
        if self.parameter_grads is not None:
            return
        captured: dict[str, torch.Tensor] = {}

        def hook(name: str) -> Callable[[torch.Tensor], None]:
            def store(grad: torch.Tensor) -> None:
                previous = captured.get(name)
                captured[name] = grad.detach() if previous is None else previous + grad.detach()

            return store

        self.parameter_grads = captured
        self._parameter_handles = [p.register_hook(hook(name)) for name, p in params.items()]

    def begin_pass(self, rows: int, *, same_examples: bool = False) -> None:
        """Marks the start of a forward pass over ``rows`` rows (calls are tagged with it).

        With ``same_examples`` the pass continues the previous one: its rows are the same
        examples (a second loss on the same batch), and a layer's calls in both are summed
        per row, as for a layer called twice in one pass.
        """
        if same_examples and self.pass_rows:
            if self.pass_rows[-1] != rows:
                raise DPVisionError(
                    f"a pass over the same examples has {rows} rows, the previous one "
                    f"{self.pass_rows[-1]}"
                )
            return
        self.pass_rows.append(rows)

    def gradient_passes(self) -> list[int]:
        """The passes (indices into ``pass_rows``) whose layer calls received gradients."""
        return sorted({self.call_pass[m][i] for m, grads in self.grads.items() for i in grads})

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is recorded in the ``with`` block (an evaluation pass)."""
        self._paused, before = True, self._paused
        try:
            yield
        finally:
            self._paused = before

    def _recording(self) -> bool:
        return not self._paused and torch.is_grad_enabled()

    def _new_call(self, module: nn.Module, record: Any) -> int:
        index = len(self.inputs[module])
        self.inputs[module].append(record)
        self.call_pass[module].append(len(self.pass_rows) - 1)
        return index

    def _watch(self, module: nn.Module, index: int, slot: int, tensor: torch.Tensor) -> None:
        """Arranges for the gradient of ``tensor`` to land in ``grads[module][index][slot]``."""
        if self.mode == "edges":
            self.edges.append(get_gradient_edge(tensor))
            self._edge_owners.append((module, index, slot))
            self._waiting[module] += 1
            # Fires with the gradient of this very output (also if it is changed in place
            # later), also when the output is one of autograd.grad's inputs.
            tensor.register_hook(lambda grad: self._arrived(module, index, slot, grad))  # type: ignore[no-untyped-call]
        else:
            tensor.register_hook(lambda grad: self._store(module, index, slot, grad))  # type: ignore[no-untyped-call]

    def _record(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if not self._recording():
            return
        if self.kinds[module] == "layer":
            if not (isinstance(output, torch.Tensor) and output.requires_grad):
                return
            given = args[0] if args else kwargs.get("input")
            record = None
            if isinstance(given, torch.Tensor):
                record = (given.detach(), given._version)
                if module in self.with_outputs:
                    record += (output.detach(), output._version)
            self._watch(module, self._new_call(module, record), 0, output)
            return
        outputs = output_tensors(output)
        slots = [slot for slot, tensor in enumerate(outputs) if tensor.requires_grad]
        if slots:
            record = (_detached(args), _detached(kwargs), _versions((args, kwargs)))
            index = self._new_call(module, record)
            for slot in slots:
                self._watch(module, index, slot, outputs[slot])

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before an owner of free parameters runs: substitute them where they meet rows."""
        given = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if not self._recording() or given is None or given.dim() == 0:
            self._active[module].append(None)
            return
        params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        taps: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = []
        index = self._new_call(module, taps)

        def on_tap(name: str, per_row: torch.Tensor, back: Any) -> None:
            taps.append((name, back))
            self._watch(module, index, len(taps) - 1, per_row)

        mode = ParameterTaps(params, given.shape[0], on_tap)
        mode.__enter__()
        self._active[module].append(mode)

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        active = self._active[module]
        mode = active.pop() if active else None
        if mode is not None:
            mode.__exit__(None, None, None)

    def _store(self, module: nn.Module, index: int, slot: int, grad: torch.Tensor) -> None:
        # Several backward passes through one call (retain_graph) add up, as in .grad.
        slots = self.grads[module].setdefault(index, {})
        previous = slots.get(slot)
        grad = grad.detach()
        slots[slot] = grad if previous is None else previous + grad

    def _arrived(self, module: nn.Module, index: int, slot: int, grad: torch.Tensor) -> None:
        """Edges mode: a watched output's gradient, during the backward pass."""
        if module in self._forgotten:
            return
        slots = self.grads[module].setdefault(index, {})
        if slot not in slots:
            self._waiting[module] -= 1
        slots[slot] = grad.detach()
        if self._waiting[module] == 0 and self.on_ready is not None:
            self.on_ready(module)

    def forget(self, module: nn.Module) -> None:
        """Drops what was recorded of ``module``'s calls (its terms were computed)."""
        self._forgotten.add(module)
        self.inputs.pop(module, None)
        self.grads.pop(module, None)

    def set_edge_grads(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Stores the result of ``torch.autograd.grad(loss, self.edges, allow_unused=True)``."""
        for (module, index, slot), grad in zip(self._edge_owners, grads, strict=True):
            if grad is not None and module not in self._forgotten:
                self.grads[module].setdefault(index, {})[slot] = grad.detach()

    def calls(self) -> Iterator[tuple[str, nn.Module, list[Call]]]:
        """(path, module, calls) for each claimed module with a gradient (and not forgotten).

        A call is ``(input, output gradient)`` for a layer (``((input, output or None),
        output gradient)`` if its rule reads the output), ``((args, kwargs), {slot:
        output gradient})`` for a unit and ``(taps, gradients)`` for free parameters.

        Raises:
          UnsupportedError: a layer's input was not a tensor, or was modified in place after
            the layer used it (its recorded activation would be wrong).
        """
        for path, module in self.layers:
            pairs = self.calls_of(path, module)
            if pairs:
                yield path, module, pairs

    def calls_of(self, path: str, module: nn.Module) -> list[Call]:
        """The calls of one module (see :meth:`calls`; raises the same errors)."""
        inputs, grads = self.inputs.get(module, []), self.grads.get(module, {})
        kind, where = self.kinds[module], path or "the root"
        pairs: list[Call] = []
        for index, slots in sorted(grads.items()):
            record = inputs[index]
            if kind == "free":
                pairs.append((record, tuple(slots.get(i) for i in range(len(record)))))
                continue
            if record is None:
                raise UnsupportedError(f"a call of {where} without an input tensor")
            if kind == "layer":
                if record[0]._version != record[1]:
                    raise UnsupportedError(f"an input of {where} modified in place after use")
                if module in self.with_outputs:  # an output changed in place is not given
                    kept = record[2] if record[2]._version == record[3] else None
                    pairs.append(((record[0], kept), slots[0]))
                else:
                    pairs.append((record[0], slots[0]))
                continue
            args, kwargs, versions = record
            if any(tensor._version != version for tensor, version in versions):
                raise UnsupportedError(f"an input of {where} modified in place after use")
            pairs.append(((args, kwargs), slots))
        return pairs

    def rows(self, module: nn.Module, call: Call) -> list[int]:
        """The leading dimensions of a call's per-row tensors (all must be the batch's)."""
        kind = self.kinds[module]
        if kind == "layer":
            given = call[0][0] if module in self.with_outputs else call[0]
            return [given.shape[0], call[1].shape[0]]
        grads = call[1].values() if kind == "unit" else call[1]
        return [g.shape[0] for g in grads if g is not None]

    @contextmanager
    def attached(self) -> Iterator["ActivationTape"]:
        """Attaches the hooks for the ``with`` block and always removes them afterwards."""
        self.attach()
        try:
            yield self
        finally:
            self.detach()
