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
(a cache that does not depend on the data), pass. A cache first filled in a private pass is
refused: nothing shows that it does not depend on the rows (fill it in ``__init__``, or by a
forward pass on public data before training). Other Python values an attribute holds
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
    and the name of its attribute (what a message may show).

    Privacy:
      Releases nothing. It holds references to the tensors (as private as the model) and
      the bytes of the arrays; names and keys come from the code (attribute names and
      positions, never a dictionary's keys or a value).
    """

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
        and not isinstance(tensor, nn.UninitializedParameter | nn.UninitializedBuffer)
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
    """Refuses writes to a module's buffers and tensor attributes between :meth:`start` and
    :meth:`check`.

    Call :meth:`start` before a private pass (forward and backward over private examples)
    and :meth:`check` after it. Between passes anything may change them (loading a
    checkpoint, the caller's own code): :meth:`start` takes them as they are.

    Args:
      model: the module whose buffers (all of them, persistent or not), frozen parameters
        and tensors held by attributes (see the module docstring) are watched.
      what: how the error names ``model`` (``"the model"``, ``"the module"``).

    Privacy:
      Releases nothing; its errors name a buffer or attribute, never a value. From
      :meth:`start` on it holds a flat copy of what it watches (as private as the model; as
      large as the buffers and the attributes' tensors).
    """

    def __init__(self, model: nn.Module, *, what: str = "the model") -> None:
        self.model, self.what = model, what
        self._layout: list[tuple[str, _Group, torch.Size]] = []
        self._before: dict[_Group, torch.Tensor] = {}
        self._others: dict[str, tuple[Any, ...]] = {}

    def start(self) -> None:
        """Remembers the buffers and the attributes' tensors as they are now."""
        watched, self._others, _ = self._watched()
        self._layout, self._before = _layout(watched), _flatten(watched)

    def check(self, *, during: str = "forward pass") -> None:
        """Raises if a buffer or an attribute's tensor was written since :meth:`start` (a new
        one counts; one removed does not: it publishes nothing). ``during``: what ran since,
        as the message says it.

        Raises:
          DPVisionError: one line naming the first buffer or attribute that changed and the
            fixes (names only, never a value).
        """
        watched, others, names = self._watched()
        if _layout(watched) == self._layout and self._same_others(others) is None:
            after = _flatten(watched)
            if all(_identical(self._before[key], flat) for key, flat in after.items()):
                return
        key = self._changed(watched)
        key = key if key is not None else self._same_others(others)
        if key is None:
            return
        if key in names:
            raise DPVisionError(
                f"attribute {names[key]!r} of {self.what} changed during a private {during}: "
                "a tensor kept outside the registered parameters and buffers would "
                "carry a statistic of the private batch into later steps; keep it a local "
                "variable of forward, or make constants and caches in __init__ (or by a pass "
                "on public data before training) and only read them"
            )
        kind = "buffer" if key in dict(self.model.named_buffers()) else "frozen parameter"
        raise DPVisionError(
            f"{kind} {key!r} of {self.what} changed during a private {during}: it "
            "would keep an exact statistic of the private batch (published with the "
            "model, read by later steps); freeze it (module.eval(), freeze_batchnorm), "
            "compute it without a buffer, or replace the module (BatchNorm -> GroupNorm)"
        )

    def _watched(
        self,
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, tuple[Any, ...]], dict[str, str]]:
        """The tensors compared flat (buffers, frozen parameters, then the attributes'
        tensors, whose keys start with ``@``), the fingerprints of the other values, and the
        attribute that names each attribute key."""
        attributes = _Attributes(self.model)
        names = {f"@{key}": name for key, name in attributes.names.items()}
        tensors = [(f"@{key}", tensor) for key, tensor in attributes.tensors]
        others = {f"@{key}": value for key, value in attributes.others}
        return [*_watched(self.model), *tensors], others, names

    def _same_others(self, others: dict[str, tuple[Any, ...]]) -> str | None:
        """The first value not compared flat that is new or not as at :meth:`start`."""
        for key, value in others.items():
            old = self._others.get(key)
            if old is None or not _same_fingerprint(old, value):
                return key
        return None

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
