"""Buffers and tensor attributes written by a private forward pass are refused:
:class:`BufferWatch`.

A module's buffers are part of its ``state_dict``, which is published with the model, and
later forward passes read them. A buffer that a forward pass over private examples writes
(BatchNorm's running statistics in training mode; an activation-range observer of
quantisation-aware training that keeps the largest input it saw) therefore holds an
exact, noiseless statistic of the private batch, and through it one example moves the
outputs, hence the gradients, of the examples of later steps. Neither is covered by the
clipped sum's sensitivity: DP-SGD's guarantee assumes that everything the model carries
from step to step is a noisy release. The DP-SGD step (:class:`~dpvision.training.DPSGDStep`)
and the :class:`~dpvision.privacy_engine.PrivacyEngine`'s private module watch the buffers
with a :class:`BufferWatch` and refuse such a write in one line. Buffers that are only read
(frozen BatchNorm, a fixed mask or position table) pass.

How a write is noticed: before the pass the buffers are concatenated, one flat copy per
dtype and device, and after it they are compared bit for bit (NaN equal to NaN). That is a
handful of kernels and one synchronisation per dtype, whatever the number of buffers, and
it sees every kind of write: in place (``copy_``, ``out=``, ``clamp_``), by reassignment
(``module.buf = new``), through ``tensor.data``, or inside a native kernel (BatchNorm's
update of its running statistics does not move the tensors' version counters). A write
that leaves a buffer bit for bit as it was changes nothing that is published and passes
(the layout probe of :mod:`dpvision.per_example.batch_layout` writes back the buffers its
own passes may have moved).

State kept outside the registered buffers carries a batch statistic into later steps just
as well: a plain tensor attribute (a forgotten ``register_buffer``: ``self.running =
x.mean(0)``), or tensors in a list, tuple or dict held as an attribute. The watch therefore
also takes every tensor (and NumPy array) reachable from the attributes of the model and of
its submodules, through lists, tuples and dicts up to :data:`DEPTH` levels deep, and
through modules held outside the module tree; torch's own bookkeeping of a module (its
parameter, buffer, submodule and hook dictionaries) is not an attribute of the model, and
parameters and registered buffers are watched as above. Such a tensor changed during the
pass, or a new one, is refused in one line that names the attribute (never a value or a
dictionary key); tensors set in ``__init__`` and only read, or set again to the same values
(a cache that does not depend on the data), pass. Other Python values an attribute holds
(numbers, strings, objects of other classes) are not watched.

>>> import torch
>>> from torch import nn
>>> class Observer(nn.Module):
...     def __init__(self) -> None:
...         super().__init__()
...         self.register_buffer("max_seen", torch.tensor(float("-inf")))
...     def forward(self, x: torch.Tensor) -> torch.Tensor:
...         self.max_seen.clamp_(min=float(x.detach().max()))  # an exact batch statistic
...         return x
>>> watch = BufferWatch(nn.Sequential(nn.Linear(2, 2), Observer()))
>>> watch.start()
>>> _ = watch.model(torch.ones(3, 2))
>>> watch.check()  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
dpvision.errors.DPVisionError: buffer '1.max_seen' of the model changed during a private ...
"""

from typing import Any

import numpy as np
import torch
from torch import nn

from dpvision.errors import DPVisionError

__all__ = ["DEPTH", "BufferWatch"]

_Group = tuple[torch.dtype, torch.device]
DEPTH = 4  # an attribute, then up to three levels of lists, tuples and dicts
# torch's own bookkeeping of every module (parameters, buffers, submodules, hooks).
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _layout(buffers: list[tuple[str, torch.Tensor]]) -> list[tuple[str, _Group, torch.Size]]:
    return [(name, (t.dtype, t.device), t.shape) for name, t in buffers]


@torch.no_grad()
def _flatten(buffers: list[tuple[str, torch.Tensor]]) -> dict[_Group, torch.Tensor]:
    """All buffers of each (dtype, device), concatenated into one new flat tensor."""
    groups: dict[_Group, list[torch.Tensor]] = {}
    for _, tensor in buffers:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor.reshape(-1))
    return {key: torch.cat(parts) for key, parts in groups.items()}


