"""The per-layer fallback: exact per-example gradients of one layer from ``torch.func``.

A layer with trainable parameters and no fast rule (and ``nn.MultiheadAttention``, whose
forward uses its parameters outside its children's ``forward``) is a *unit*: the tape records
each call whole (every argument, every output gradient), and this rule recomputes the layer
alone for each row, ``vmap(vjp(functional_call(layer, ...)))`` with that row's output
gradients. Only the layer is recomputed, not the model: one unknown layer costs about one
more forward and backward of itself.

Arguments whose first dimension is the number of rows are split per row (each row keeps a
batch dimension of 1); other arguments (an attention mask) are shared.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from dpvision.per_example.layers.base import (
    MATERIALISE_BYTES,
    SmallRowsTerms,
    UnsupportedError,
    output_tensors,
)


def _per_row(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows


def row_gradients(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], grads: dict[int, Any]
) -> dict[str, torch.Tensor]:
    """Per-row gradients (N, *shape) of ``module``'s trainable parameters, its whole
    subtree, for one call ``module(*args, **kwargs)`` whose output tensors (flattened in
    :func:`output_tensors` order) got the gradients ``grads`` (position → (N, ...))."""
    params = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}
    rows = next(iter(grads.values())).shape[0]
    positions = sorted(grads)
    arg_dims = tuple(0 if _per_row(a, rows) else None for a in args)
    kwarg_dims = {k: 0 if _per_row(v, rows) else None for k, v in kwargs.items()}

    def one_row(
        row_args: tuple[Any, ...], row_kwargs: dict[str, Any], row_grads: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        def lift(value: Any, dim: int | None) -> Any:
            return value.unsqueeze(0) if dim == 0 else value

        call_args = tuple(lift(a, d) for a, d in zip(row_args, arg_dims, strict=True))
        call_kwargs = {k: lift(v, kwarg_dims[k]) for k, v in row_kwargs.items()}

        def outputs(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            out = output_tensors(functional_call(module, p, call_args, call_kwargs))
            return tuple(out[i] for i in positions)

        _, pull = vjp(outputs, params)
        (grad,) = pull(tuple(g.unsqueeze(0) for g in row_grads))
        return dict(grad)

    per_row: Callable[..., dict[str, torch.Tensor]] = vmap(
        one_row, in_dims=(arg_dims, kwarg_dims, 0)
    )
    size = sum(p.numel() * p.element_size() for p in params.values())
    chunk = max(1, MATERIALISE_BYTES // 4 // max(1, size))
    row_grads = [grads[i] for i in positions]
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    for start in range(0, rows, chunk):
        sl = slice(start, start + chunk)
        chunk_args = tuple(a[sl] if d == 0 else a for a, d in zip(args, arg_dims, strict=True))
        chunk_kwargs = {k: v[sl] if kwarg_dims[k] == 0 else v for k, v in kwargs.items()}
        try:
            result = per_row(chunk_args, chunk_kwargs, [g[sl] for g in row_grads])
        except RuntimeError as error:
            first = str(error).splitlines()[0]
            raise UnsupportedError(
                f"{type(module).__name__}, whose per-example gradients torch.func could not "
                f"compute ({first})"
            ) from None
        for name, value in result.items():
            parts[name].append(value)
    return {name: torch.cat(values) for name, values in parts.items()}


class FunctionalTerms(SmallRowsTerms):
    """Any layer, through ``torch.func`` on the layer alone (materialised, B × p)."""

    def parts(self, module: nn.Module, x: Any, g: Any) -> dict[str, torch.Tensor]:
        args, kwargs = x
        return row_gradients(module, args, kwargs, g)
