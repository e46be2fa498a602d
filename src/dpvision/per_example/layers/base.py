"""What every per-layer rule provides, the registry of rules, and shared row helpers.

A rule turns the (input, output gradient) pairs a layer saw in one forward/backward pass into
per-example squared gradient norms and, given clipping factors, the clipped sum of its
parameters' gradients (:class:`LayerTerms`). Rules are registered per layer type
(:func:`register_rule`), as Opacus registers one grad sampler per layer type.
"""

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

from dpvision.errors import DPVisionError

# How a dense layer gets its norms: ``auto`` (the cheapest), ``ghost`` (Gram matrices of im2col
# rows), ``pixel`` (of input pixels, for one call of a convolution) or ``materialise``.
Strategy = Literal["auto", "ghost", "pixel", "materialise"]


class UnsupportedError(DPVisionError):
    """The model or the loss cannot go through book-keeping (the message says why)."""


# A layer's per-example gradients are materialised only while they fit in this many bytes.
MATERIALISE_BYTES = 1 << 30


# (layer input, gradient w.r.t. layer output); for unit rules and free parameters, what
# the tape recorded of the call (see dpvision.per_example.tape).
Call = tuple[Any, Any]


class LayerTerms(ABC):
    """One layer's per-example squared gradient norms, and the clipped sum they lead to.

    Attributes:
      sq_norms: (B,) squared L2 norms of the per-example gradients of all the layer's
        trainable parameters together.
      kind: the layer's type name (set by :func:`~dpvision.per_example.layers.layer_terms`;
        it names the layer's phases for ``torch.profiler``).
    """

    sq_norms: torch.Tensor
    kind: str = "layer"

    @abstractmethod
    def clipped_sum(
        self, scale: torch.Tensor, drop: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """Σᵢ scaleᵢ·gradᵢ per parameter (local names such as ``weight``).

        Args:
          scale: (B,) per-example factors cᵢ (zero for examples that must not count).
          drop: (B,) booleans of examples whose activations or gradients must be zeroed
            before the sum (so that NaN or inf cannot leak through 0·NaN), or None.
        """


def sum_calls(parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of per-call contributions (a layer called several times adds them up)."""
    total: torch.Tensor | None = None
    for part in parts:
        total = part if total is None else total + part
    assert total is not None
    return total


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, or tuples, lists and dicts of them), in a
    fixed order: the positions the tape numbers output gradients by."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for v in output.values() for t in output_tensors(v)]
    if isinstance(output, tuple | list):
        return [t for v in output for t in output_tensors(v)]
    return []


def position_sums(g: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """(B, size) sums over each row's positions of g ⊙ values, both (B, …, *shape) with
    ``size`` = ∏ shape (the scale gradient of a normalisation over trailing dims)."""
    flat_g = g.reshape(g.shape[0], -1, size)
    return torch.einsum("bti,bti->bi", flat_g, values.reshape_as(flat_g))


def sq_rows(rows: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each row (B, ...) → (B,), without a squared temporary; rows in a
    low precision are summed in float32 (each bfloat16 is a float32: exact inputs)."""
    flat = rows.reshape(rows.shape[0], -1)
    dtype = torch.float32 if low_precision(rows) else None
    norms: torch.Tensor = torch.linalg.vector_norm(flat, dim=1, dtype=dtype)
    return norms.pow(2)


def low_precision(value: Any) -> bool:
    """Whether ``value`` (a tensor, or tuples, lists and dicts of them) holds a floating
    tensor below float32, as a pass under autocast records."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and value.element_size() < 4
    if isinstance(value, tuple | list):
        return any(low_precision(v) for v in value)
    if isinstance(value, dict):
        return any(low_precision(v) for v in value.values())
    return False


def float32_calls(value: Any) -> Any:
    """``value`` with every low-precision floating tensor in it upcast to float32 (exact)."""
    if isinstance(value, torch.Tensor):
        return value.float() if low_precision(value) else value
    if isinstance(value, tuple | list):
        return type(value)(float32_calls(v) for v in value)
    if isinstance(value, dict):
        return {k: float32_calls(v) for k, v in value.items()}
    return value


def trainable(param: torch.Tensor | None) -> bool:
    return param is not None and param.requires_grad


def grouped(rows: torch.Tensor, views: int) -> torch.Tensor:
    """(B·K, ...) → (B, ...) by summing the K consecutive rows of each example."""
    return rows.reshape(-1, views, *rows.shape[1:]).sum(1)


def row_mask(drop: torch.Tensor, views: int, like: torch.Tensor) -> torch.Tensor:
    """(B,) → (B·K, 1, 1, ...) broadcastable against ``like``."""
    return drop.repeat_interleave(views).view(-1, *[1] * (like.dim() - 1))


@dataclasses.dataclass(frozen=True)
class Rule:
    """How book-keeping handles one layer type.

    Attributes:
      terms: ``terms(module, calls, views, strategy)`` → the layer's :class:`LayerTerms`.
      check: why a module of this type is not supported after all (e.g. a padding mode),
        or None.
      unit: the rule covers the module's whole subtree (its children are not clipped on
        their own) and its calls are recorded whole: ``((args, kwargs), output grads)``
        instead of ``(input, output grad)`` (see :mod:`~dpvision.per_example.tape`).
      with_output: the tape also keeps each call's output (if not changed in place later):
        calls are ``((input, output or None), output grad)``. The output was computed by
        the pass's kernels (bfloat16, TF32): a norm must not read it unless the sum reads
        the same values.
      low_precision: the rule takes values recorded under autocast as they are (else
        :func:`~dpvision.per_example.layers.layer_terms` upcasts them to float32 first). It
        must then keep the norms and the sum consistent: per-example gradients formed in
        the low precision are kept, their norms and their clipped sum both read from that
        one tensor in float32; everything else is computed from the upcast values.
    """

    terms: "TermsFactory"
    check: Callable[[nn.Module], str | None]
    unit: bool = False
    with_output: bool = False
    low_precision: bool = False


RULES: dict[type[nn.Module], Rule] = {}

TermsFactory = Callable[[nn.Module, list[Call], int, Strategy], LayerTerms]


def register_rule(
    *layer_types: type[nn.Module],
    check: Callable[[nn.Module], str | None] = lambda _: None,
    unit: bool = False,
    with_output: bool = False,
    low_precision: bool = False,
) -> Callable[[TermsFactory], TermsFactory]:
    """Decorator of a :class:`LayerTerms` class (or a function returning one): it handles
    modules of exactly these types (not subclasses, whose ``forward`` may differ)."""

    def register(terms: TermsFactory) -> TermsFactory:
        for layer_type in layer_types:
            RULES[layer_type] = Rule(terms, check, unit, with_output, low_precision)
        return terms

    return register


class SmallRowsTerms(LayerTerms):
    """A layer whose per-example parameter gradients are small (B × p, p the parameter
    count): they are formed directly from each call (``rows``) and summed per example over
    calls and views. Subclasses give :meth:`parts`, each parameter's (B·K, p) rows of one
    call, keyed by the parameter's name relative to the module (``weight``,
    ``out_proj.bias``)."""

    def __init__(
        self, module: nn.Module, calls: list[Call], views: int, strategy: Strategy = "auto"
    ) -> None:
        self.rows: dict[str, torch.Tensor] = {}
        batch = 0
        for x, g in calls:
            for name, rows in self.parts(module, x, g).items():
                batch = rows.shape[0] // views
                if trainable(module.get_parameter(name)):
                    summed = grouped(rows.reshape(rows.shape[0], -1), views)
                    self.rows[name] = self.rows[name] + summed if name in self.rows else summed
        like = next(iter(self.rows.values()), None)
        self.sq_norms = torch.zeros(batch) if like is None else like.new_zeros(batch)
        for rows in self.rows.values():
            self.sq_norms = self.sq_norms + rows.pow(2).sum(1)
        self.shapes = {name: module.get_parameter(name).shape for name in self.rows}

    @abstractmethod
    def parts(self, module: nn.Module, x: Any, g: Any) -> dict[str, torch.Tensor]:
        """Per-row gradients of each parameter for one call (input ``x``, output grad ``g``;
        for a unit rule, ``((args, kwargs), output grads)``)."""

    def clipped_sum(
        self, scale: torch.Tensor, drop: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        out = {}
        for name, rows in self.rows.items():
            if drop is not None:
                rows = rows.masked_fill(drop[:, None], 0)
            out[name] = (scale.to(rows.dtype) @ rows).reshape(self.shapes[name])
        return out


def kernel_precision(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input and output gradient in the dtype its kernels ran in: the output
    gradient's when that is below float32 (autocast then cast the input to it: the same
    rounding again), else float32 for both (an exact upcast)."""
    if low_precision(g):
        return x.to(g.dtype), g
    return float32_pair(x, g)


def float32_pair(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input and output gradient in float32 (an exact upcast of lower precisions)."""
    return float32_calls(x), float32_calls(g)
