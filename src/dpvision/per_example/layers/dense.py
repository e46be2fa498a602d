"""The rule of layers whose output is ``a @ Wᵀ`` over positions: ``nn.Linear`` (any leading
dimensions) and ``nn.Conv2d`` (zeros padding, ``groups=1``, via im2col; registered by
:mod:`~dpvision.per_example.layers.conv`). ``WSConv2d`` extends it
(:mod:`~dpvision.per_example.layers.wsconv`).

Example i's weight gradient is Gᵢ = Σₜ gᵢₜ aᵢₜᵀ; its squared norm comes from the ghost trick
(memory B·T²) or from materialising Gᵢ (memory B·p·d), whichever is cheaper.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn
from torch.nn.grad import conv2d_weight

from dpvision.per_example.layers.base import (
    MATERIALISE_BYTES,
    Call,
    LayerTerms,
    Strategy,
    float32_calls,
    grouped,
    kernel_precision,
    register_rule,
    row_mask,
    sq_rows,
    sum_calls,
    trainable,
)

# Convolutions with at least this many output positions get per-example gradients by a grouped
# convolution rather than im2col (measured faster on CPU from about 100 positions on).
_GROUPED_MIN_POSITIONS = 128
# With K > 1 views, from this many output positions on each row is its own group.
_PER_ROW_MIN_POSITIONS = 512
# Grouped weight-gradient kernels take at most this many examples (groups) at a time: on the
# CPU, chunks of 64 ran 1.1-2.5 times as fast in float32 as one kernel over 256-2048
# examples, and 3 times as fast in bfloat16, whose kernels slow down with many groups.
GROUPED_CHUNK = 64


# Ghost norms are computed on chunks of examples whose T×T Gram matrices fit in this many bytes.
_GHOST_CHUNK_BYTES = 1 << 27


class DenseView:
    """How a Linear or a convolution sees its calls: im2col rows and the weighted product.

    A convolution of another type (``WSConv2d``) subclasses it with its own :meth:`padded`
    and :meth:`geometry`.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.is_conv = isinstance(module, nn.Conv2d)

    def padded(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """The input after any explicit padding, and the padding the convolution adds itself
        (symmetric padding is left to the kernels: no padded copy)."""
        module = self.module
        assert isinstance(module, nn.Conv2d)
        if isinstance(module.padding, str):
            if module.padding == "valid":
                return x, (0, 0)
            totals = [d * (k - 1) for k, d in zip(module.kernel_size, module.dilation, strict=True)]
            if all(total % 2 == 0 for total in totals):
                return x, (totals[0] // 2, totals[1] // 2)
            pads: list[int] = []  # F.pad order: last dimension first
            for total in totals[::-1]:
                pads += [total // 2, total - total // 2]
            return F.pad(x, pads), (0, 0)
        return x, (int(module.padding[0]), int(module.padding[1]))

    def geometry(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(kernel size, stride, dilation) of a convolution."""
        module = self.module
        assert isinstance(module, nn.Conv2d)
        return (
            (int(module.kernel_size[0]), int(module.kernel_size[1])),
            (int(module.stride[0]), int(module.stride[1])),
            (int(module.dilation[0]), int(module.dilation[1])),
        )

    def rows(
        self, x: torch.Tensor, g: torch.Tensor, views: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per example: a (B, T, d) and g (B, T, p), the K views' positions side by side."""
        if not self.is_conv:
            batch = x.shape[0] // views
            return x.reshape(batch, -1, x.shape[-1]), g.reshape(batch, -1, g.shape[-1])
        kernel, stride, dilation = self.geometry()
        padded, (pad_h, pad_w) = self.padded(x)
        if pad_h or pad_w:
            padded = F.pad(padded, (pad_w, pad_w, pad_h, pad_h))
        batch = x.shape[0] // views
        cols = _im2col(padded, kernel, stride, dilation)  # (B·K, L, d)
        grads = g.reshape(g.shape[0], g.shape[1], -1)  # (B·K, p, L)
        if views > 1:  # (B·K, p, L) → (B, p, K·L)
            grads = grads.reshape(batch, views, *grads.shape[1:]).transpose(1, 2).flatten(2)
        return cols.reshape(batch, -1, cols.shape[-1]), grads.transpose(1, 2)

    def weighted_product(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Σ over rows and positions of g aᵀ as a (p, d) matrix (g already weighted per row)."""
        if not self.is_conv:
            return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        kernel, stride, dilation = self.geometry()
        padded, padding = self.padded(x)
        shape = (g.shape[1], padded.shape[1], *kernel)
        product: torch.Tensor = conv2d_weight(  # type: ignore[no-untyped-call]
            padded, shape, g, stride=stride, padding=padding, dilation=dilation
        )
        return self.matrix(product)

    def matrix(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight-shaped tensor as the (p, d) matrix of the im2col layout: (kh, kw, C_in)."""
        if self.is_conv:
            weight = weight.permute(0, 2, 3, 1)
        return weight.reshape(weight.shape[0], -1)

    def unmatrix(self, matrix: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`matrix`: (p, d) back to the weight's shape (p, C_in, kh, kw)."""
        weight = self.module.weight
        assert isinstance(weight, torch.Tensor)
        shape = weight.shape
        if not self.is_conv:
            return matrix.reshape(shape)
        return matrix.reshape(shape[0], shape[2], shape[3], shape[1]).permute(0, 3, 1, 2)

    def positions(self, g: torch.Tensor) -> int:
        """T of one row: output positions of a convolution, leading positions of a Linear."""
        return g[0].numel() // g.shape[1 if self.is_conv else -1]

    def bias_rows(self, g: torch.Tensor, views: int) -> torch.Tensor:
        """(B, p) per-example bias gradients Σₜ gₜ."""
        if self.is_conv:
            return grouped(g.sum((-2, -1)), views)
        return g.reshape(g.shape[0] // views, -1, g.shape[-1]).sum(1)

    def per_example(
        self, x: torch.Tensor, g: torch.Tensor, views: int
    ) -> tuple[torch.Tensor, bool]:
        """(B, p, d) per-example weight gradients Σₜ gₜaₜᵀ of one call, and whether their
        columns are in the weight's own order (C_in, kh, kw) rather than im2col's.

        Convolutions with many output positions use the weight-gradient kernel of a grouped
        convolution (the examples as groups, their K views as its batch), which needs no
        im2col copy; the others use im2col and one batched matrix product.
        """
        if not (self.is_conv and self.positions(g) >= _GROUPED_MIN_POSITIONS):
            a, rows = self.rows(x, g, views)
            return torch.bmm(rows.transpose(1, 2), a), not self.is_conv
        rows_per_chunk = GROUPED_CHUNK * views
        if x.shape[0] > rows_per_chunk:
            parts = [
                self._grouped(
                    x[start : start + rows_per_chunk], g[start : start + rows_per_chunk], views
                )
                for start in range(0, x.shape[0], rows_per_chunk)
            ]
            return torch.cat(parts), True
        return self._grouped(x, g, views), True

    def _grouped(self, x: torch.Tensor, g: torch.Tensor, views: int) -> torch.Tensor:
        """:meth:`per_example` of a convolution by one grouped weight-gradient kernel."""
        kernel, stride, dilation = self.geometry()
        padded, padding = self.padded(x)
        n, c = padded.shape[:2]
        batch, p = n // views, g.shape[1]
        # The weight gradient of a convolution with the examples as groups. With K views,
        # either each row is its own group and the K rows' gradients are summed after (no
        # copy of the inputs; memory B·K·p·d), or the K views are the batch of their
        # example's group (a transposed copy of inputs and gradients): the first is faster
        # on large images, the second on small ones.
        per_row = views > 1 and self.positions(g) >= _PER_ROW_MIN_POSITIONS
        groups = n if per_row or views == 1 else batch
        if groups == n:
            inputs, grads = (
                padded.reshape(1, n * c, *padded.shape[2:]),
                g.reshape(1, n * p, *g.shape[2:]),
            )
        else:
            inputs = padded.reshape(batch, views, c, *padded.shape[2:]).transpose(0, 1)
            grads = g.reshape(batch, views, p, *g.shape[2:]).transpose(0, 1)
            inputs = inputs.reshape(views, batch * c, *padded.shape[2:])
            grads = grads.reshape(views, batch * p, *g.shape[2:])
        weight = padded.new_empty(groups * p, c, *kernel)  # only its shape is read
        _, out, _ = torch.ops.aten.convolution_backward(
            grads,
            inputs,
            weight,
            None,
            list(stride),
            list(padding),
            list(dilation),
            False,
            [0, 0],
            groups,
            [False, True, False],
        )
        if groups == n and views > 1:
            out = out.reshape(batch, views, -1).sum(1)
        return out.reshape(batch, p, c * kernel[0] * kernel[1])

    def natural(self, matrices: torch.Tensor) -> torch.Tensor:
        """(…, p, d) in im2col order (kh, kw, C_in) → the weight's own order (C_in, kh, kw)."""
        if not self.is_conv:
            return matrices
        weight = self.module.weight
        assert isinstance(weight, torch.Tensor)
        c, kh, kw = weight.shape[1:]
        lead = matrices.shape[:-1]
        return matrices.reshape(*lead, kh, kw, c).movedim(-1, -3).reshape(*lead, c * kh * kw)


def _im2col(
    x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]
) -> torch.Tensor:
    """(N, C, H, W) → (N, L, kh·kw·C) patches, in one strided copy of a channels-last input.

    The columns are ordered (kh, kw, C) so that each kernel row is one contiguous run of
    kw·C values (``F.unfold`` loops over N and orders the columns (C, kh, kw)).
    """
    x = x.contiguous(memory_format=torch.channels_last)
    n, c, h, w = x.shape
    out_h = (h - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    out_w = (w - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    s_n, s_c, s_h, s_w = x.stride()
    patches = x.as_strided(
        (n, out_h, out_w, kernel[0], kernel[1], c),
        (s_n, s_h * stride[0], s_w * stride[1], s_h * dilation[0], s_w * dilation[1], s_c),
    )
    return patches.reshape(n, out_h * out_w, kernel[0] * kernel[1] * c)


def _ghost_sq_norms(
    gram: "Callable[[slice], torch.Tensor]", g: torch.Tensor, extra_bytes: int = 0
) -> torch.Tensor:
    """Σₜₜ′ (aₜ·aₜ′)(gₜ·gₜ′) per example, ``gram(examples)`` giving the (b, T, T) Gram
    matrices of the activations, in chunks that bound the memory (``extra_bytes`` per
    example is what ``gram`` needs besides its result)."""
    batch, positions = g.shape[0], g.shape[1]
    per_example = positions * positions * g.element_size() + extra_bytes
    chunk = max(1, _GHOST_CHUNK_BYTES // max(1, per_example))
    parts = []
    for start in range(0, batch, chunk):
        g_part = g[start : start + chunk]
        gram_g = torch.bmm(g_part, g_part.transpose(1, 2))
        parts.append((gram(slice(start, start + chunk)) * gram_g).sum((1, 2)))
    return torch.cat(parts) if parts else g.new_zeros(0)


class Im2colGhost:
    """Ghost norms from im2col rows a (B, T, d): Gram matrices over d."""

    def __init__(self, dense: DenseView, calls: list[Call], views: int) -> None:
        pairs = [dense.rows(x, g, views) for x, g in calls]
        self.a = torch.cat([r[0] for r in pairs], 1) if len(pairs) > 1 else pairs[0][0]
        self.g = torch.cat([r[1] for r in pairs], 1) if len(pairs) > 1 else pairs[0][1]

    def gram(self, examples: slice) -> torch.Tensor:
        a = self.a[examples]
        return torch.bmm(a, a.transpose(1, 2))

    def sq_norms(self, g: torch.Tensor) -> torch.Tensor:
        if g.shape[1] == 1:  # ‖a‖²‖g‖²
            return sq_rows(self.a) * sq_rows(g)
        return _ghost_sq_norms(self.gram, g)

    def project(self, vectors: torch.Tensor) -> torch.Tensor:
        """(B, T, p): aₜ·vₒ for (p, d) vectors in im2col order."""
        return self.a @ vectors.T


class PixelGhost:
    """Ghost norms of one convolution call from the Gram matrix of its input *pixels*.

    aₜ·aₜ′ = Σₖ x[t + k]·x[t′ + k] over the kernel offsets k: the (T, T) Gram matrix of the
    patches is a sum of kh·kw shifted blocks of the pixels' Gram matrix over C channels,
    which costs (K·Hp·Wp)²·C instead of T²·C·kh·kw, and needs no im2col copy.
    """

    def __init__(self, dense: DenseView, x: torch.Tensor, g: torch.Tensor, views: int) -> None:
        self.dense, self.views = dense, views
        self.kernel, self.stride, self.dilation = dense.geometry()
        self.x, self.padding = dense.padded(x)
        ph, pw = self.padding
        full = F.pad(self.x, (pw, pw, ph, ph)) if ph or pw else self.x
        n, c, h, w = full.shape
        batch = n // views
        self.shape = (h, w)
        self.out = tuple(g.shape[2:])
        # (B, K·Hp·Wp, C): each example's pixels, its K views side by side.
        self.pixels = full.reshape(batch, views, c, h * w).transpose(2, 3).reshape(batch, -1, c)
        # (B, K·L, p): output gradients per position, as the patch Gram matrix orders them.
        self.g = self.rows(g)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """(B·K, q, oh, ow) → (B, K·L, q)."""
        n, q = t.shape[:2]
        batch = n // self.views
        return t.reshape(batch, self.views, q, -1).transpose(2, 3).reshape(batch, -1, q)

    def gram(self, examples: slice) -> torch.Tensor:
        pixels = self.pixels[examples]
        b, k = pixels.shape[0], self.views
        (h, w), (oh, ow) = self.shape, self.out
        grams = torch.bmm(pixels, pixels.transpose(1, 2)).view(b, k, h, w, k, h, w)
        total = pixels.new_zeros(b, k, oh, ow, k, oh, ow)
        for ki in range(self.kernel[0]):
            for kj in range(self.kernel[1]):
                i, j = ki * self.dilation[0], kj * self.dilation[1]
                rows = slice(i, i + self.stride[0] * (oh - 1) + 1, self.stride[0])
                cols = slice(j, j + self.stride[1] * (ow - 1) + 1, self.stride[1])
                total += grams[:, :, rows, cols, :, rows, cols]
        return total.view(b, k * oh * ow, k * oh * ow)

    def sq_norms(self, g: torch.Tensor) -> torch.Tensor:
        pixels = self.pixels.shape[1]
        return _ghost_sq_norms(self.gram, g, pixels * pixels * self.pixels.element_size())

    def convolve(self, weight: torch.Tensor) -> torch.Tensor:
        """(B, T, q): the convolution of the input with a (q, C, kh, kw) weight."""
        out = F.conv2d(
            self.x, weight, stride=self.stride, padding=self.padding, dilation=self.dilation
        )
        return self.rows(out)


@register_rule(nn.Linear, low_precision=True)
class DenseTerms(LayerTerms):
    """Linear and Conv2d layers (and, through a subclass, WSConv2d).

    Every quantity a norm reads comes from the recorded input and output gradient, never
    from the layer's forward output: that was computed by other kernels, in the pass's
    precision (bfloat16, TF32), and an input crafted against its rounding could make the
    norm miss what the sum adds (WSConv2d's ⟨Gₒ, w̃ₒ⟩ once read back from the output let
    one example move the sum by 12 C in bfloat16).
    """

    # How the layer's calls are read (a subclass for a convolution of another type).
    view: type[DenseView] = DenseView

    def __init__(self, module: nn.Module, calls: list[Call], views: int, strategy: Strategy):
        self.module, self.calls, self.views = module, calls, views
        self.dense = self.view(module)
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        p, d = weight.shape[0], weight[0].numel()
        batch = calls[0][0].shape[0] // views
        positions = views * sum(self.dense.positions(g) for _, g in calls)
        # Costs per example, T positions: materialising T·p·d (on kernels about half as fast
        # as the dense product the ghost sum takes afterwards), ghost norms T²·(p + d) from
        # im2col rows or (K·Hp·Wp)²·C + T²·(p + kh·kw) from the pixels.
        im2col = positions * positions * (p + d)
        pixel = self._pixel_cost(calls, views, positions, p)
        extra = self._ghost_extra_cost(positions * p * d)
        im2col += extra
        pixel += extra
        self.pixel = pixel < math.inf and (
            strategy == "pixel" or (strategy == "auto" and pixel < im2col)
        )
        self.materialise = strategy == "materialise" or (
            strategy == "auto"
            and positions * p * d <= min(im2col, pixel)
            and batch * p * d * weight.element_size() <= MATERIALISE_BYTES
        )
        self.train_weight = trainable(weight)
        self.train_bias = trainable(getattr(module, "bias", None))
        sq = weight.new_zeros(batch)
        self.bias_rows: torch.Tensor | None = None
        if self.train_bias:
            self.bias_rows = sum_calls(
                self.dense.bias_rows(float32_calls(g), views) for _, g in calls
            )
            sq = sq + sq_rows(self.bias_rows)
        # Per-example weight gradients, kept: formed in the precision the layer ran in (a
        # bfloat16 product of bfloat16 values, accumulated in float32), their norms and
        # their clipped sum read in float32 from this one tensor.
        self.per_example: torch.Tensor | None = None
        self.natural = False  # whether per_example's columns are (C_in, kh, kw), not im2col's
        if self._weight_terms_needed():
            if self.materialise:
                parts = [self.dense.per_example(*kernel_precision(x, g), views) for x, g in calls]
                # Mixed orders (calls on different image sizes) all go to the weight's own.
                self.natural = any(natural for _, natural in parts)
                self.per_example = sum_calls(
                    part if natural == self.natural else self.dense.natural(part)
                    for part, natural in parts
                )
                sq = sq + self._materialised_sq(self.per_example)
                self.calls = []  # the sum reads per_example
            elif self.pixel:
                ((x, g),) = float32_calls(calls)
                sq = sq + self._ghost_sq(PixelGhost(self.dense, x, g, views))
            else:
                sq = sq + self._ghost_sq(Im2colGhost(self.dense, float32_calls(calls), views))
        self.sq_norms = sq

    def _pixel_cost(self, calls: list[Call], views: int, positions: int, p: int) -> float:
        """The pixel Gram route's cost, or infinity where it does not apply."""
        if not self.dense.is_conv or len(calls) != 1:
            return math.inf
        x, _ = calls[0]
        (kh, kw), _, _ = self.dense.geometry()
        _, (ph, pw) = self.dense.padded(x[:1])
        pixels = views * (x.shape[-2] + 2 * ph) * (x.shape[-1] + 2 * pw)
        return float(pixels * pixels * x.shape[1] + positions * positions * (p + kh * kw))

    # --- what a subclass changes ---------------------------------------------------------
    def _ghost_extra_cost(self, product: int) -> int:
        """What the ghost routes cost besides the norms, given T·p·d (none here)."""
        return 0

    def _weight_terms_needed(self) -> bool:
        """Whether the weight's per-example gradients are needed (it trains)."""
        return self.train_weight

    def _materialised_sq(self, per_example: torch.Tensor) -> torch.Tensor:
        """Per-example squared norms from the materialised weight gradients."""
        return sq_rows(per_example)

    def _ghost_sq(self, source: "Im2colGhost | PixelGhost") -> torch.Tensor:
        """Per-example squared norms of the weight gradients by the ghost trick."""
        return source.sq_norms(source.g)

    # --- the clipped sum ---------------------------------------------------------------
    def clipped_sum(
        self, scale: torch.Tensor, drop: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        out = self._bias_sum(scale, drop)
        if not self.train_weight:
            return out
        grad_hat, natural = self._weight_sum(scale, drop)
        out["weight"] = self._unmatrix(grad_hat, natural)
        return out

    def _bias_sum(self, scale: torch.Tensor, drop: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The clipped sum of the bias (empty if it does not train)."""
        out = {}
        if self.bias_rows is not None:
            rows = self.bias_rows if drop is None else self.bias_rows.masked_fill(drop[:, None], 0)
            out["bias"] = scale.to(rows.dtype) @ rows
        return out

    def _weight_sum(
        self, scale: torch.Tensor, drop: torch.Tensor | None
    ) -> tuple[torch.Tensor, bool]:
        """Σᵢ scaleᵢ·Gᵢ as a (p, d) matrix, and whether its columns are in the weight's own
        order (C_in, kh, kw) rather than im2col's: from the kept per-example gradients, else
        one weighted product of the recorded calls."""
        if self.per_example is not None:
            per_example = float32_calls(self.per_example)
            if drop is not None:
                per_example = per_example.masked_fill(drop[:, None, None], 0)
            grad_hat = torch.tensordot(scale.to(per_example.dtype), per_example, dims=1)
            return grad_hat, self.natural
        row_scale = scale.repeat_interleave(self.views)
        total: torch.Tensor | int = 0
        for x, g in float32_calls(self.calls):
            g = g * row_scale.to(g.dtype).view(-1, *[1] * (g.dim() - 1))
            if drop is not None:
                g = g.masked_fill(row_mask(drop, self.views, g), 0)
                x = x.masked_fill(row_mask(drop, self.views, x), 0)
            total = total + self.dense.weighted_product(x, g)
        assert isinstance(total, torch.Tensor)
        return total, False

    def _unmatrix(self, matrix: torch.Tensor, natural: bool) -> torch.Tensor:
        """A (p, d) matrix in the given column order back to the weight's shape."""
        if natural:
            weight = self.module.weight
            assert isinstance(weight, torch.Tensor)
            return matrix.reshape(weight.shape)
        return self.dense.unmatrix(matrix)
