"""Free parameters: trainable tensors a container module uses directly in its ``forward``
(a class token, position embeddings, a layer scale), not through a layer.

Such a parameter reaches the examples by being broadcast against them: ``cls.expand(N, -1,
-1)``, ``x + pos_embed``, ``x * gamma``. While its owner's ``forward`` runs,
:class:`ParameterTaps` (a ``TorchFunctionMode``) watches the operations that take the
parameter, and at the one that broadcasts it against the N rows it substitutes the
parameter by ``p.expand(N, …)``: a tensor with one copy of p per row, equal in value, whose
gradient is the per-row gradient of p. Reshapes, dtype casts and slices of the parameter
before that point are followed. Any other use is refused with a message (its per-example
gradient would be unknown), and the whole-gradient check of book-keeping would catch one
that slipped through.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dpvision.per_example.layers.base import SmallRowsTerms, UnsupportedError

Tensor = torch.Tensor

# Operations that broadcast their operands elementwise (the parameter may be either one).
_ELEMENTWISE = {
    *(getattr(Tensor, f"__{op}__") for op in ("add", "radd", "sub", "rsub", "mul", "rmul")),
    *(getattr(Tensor, f"__{op}__") for op in ("truediv", "rtruediv")),
    Tensor.add,
    Tensor.sub,
    Tensor.mul,
    Tensor.div,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
}
_EXPAND = {Tensor.expand, Tensor.expand_as, Tensor.broadcast_to, torch.broadcast_to}
# Operations whose result is the parameter's values in another shape or dtype.
_RESHAPE = {
    Tensor.reshape,
    Tensor.view,
    Tensor.unsqueeze,
    Tensor.squeeze,
    Tensor.flatten,
    Tensor.to,
    Tensor.type_as,
    Tensor.contiguous,
    Tensor.float,
    Tensor.double,
    Tensor.half,
    Tensor.bfloat16,
    torch.reshape,
    torch.unsqueeze,
    torch.squeeze,
    torch.flatten,
}

# grad (N, *alias shape) → grad (N, *parameter shape)
Back = Callable[[Tensor], Tensor]
# Called with (parameter name, the per-row tensor standing in for it, its Back).
OnTap = Callable[[str, Tensor, Back], None]


def _identity(grad: Tensor) -> Tensor:
    return grad


class ParameterTaps(TorchFunctionMode):
    """Substitutes per-row copies for free parameters where they meet the examples.

    Args:
      params: local name → parameter, the owner's own free parameters.
      rows: N, the rows of the owner's input (B·K).
      on_tap: told of every substitution, so that its gradient can be captured.
    """

    def __init__(self, params: dict[str, Tensor], rows: int, on_tap: OnTap) -> None:
        super().__init__()
        self.rows, self.on_tap = rows, on_tap
        # id → (name, the tensor (kept alive so its id stays unique), grad mapping)
        self.tracked: dict[int, tuple[str, Tensor, Back]] = {
            id(p): (name, p, _identity) for name, p in params.items()
        }

    def _find(self, value: Any) -> tuple[str, Tensor, Back] | None:
        return self.tracked.get(id(value)) if isinstance(value, Tensor) else None

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        flat += [v for a in args if isinstance(a, list | tuple) for v in a]
        hits = [i for i, v in enumerate(flat) if self._find(v) is not None]
        if not hits:
            return func(*args, **kwargs)
        if func in _EXPAND and hits == [0]:
            return self._expand(func, args, kwargs)
        if func in _ELEMENTWISE and len(hits) == 1 and hits[0] < 2 and len(args) >= 2:
            if hits == [0] and isinstance(args[1], int | float):
                return self._scaled(func, args, kwargs)
            return self._elementwise(func, args, kwargs, hits[0])
        out = func(*args, **kwargs)
        if not isinstance(out, Tensor):  # .shape, .dim(), .numel(): nothing flows
            return out
        name, tensor, back = self._find(flat[hits[0]])  # type: ignore[misc]
        if func in _RESHAPE and hits == [0] and out.numel() == tensor.numel():
            shape = tensor.shape
            self.tracked[id(out)] = (name, out, lambda g: back(g.reshape(g.shape[0], *shape)))
            return out
        if func is Tensor.__getitem__ and hits == [0]:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            like = tensor

            def scatter(g: Tensor) -> Tensor:
                whole = g.new_zeros(g.shape[0], *like.shape)
                whole[(slice(None), *index)] = g
                return back(whole)

            self.tracked[id(out)] = (name, out, scatter)
            return out
        raise UnsupportedError(
            f"the free parameter {name} used by {getattr(func, '__name__', func)} (a free "
            "parameter is followed through reshapes, slices, expand and elementwise "
            "arithmetic with the batch; give it a layer of its own otherwise)"
        )

    def _scaled(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``p + s``, ``p * s``, ``s - p``, ``p / s`` with a number s: the result is p's values
        times a constant (plus one), so it is followed like a reshape of p."""
        op = getattr(func, "__name__", "").strip("_")
        scalar = float(args[1])
        factors = {"add": 1.0, "radd": 1.0, "sub": 1.0, "rsub": -1.0, "mul": scalar}
        factors |= {"rmul": scalar, "truediv": 1 / scalar if scalar else None}
        factors["div"] = factors["truediv"]
        factor = factors.get(op)
        if factor is None or kwargs.get("rounding_mode") is not None:
            return self._refuse(args[0], func)
        name, _, back = self._find(args[0])  # type: ignore[misc]
        out = func(*args, **kwargs)
        self.tracked[id(out)] = (name, out, lambda g: back(g * factor))
        return out

    def _substitute(self, value: Tensor, aligned: tuple[int, ...]) -> Tensor:
        """The per-row stand-in for ``value`` broadcast as ``aligned`` (rank of the batch)."""
        name, tensor, back = self._find(value)  # type: ignore[misc]
        shape = tensor.shape
        per_row = tensor.reshape(aligned).expand(self.rows, *aligned[1:])
        self.on_tap(name, per_row, lambda g: back(g.reshape(g.shape[0], *shape)))
        return per_row

    def _aligned(self, value: Tensor, rank: int) -> tuple[int, ...] | None:
        if value.dim() > rank:
            return None
        aligned = (1,) * (rank - value.dim()) + tuple(value.shape)
        return aligned if aligned[0] == 1 else None

    def _expand(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        value = args[0]
        if func is Tensor.expand_as:
            size = tuple(args[1].shape)
        else:
            given = args[1:] or (kwargs.get("size"),)
            size = tuple(given[0]) if isinstance(given[0], tuple | list | torch.Size) else given
        aligned = self._aligned(value, len(size))
        if aligned is None or size[0] != self.rows:
            return self._refuse(value, func)
        return func(self._substitute(value, aligned), *args[1:], **kwargs)

    def _elementwise(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], position: int
    ) -> Any:
        value, other = args[position], args[1 - position]
        if not (isinstance(other, Tensor) and other.dim() and other.shape[0] == self.rows):
            return self._refuse(value, func)
        aligned = self._aligned(value, other.dim())
        if aligned is None:
            return self._refuse(value, func)
        changed = list(args)
        changed[position] = self._substitute(value, aligned)
        return func(*changed, **kwargs)

    def _refuse(self, value: Tensor, func: Any) -> Any:
        name = self._find(value)[0]  # type: ignore[index]
        raise UnsupportedError(
            f"the free parameter {name} in {getattr(func, '__name__', func)} is not broadcast "
            f"against the {self.rows} rows of the batch (first dimension), so its per-example "
            "gradient is unknown"
        )


class FreeParameterTerms(SmallRowsTerms):
    """Free parameters: per-row gradients of the stand-ins :class:`ParameterTaps` made.

    A call is ``(taps, grads)``: the (name, Back) of each substitution and its gradient.
    """

    def parts(self, module: nn.Module, x: Any, g: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for (name, back), grad in zip(x, g, strict=True):
            if grad is None:
                continue
            rows = back(grad)
            out[name] = out[name] + rows if name in out else rows
        return out