@torch.no_grad()
def _identical(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Bit-for-bit the same values (NaN where NaN) and shape."""
    if before.shape != after.shape:
        return False
    same = before == after
    if before.is_floating_point() or before.is_complex():
        same |= before.isnan() & after.isnan()
    return bool(same.all())


def _watched(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers and the frozen parameters (``requires_grad=False``): what a forward pass
    must not write (a trainable parameter changes only through the noisy update)."""
    frozen = [(n, p.detach()) for n, p in model.named_parameters() if not p.requires_grad]
    return [*model.named_buffers(), *frozen]


class _Attributes:
    """The tensors and arrays held by the attributes of ``model``'s modules (see the module
    docstring), each under a key (its attribute's path and its place in the containers)
    and the name of its attribute (what a message may show)."""

    def __init__(self, model: nn.Module) -> None:
        self._modules = {id(m) for m in model.modules()}
        self._seen = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
        self.tensors: list[tuple[str, torch.Tensor]] = []  # strided values, compared flat
        self.others: list[tuple[str, Any]] = []  # arrays, and tensors whose values are opaque
        self.names: dict[str, str] = {}
        for prefix, module in model.named_modules():
            for attr, value in vars(module).items():
                if attr not in _MODULE_INTERNALS:
                    name = f"{prefix}.{attr}" if prefix else attr
                    self._value(name, name, value, 0)

    def _outside(self, name: str, key: str, module: nn.Module, depth: int) -> None:
        """A module held outside the module tree (in a plain list, say): everything it
        holds, its parameters and buffers too, is named by the attribute that holds it."""
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                for index, item in enumerate(value.values()):
                    self._value(name, f"{key}.{attr}[{index}]", item, depth + 1)
            elif attr not in _MODULE_INTERNALS:
                self._value(name, f"{key}.{attr}", value, depth + 1)

    def _value(self, name: str, key: str, value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor | np.ndarray):
            if id(value) in self._seen:
                return
            self._seen.add(id(value))
            self.names[key] = name
            if isinstance(value, torch.Tensor) and _readable(value):
                self.tensors.append((key, value.detach()))
            else:
                self.others.append((key, _fingerprint(value)))
        elif depth + 1 >= DEPTH:
            return
        elif isinstance(value, nn.Module):
            if id(value) not in self._modules:
                self._modules.add(id(value))
                self._outside(name, key, value, depth)
        elif isinstance(value, dict):
            for index, item in enumerate(value.values()):
                self._value(name, f"{key}[{index}]", item, depth + 1)
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                self._value(name, f"{key}[{index}]", item, depth + 1)


def _readable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values can be copied and compared flat (not sparse, meta,
    quantized, nested, or a tensor of a function transform that escaped it)."""
    return (
        tensor.layout == torch.strided
        and not tensor.is_meta
        and not tensor.is_quantized
        and not tensor.is_nested
        and not torch._C._functorch.is_functorch_wrapped_tensor(tensor)
    )


def _fingerprint(value: torch.Tensor | np.ndarray) -> tuple[Any, ...]:
    """What stands for a value that is not compared flat: an array's bytes, or an opaque
    tensor's identity and version counter (a write that keeps both is not seen)."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    return ("tensor", value, value._version)


def _same_fingerprint(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    if before[0] != after[0] or len(before) != len(after):
        return False
    if before[0] == "tensor":
        return before[1] is after[1] and before[2] == after[2]
    return before[1:] == after[1:]


class BufferWatch:
    """Refuses writes to a module's buffers between :meth:`start` and :meth:`check`.

    Call :meth:`start` before a private pass (forward and backward over private examples)
    and :meth:`check` after it. Between passes anything may change the buffers (loading a
    checkpoint, the caller's own code): :meth:`start` takes them as they are.

    Args:
      model: the module whose buffers (all of them, persistent or not) and frozen
        parameters are watched.
      what: how the error names ``model`` (``"the model"``, ``"the module"``).

    Privacy:
      Releases nothing. From :meth:`start` on it holds a flat copy of the buffers (as
      private as the model; as large as the buffers).
    """

    def __init__(self, model: nn.Module, *, what: str = "the model") -> None:
        self.model, self.what = model, what
        self._layout: list[tuple[str, _Group, torch.Size]] = []
        self._before: dict[_Group, torch.Tensor] = {}

    def start(self) -> None:
        """Remembers the buffers as they are now."""
        buffers = _watched(self.model)
        self._layout, self._before = _layout(buffers), _flatten(buffers)

    def check(self) -> None:
        """Raises if a buffer was written since :meth:`start` (a new buffer counts; one
        removed does not: it publishes nothing).

        Raises:
          DPVisionError: one line naming the first buffer that changed and the fixes.
        """
        buffers = _watched(self.model)
        if _layout(buffers) == self._layout:
            after = _flatten(buffers)
            if all(_identical(self._before[key], flat) for key, flat in after.items()):
                return
        name = self._changed(buffers)
        if name is not None:
            kind = "buffer" if name in dict(self.model.named_buffers()) else "frozen parameter"
            raise DPVisionError(
                f"{kind} {name!r} of {self.what} changed during a private forward pass: it "
                "would keep an exact statistic of the private batch (published with the "
                "model, read by later steps); freeze it (module.eval(), freeze_batchnorm), "
                "compute it without a buffer, or replace the module (BatchNorm -> GroupNorm)"
            )

    def _changed(self, buffers: list[tuple[str, torch.Tensor]]) -> str | None:
        """The first buffer that is new or not bit for bit as at :meth:`start`."""
        before: dict[str, torch.Tensor] = {}
        offsets = dict.fromkeys(self._before, 0)
        for name, key, shape in self._layout:
            size = shape.numel()
            before[name] = self._before[key][offsets[key] : offsets[key] + size].view(shape)
            offsets[key] += size
        for name, tensor in buffers:
            old = before.get(name)
            if old is None or (old.dtype, old.device) != (tensor.dtype, tensor.device):
                return name
            if not _identical(old, tensor.detach()):
                return name
        return None
