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
from dpvision.per_example.layers import Call


class UnsupportedError(DPVisionError):
    """The model or the loss cannot go through book-keeping (the message says why)."""


def tracked_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (path, module)
        for path, module in model.named_modules()
        if any(p.requires_grad for p in module.parameters(recurse=False))
    ]


class ActivationTape:
    """Forward hooks that record each tracked layer's inputs and its output-gradient source.

    In ``edges`` mode the tape keeps the autograd edge of every output, for
    ``torch.autograd.grad(loss, tape.edges)`` (in-place changes of an output later in the
    forward pass do not disturb it). In ``hooks`` mode it registers a tensor hook on every
    output, so that an ordinary ``loss.backward()`` delivers the output gradients (this is
    what :class:`~dpvision.privacy_engine.PrivacyEngine` uses). Calls made without autograd
    (``torch.no_grad()``, evaluation) are not recorded.

    Args:
      model: the model whose layers to watch; layers with trainable parameters of their
        own are tracked.
      mode: ``"edges"`` or ``"hooks"``.
    """

    def __init__(self, model: nn.Module, mode: str = "edges") -> None:
        if mode not in ("edges", "hooks"):
            raise ValueError(f"mode must be 'edges' or 'hooks', got {mode!r}")
        self.mode = mode
        self.layers = tracked_layers(model)
        # (input, its version counter at the call) per call; None when no input tensor came.
        self.inputs: dict[nn.Module, list[tuple[torch.Tensor, int] | None]] = defaultdict(list)
        # The forward pass each call belongs to (see begin_pass), and each pass's rows.
        self.call_pass: dict[nn.Module, list[int]] = defaultdict(list)
        self.pass_rows: list[int] = []
        self.grads: dict[nn.Module, dict[int, torch.Tensor]] = defaultdict(dict)
        self.edges: list[GradientEdge] = []
        self._edge_owners: list[tuple[nn.Module, int]] = []
        self._handles: list[Any] = []
        self._paused = False
        # Whole gradients of the parameters, captured on passes that verify book-keeping.
        self.parameter_grads: dict[str, torch.Tensor] | None = None
        self._parameter_handles: list[Any] = []

    def attach(self) -> None:
        """Registers the forward hooks (idempotent)."""
        if not self._handles:
            self._handles = [
                m.register_forward_hook(self._record, with_kwargs=True) for _, m in self.layers
            ]

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

    def _record(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if self._paused or not (torch.is_grad_enabled() and isinstance(output, torch.Tensor)):
            return
        if not output.requires_grad:
            return
        given = args[0] if args else kwargs.get("input")
        index = len(self.inputs[module])
        self.inputs[module].append(
            (given.detach(), given._version) if isinstance(given, torch.Tensor) else None
        )
        self.call_pass[module].append(len(self.pass_rows) - 1)
        if self.mode == "edges":
            self.edges.append(get_gradient_edge(output))
            self._edge_owners.append((module, index))
        else:
            output.register_hook(lambda grad: self._store(module, index, grad))  # type: ignore[no-untyped-call]

    def _store(self, module: nn.Module, index: int, grad: torch.Tensor) -> None:
        # Several backward passes through one call (retain_graph) add up, as in .grad.
        previous = self.grads[module].get(index)
        grad = grad.detach()
        self.grads[module][index] = grad if previous is None else previous + grad

    def set_edge_grads(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Stores the result of ``torch.autograd.grad(loss, self.edges, allow_unused=True)``."""
        for (module, index), grad in zip(self._edge_owners, grads, strict=True):
            if grad is not None:
                self.grads[module][index] = grad.detach()

    def calls(self) -> Iterator[tuple[str, nn.Module, list[Call]]]:
        """(path, layer, [(input, output gradient), ...]) for each layer with a gradient.

        Raises:
          DPVisionError: a layer's input was not a tensor, or was modified in place after
            the layer used it (its recorded activation would be wrong).
        """
        for path, module in self.layers:
            inputs, grads = self.inputs.get(module, []), self.grads.get(module, {})
            pairs = []
            for index, grad in sorted(grads.items()):
                record = inputs[index]
                where = path or "the root"
                if record is None:
                    raise UnsupportedError(f"a call of {where} without an input tensor")
                if record[0]._version != record[1]:
                    raise UnsupportedError(f"an input of {where} modified in place after use")
                pairs.append((record[0], grad))
            if pairs:
                yield path, module, pairs

    @contextmanager
    def attached(self) -> Iterator["ActivationTape"]:
        """Attaches the hooks for the ``with`` block and always removes them afterwards."""
        self.attach()
        try:
            yield self
        finally:
            self.detach()
