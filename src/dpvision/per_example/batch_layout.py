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

"Changed" means more than rounding can explain (:func:`rounding_tolerance`). The same row
computed twice from the same inputs differs only where a kernel summed in another order
(another algorithm, blocking or thread split); each sum of n terms in unit roundoff u is
then within λ√n·u·Σ|terms| of the exact value with probability ≥ 1 − 2·exp(−λ²/2) (the
probabilistic bound of Higham and Mary, 2019), so two evaluations are within twice that.
The tolerance takes it per row, with Σ|terms| bounded by the row's largest value, n by the
elements per row of the tensors computed on the way, and u of the least precise arithmetic
in force (the dtypes, autocast, TF32 or bf16 float32 products), with λ = 8 (≈ 10⁻¹⁴ per
value). The probe itself runs in IEEE float32 arithmetic with autocast off: the layout of a
computation does not depend on its precision, and its rounding is then far below what it
must detect. Mixing is not rounding: the changed example moves other rows by a share of its
own change, a fixed fraction, however many values a row has.

Privacy:
  Releases nothing; it decides whether book-keeping may be used, from the layout of the
  computation (the same for any data of the same shapes).
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.per_example.layers.base import output_tensors
from dpvision.per_example.precision import autocast_enabled, exact_arithmetic, float32_roundoff

# λ of the probabilistic rounding bound (module docstring): a false alarm per value has
# probability below 2·exp(−32) ≈ 2.5e-14.
ROUNDING_MARGIN = 8.0
# The unit roundoff of IEEE float32: at or below it, no lower precision is in force.
EXACT_ROUNDOFF = 2.0**-24


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


@contextmanager
def probe_arithmetic(model: nn.Module, device: torch.device) -> Iterator[None]:
    """IEEE float32 products and convolutions, and autocast off unless the model has
    floating parameters below float32 (which run only under it): the precision in which a
    probe compares rows."""
    low = any(p.is_floating_point() and p.element_size() < 4 for p in model.parameters())
    with exact_arithmetic(device, keep_autocast=low):
        yield


def roundoff(model: nn.Module, device: torch.device, *tensors: torch.Tensor) -> float:
    """The unit roundoff u of the least precise arithmetic that may compute ``model`` on
    ``device`` here: its floating parameters' and ``tensors``' dtypes, autocast's dtype
    when it is on, and float32 products in TF32 or bfloat16 where the settings allow it.

    A model with floating parameters below float32 cannot be probed in float32, and its
    own rounding (2⁻⁸ relative for bfloat16) would hide mixing of a few percent: it gets
    float32's u, so its rows must come out the same in both passes, as they do on
    deterministic kernels (on one that sums in another order between calls it is refused:
    keep the parameters in float32 and train under autocast).
    """
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if any(torch.finfo(d).bits < 32 for d in floating):
        return EXACT_ROUNDOFF
    dtypes = {*floating, *(t.dtype for t in (*model.buffers(), *tensors))}
    if autocast_enabled(device):
        dtypes.add(torch.get_autocast_dtype(device.type))
    units = [
        float32_roundoff(device) if d == torch.float32 else torch.finfo(d).eps / 2
        for d in dtypes
        if d.is_floating_point
    ]
    return max(units, default=float32_roundoff(device))


def rounding_tolerance(unit: float, length: int) -> float:
    """How far two evaluations of one value may differ by summation order alone, relative to
    the largest value of its row: 2λ√n·u (module docstring), for ``length`` = n operations
    on the way and unit roundoff ``unit`` = u."""
    return 2 * ROUNDING_MARGIN * math.sqrt(max(1, length)) * unit


def row_length(tensor: torch.Tensor) -> int:
    """The values per row of a tensor (rows first)."""
    return int(tensor[0].numel()) if tensor.dim() and tensor.shape[0] else 1


def mixed_rows(
    before: torch.Tensor,
    after: torch.Tensor,
    views: int,
    examples: int | list[int] = 0,
    *,
    unit: float,
    length: int,
) -> bool:
    """Whether rows other than those of ``examples`` changed beyond rounding (a row that
    became NaN or infinite changed): by more than :func:`rounding_tolerance` (``unit``,
    ``length``; :func:`roundoff` gives ``unit``) times the row's largest finite value."""
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    for example in [examples] if isinstance(examples, int) else examples:
        keep[example * views : (example + 1) * views] = False
    b = before[keep].to(torch.float64)
    a = after[keep].to(torch.float64).to(b.device)
    if b.numel() == 0:
        return False
    same = (a == b) | (a.isnan() & b.isnan())
    tiny = torch.finfo(before.dtype).tiny if before.is_floating_point() else 0.0
    flat_b, flat_a = b.reshape(b.shape[0], -1), a.reshape(a.shape[0], -1)
    sizes = torch.maximum(
        torch.nan_to_num(flat_b.abs(), nan=0.0, posinf=0.0).amax(1),
        torch.nan_to_num(flat_a.abs(), nan=0.0, posinf=0.0).amax(1),
    )
    allowed = rounding_tolerance(unit, length) * sizes + tiny
    close = (flat_a - flat_b).abs() <= allowed[:, None]
    return not bool((same.reshape_as(close) | close).all())


def check_batch_layout(
    model: nn.Module,
    layers: list[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    views: int = 1,
) -> int:
    """Raises :class:`LayoutError` unless each layer's input rows are the examples' own;
    returns the values per row the pass computed (the n of :func:`rounding_tolerance`).

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
        return row_length(batch)  # one example: every row is its own
    changed = perturbed(batch, views)
    if changed is None:
        return row_length(batch)
    swapped_args = tuple(changed if a is batch else a for a in args)
    swapped_kwargs = {k: changed if v is batch else v for k, v in kwargs.items()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        with probe_arithmetic(model, batch.device):
            unit = roundoff(model, batch.device, batch)
            seen, out = _run(model, layers, args, kwargs, batch.device)
            seen2, out2 = _run(model, layers, swapped_args, swapped_kwargs, batch.device)
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    recorded = [t for tensors in seen.values() for t in tensors]
    length = sum(row_length(t) for t in (batch, *recorded, *out))
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
            if mixed_rows(before, after, views, unit=unit, length=length):
                raise LayoutError(
                    f"layer {where} mixes examples: its input rows change when another example "
                    "changes (a transposed (T, B, ...) input, or an operation across the batch "
                    "before it); keep the examples first and separate"
                )
    for before, after in zip(out, out2, strict=False):
        if (
            before.dim()
            and before.shape[0] == rows
            and mixed_rows(before, after, views, unit=unit, length=length)
        ):
            raise LayoutError(
                "the model's output mixes examples: a row changes when another example changes "
                "(an operation across the batch, like BatchNorm); per-example clipping needs "
                "every example's output to depend on that example alone"
            )
    return length
