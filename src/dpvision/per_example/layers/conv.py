"""The rule of ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` with any ``groups``, stride,
dilation, padding and padding mode.

A Conv2d with ``groups=1`` and zeros padding goes to the dense rule
(:mod:`~dpvision.per_example.layers.dense`: ghost norms or im2col). A depthwise convolution
(one input channel per group) gets its per-example weight gradients from one forward
depthwise convolution of the inputs with the output gradients as filters; every other
convolution from the weight-gradient kernel of one grouped convolution, with the examples
as groups (example i's input channels and output gradients are group i, its K views the
batch). Both are exact, need no im2col copy and take memory B·(weight size). Their
norms are formed directly; the clipped sum is one more weight-gradient kernel with each row's
output gradient scaled by its factor (or the kept per-example gradients, when they fit).
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.per_example.layers.base import (
    MATERIALISE_BYTES,
    Call,
    LayerTerms,
    Strategy,
    float32_calls,
    float32_pair,
    grouped,
    kernel_precision,
    register_rule,
    row_mask,
    sq_rows,
    sum_calls,
    trainable,
)
from dpvision.per_example.layers.dense import GROUPED_CHUNK, DenseTerms

_Conv = nn.Conv1d | nn.Conv2d | nn.Conv3d


def _weight_grad(
    module: _Conv, x: torch.Tensor, g: torch.Tensor, padding: tuple[int, ...], groups: int
) -> torch.Tensor:
    """The weight gradient of ``module`` for input ``x`` (already explicitly padded) and
    output gradient ``g``, computed as for a convolution with ``groups`` groups."""
    dims = x.dim() - 2
    shape = (g.shape[1], x.shape[1] // groups, *module.kernel_size)
    _, grad, _ = torch.ops.aten.convolution_backward(
        g,
        x,
        x.new_empty(shape),  # only its shape is read
        None,
        list(module.stride),
        list(padding),
        list(module.dilation),
        False,
        [0] * dims,
        groups,
        [False, True, False],
    )
    return grad  # type: ignore[no-any-return]


def _depthwise_grads(
    module: _Conv, x: torch.Tensor, g: torch.Tensor, padding: tuple[int, ...], views: int
) -> torch.Tensor:
    """(b, *weight shape) per-example weight gradients of a depthwise convolution (one input
    channel per group) as one *forward* depthwise convolution: each example's input channel
    correlated with its output gradients, the gradients as the filter (its K views as the
    filter's input channels, so summed), the convolution's stride as the filter's dilation
    and its dilation as the stride. Exact, and on the CPU 10-20 times as fast as the
    grouped weight-gradient kernel with B·C groups."""
    dims = x.dim() - 2
    n, c = x.shape[:2]
    b, out = n // views, g.shape[1]
    inputs = x.reshape(b, views, c, *x.shape[2:]).transpose(1, 2)
    filters = g.reshape(b, views, out, *g.shape[2:]).transpose(1, 2)
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    grads = conv(
        inputs.reshape(1, b * c * views, *x.shape[2:]),
        filters.reshape(b * out, views, *g.shape[2:]),
        stride=module.dilation,
        padding=padding,
        dilation=module.stride,
        groups=b * c,
    )
    crop = grads[(0, slice(None), *(slice(0, k) for k in module.kernel_size))]
    return crop.reshape(b, *module.weight.shape)


class ConvTerms(LayerTerms):
    """Any convolution, by per-example weight gradients from a grouped-convolution kernel."""

    def __init__(self, module: nn.Module, calls: list[Call], views: int, strategy: Strategy):
        assert isinstance(module, _Conv)
        self.module, self.views = module, views
        self.calls = [(*self._padded(x), g) for x, g in calls]
        batch = calls[0][0].shape[0] // views
        weight = module.weight
        sq = weight.new_zeros(batch)
        self.bias_rows: torch.Tensor | None = None
        if trainable(module.bias):
            self.bias_rows = sum_calls(
                grouped(float32_calls(g).flatten(2).sum(-1), views) for _, g in calls
            )
            sq = sq + sq_rows(self.bias_rows)
        self.per_example: torch.Tensor | None = None
        self.train_weight = trainable(weight)
        if self.train_weight:
            size = weight.numel() * weight.element_size()
            chunk = max(1, MATERIALISE_BYTES // size)
            if batch <= chunk:  # kept: formed in the layer's precision, read in float32
                self.per_example = torch.cat(
                    [
                        self._per_example(s, min(s + GROUPED_CHUNK, batch), kernel_precision)
                        for s in range(0, batch, GROUPED_CHUNK)
                    ]
                )
                sq = sq + sq_rows(self.per_example)
                self.calls = []  # the sum reads per_example
            else:  # norms chunk by chunk; the clipped sum is recomputed with scaled rows,
                # both in float32 so that the norms are those of what the sum adds
                sq = sq + torch.cat(
                    [sq_rows(self._per_example(s, s + chunk)) for s in range(0, batch, chunk)]
                )
        self.sq_norms = sq

    def _padded(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The input with any padding the kernel cannot do itself, and the rest."""
        module = self.module
        dims = x.dim() - 2
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            return F.pad(x, module._reversed_padding_repeated_twice, mode=mode), (0,) * dims
        return x, tuple(int(p) for p in module.padding)

    def _per_example(
        self,
        start: int,
        stop: int,
        precision: "Callable[[torch.Tensor, torch.Tensor], Any]" = float32_pair,
    ) -> torch.Tensor:
        """(b, *weight shape) per-example weight gradients of examples [start, stop), from
        the (input, output gradient) pairs in ``precision`` (default: float32)."""
        module, views = self.module, self.views
        groups = module.groups
        total: torch.Tensor | None = None
        for x, padding, g in self.calls:
            x, g = x[start * views : stop * views], g[start * views : stop * views]
            x, g = precision(x, g)
            b = x.shape[0] // views
            if groups == module.in_channels:
                part = _depthwise_grads(module, x, g, padding, views)
                total = part if total is None else total + part
                continue
            # (b·K, C, ...) → (K, b·C, ...): the examples side by side as groups.
            inputs = x.reshape(b, views, *x.shape[1:]).transpose(0, 1).flatten(1, 2)
            grads = g.reshape(b, views, *g.shape[1:]).transpose(0, 1).flatten(1, 2)
            part = _weight_grad(module, inputs, grads, padding, b * groups)
            part = part.reshape(b, *module.weight.shape)
            total = part if total is None else total + part
        assert total is not None
        return total

    def clipped_sum(
        self, scale: torch.Tensor, drop: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        if self.bias_rows is not None:
            rows = self.bias_rows if drop is None else self.bias_rows.masked_fill(drop[:, None], 0)
            out["bias"] = scale.to(rows.dtype) @ rows
        if not self.train_weight:
            return out
        if self.per_example is not None:
            per_example = float32_calls(self.per_example)
            if drop is not None:
                per_example = per_example.masked_fill(row_mask(drop, 1, per_example), 0)
            out["weight"] = torch.tensordot(scale.to(per_example.dtype), per_example, dims=1)
            return out
        row_scale = scale.repeat_interleave(self.views)
        total: Any = 0
        for x, padding, g in self.calls:
            x, g = float32_calls(x), float32_calls(g)
            g = g * row_scale.to(g.dtype).view(-1, *[1] * (g.dim() - 1))
            if drop is not None:
                g = g.masked_fill(row_mask(drop, self.views, g), 0)
                x = x.masked_fill(row_mask(drop, self.views, x), 0)
            total = total + _weight_grad(self.module, x, g, padding, self.module.groups)
        out["weight"] = total
        return out


def _dense_ready(module: nn.Module) -> bool:
    return isinstance(module, nn.Conv2d) and module.groups == 1 and module.padding_mode == "zeros"


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d, low_precision=True)
def conv_terms(module: nn.Module, calls: list[Call], views: int, strategy: Strategy) -> LayerTerms:
    """Dense rule (ghost norms) for plain Conv2d, grouped-kernel rule for the others."""
    if _dense_ready(module):
        return DenseTerms(module, calls, views, strategy)
    return ConvTerms(module, calls, views, strategy)
