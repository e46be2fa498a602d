"""Does every clipped layer see the examples first, one row each, without mixing them?

Book-keeping clipping reads example i's gradient from row i of each layer's input and output
gradient. That holds only when a layer's leading dimension *is* the batch: a model that folds
positions into the batch (``(B, T, d) → (B·T, d)``), runs a layer on a sequence-first tensor
(``x.transpose(0, 1)``) or mixes examples before a layer would have rows that are not
examples, and clipping rows would not bound any example's influence.

Row counts catch most of this at every step. What they cannot see (a transposed ``(T, B, d)``
input with T = B, a layer after an operation that mixes rows) this probe catches: it runs
the model twice without gradients, the second time with example 0 changed, and checks that
in every clipped layer's input, and in the model's output, only example 0's rows changed.
Both passes draw the same random numbers (dropout masks), and the model's buffers are
restored afterwards.

Privacy:
  Releases nothing; it decides whether book-keeping may be used, from the layout of the
  computation (the same for any data of the same shapes).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.per_example.layers.base import output_tensors


class LayoutError(DPVisionError):
    """A clipped layer does not see one row per example (the message says where and why)."""


def batch_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The first tensor argument of a forward call: the examples (rows first)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def signature(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What the probe's verdict depends on: shapes beyond the batch, dtypes, mode, trainables."""
    tensors = tuple(
        (tuple(v.shape[1:]), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
        for v in (*args, *kwargs.values())
    )
    trainable = tuple(name for name, p in model.named_parameters() if p.requires_grad)
    return tensors, model.training, trainable


def perturbed(
    batch: torch.Tensor, views: int, example: int = 0, strength: float = 1.0
) -> torch.Tensor | None:
    """The batch with one example (its ``views`` rows from ``example·views``) changed by
    about ``strength`` times its own size, or None if impossible."""
    changed = batch.clone()
    rows = slice(example * views, (example + 1) * views)
    if batch.is_floating_point() or batch.is_complex():
        generator = torch.Generator(device=batch.device).manual_seed(0)
        noise = torch.randn(
            changed[rows].shape, generator=generator, device=batch.device, dtype=batch.dtype
        )
        changed[rows] += noise * strength * (1 + batch[rows].abs())
    else:  # token ids and the like: take another example's values
        other = (example + 1) % max(1, batch.shape[0] // views)
        changed[rows] = batch[other * views : (other + 1) * views]
    return None if torch.equal(changed, batch) else changed


@contextmanager
def _recording(layers: list[tuple[str, nn.Module]]) -> Iterator[dict[str, list[torch.Tensor]]]:
    seen: dict[str, list[torch.Tensor]] = {path: [] for path, _ in layers}

    def hook(path: str) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            given = args[0] if args else kwargs.get("input")
            if isinstance(given, torch.Tensor):
                seen[path].append(given.detach().clone())

        return record

    handles = [m.register_forward_pre_hook(hook(path), with_kwargs=True) for path, m in layers]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _run(
    model: nn.Module,
    layers: list[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
) -> tuple[dict[str, list[torch.Tensor]], list[torch.Tensor]]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), _recording(layers) as seen:
        torch.manual_seed(0)
        if devices:
            torch.cuda.manual_seed(0)
        output = model(*args, **kwargs)
    return seen, [t.detach() for t in output_tensors(output)]


def mixed_rows(
    before: torch.Tensor, after: torch.Tensor, views: int, examples: int | list[int] = 0
) -> bool:
    """Whether rows other than those of ``examples`` changed (beyond rounding; a row that
    became NaN or infinite changed)."""
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    for example in [examples] if isinstance(examples, int) else examples:
        keep[example * views : (example + 1) * views] = False
    b = before[keep].to(torch.float64)
    a = after[keep].to(torch.float64).to(b.device)
    if b.numel() == 0:
        return False
    same = (a == b) | (a.isnan() & b.isnan())
    finite = b[torch.isfinite(b)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    close = (a - b).abs() <= 1e-6 * scale + 1e-30
    return not bool((same | close).all())


def check_batch_layout(
    model: nn.Module,
    layers: list[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    views: int = 1,
) -> None:
    """Raises :class:`LayoutError` unless each layer's input rows are the examples' own.

    Args:
      model: the model whose ``forward(*args, **kwargs)`` is probed (not modified: buffers
        are restored, the random generators forked).
      layers: (path, layer) of the layers whose per-example gradients are read from rows.
      args: the positional arguments of one forward call; its first tensor holds the
        examples, ``views`` consecutive rows per example.
      kwargs: the keyword arguments of that call.
      views: K, the rows of one example.
    """
    batch = batch_tensor(args, kwargs)
    if batch is None or batch.dim() == 0:
        raise LayoutError("the model's forward got no tensor of examples (rows first)")
    rows = batch.shape[0]
    if rows < 2 * views:
        return  # one example: every row is its own
    changed = perturbed(batch, views)
    if changed is None:
        return
    swapped_args = tuple(changed if a is batch else a for a in args)
    swapped_kwargs = {k: changed if v is batch else v for k, v in kwargs.items()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        seen, out = _run(model, layers, args, kwargs, batch.device)
        seen2, out2 = _run(model, layers, swapped_args, swapped_kwargs, batch.device)
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    for path, _ in layers:
        where = path or "the root"
        for before, after in zip(seen[path], seen2[path], strict=False):
            if before.dim() == 0 or before.shape[0] != rows:
                raise LayoutError(
                    f"layer {where} sees {tuple(before.shape)} for a batch of {rows} rows: it "
                    "folds positions into the batch or takes a tensor whose first dimension is "
                    "not the batch (e.g. x.transpose(0, 1)); keep the examples first in every "
                    "layer with trainable parameters"
                )
            if before.shape != after.shape:
                raise LayoutError(f"the input shape of layer {where} depends on the data")
            if mixed_rows(before, after, views):
                raise LayoutError(
                    f"layer {where} mixes examples: its input rows change when another example "
                    "changes (a transposed (T, B, ...) input, or an operation across the batch "
                    "before it); keep the examples first and separate"
                )
    for before, after in zip(out, out2, strict=False):
        if before.dim() and before.shape[0] == rows and mixed_rows(before, after, views):
            raise LayoutError(
                "the model's output mixes examples: a row changes when another example changes "
                "(an operation across the batch, like BatchNorm); per-example clipping needs "
                "every example's output to depend on that example alone"
            )
