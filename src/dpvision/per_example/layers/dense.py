"""The rule of layers whose output is ``a @ Wᵀ`` over positions: ``nn.Linear`` (any leading
dimensions), ``nn.Conv2d`` (zeros padding, ``groups=1``, via im2col; registered by
:mod:`~dpvision.per_example.layers.conv`) and ``WSConv2d``
(gradients mapped through the weight standardisation to the raw weight and the gain).

Example i's weight gradient is Gᵢ = Σₜ gᵢₜ aᵢₜᵀ; its squared norm comes from the ghost trick
(memory B·T²) or from materialising Gᵢ (memory B·p·d), whichever is cheaper.
"""

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn
from torch.nn.grad import conv2d_weight

from dpvision.models.layers import WSConv2d, same_padding
from dpvision.per_example.layers.base import (
    MATERIALISE_BYTES,
    Call,
    LayerTerms,
    Strategy,
    grouped,
    register_rule,
    row_mask,
    sq_rows,
    sum_calls,
    trainable,
)

# Convolutions with at least this many output positions get per-example gradients by a grouped
# convolution rather than im2col (measured faster on CPU from about 100 positions on).
_GROUPED_MIN_POSITIONS = 128


# Ghost norms are computed on chunks of examples whose T×T Gram matrices fit in this many bytes.
_GHOST_CHUNK_BYTES = 1 << 27


class _Dense:
    """How a Linear or a convolution sees its calls: im2col rows and the weighted product."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.is_conv = isinstance(module, nn.Conv2d | WSConv2d)

    def padded(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """The input after any explicit padding, and the padding the convolution adds itself."""
        module = self.module
        if isinstance(module, WSConv2d):
            if module.padding == "same":
                top, bottom = same_padding(x.shape[-2], module.kernel_size, module.stride)
                left, right = same_padding(x.shape[-1], module.kernel_size, module.stride)
                return F.pad(x, (left, right, top, bottom)), (0, 0)
            return x, (module.padding, module.padding)
        assert isinstance(module, nn.Conv2d)
        if isinstance(module.padding, str):
            if module.padding == "valid":
                return x, (0, 0)
            pads: list[int] = []  # F.pad order: last dimension first
            for k, d in zip(module.kernel_size[::-1], module.dilation[::-1], strict=True):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            return F.pad(x, pads), (0, 0)
        return x, (int(module.padding[0]), int(module.padding[1]))

    def geometry(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(kernel size, stride, dilation) of a convolution."""
        module = self.module
        if isinstance(module, WSConv2d):
            k, s = module.kernel_size, module.stride
            return (k, k), (s, s), (1, 1)
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

    def unmatrix(self, matrix: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Inverse of :meth:`matrix`: (p, d) back to the weight's shape (p, C_in, kh, kw)."""
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

    def per_example(self, x: torch.Tensor, g: torch.Tensor, views: int) -> torch.Tensor:
        """(B, p, d) per-example weight gradients Σₜ gₜaₜᵀ of one call.

        Convolutions with many output positions use the weight-gradient kernel of a grouped
        convolution (the examples as groups, their K views as its batch), which needs no
        im2col copy; the others use im2col and one batched matrix product.
        """
        if not (self.is_conv and self.positions(g) >= _GROUPED_MIN_POSITIONS):
            a, rows = self.rows(x, g, views)
            return torch.bmm(rows.transpose(1, 2), a)
        kernel, stride, dilation = self.geometry()
        padded, padding = self.padded(x)
        n, c = padded.shape[:2]
        batch, p = n // views, g.shape[1]
        # The weight gradient of a convolution with the examples as groups: the K views of
        # an example are the batch of its group, so the backward sums over them.
        inputs = padded.reshape(batch, views, c, *padded.shape[2:]).transpose(0, 1)
        grads = g.reshape(batch, views, p, *g.shape[2:]).transpose(0, 1)
        weight = padded.new_empty(batch * p, c, *kernel)  # only its shape is read
        _, out, _ = torch.ops.aten.convolution_backward(
            grads.reshape(views, batch * p, *g.shape[2:]),
            inputs.reshape(views, batch * c, *padded.shape[2:]),
            weight,
            None,
            list(stride),
            list(padding),
            list(dilation),
            False,
            [0, 0],
            batch,
            [False, True, False],
        )
        out = out.reshape(batch, p, c, kernel[0], kernel[1]).permute(0, 1, 3, 4, 2)
        return out.reshape(batch, p, kernel[0] * kernel[1] * c)


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


def _ghost_sq_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Σₜₜ′ (aₜ·aₜ′)(gₜ·gₜ′) per example, in chunks that bound the B·T² memory."""
    batch, positions = a.shape[0], a.shape[1]
    if positions == 1:  # ‖a‖²‖g‖²
        return sq_rows(a) * sq_rows(g)
    chunk = max(1, _GHOST_CHUNK_BYTES // max(1, positions * positions * a.element_size()))
    parts = []
    for start in range(0, batch, chunk):
        a_part, g_part = a[start : start + chunk], g[start : start + chunk]
        gram_a = torch.bmm(a_part, a_part.transpose(1, 2))
        gram_g = torch.bmm(g_part, g_part.transpose(1, 2))
        parts.append((gram_a * gram_g).sum((1, 2)))
    return torch.cat(parts) if parts else a.new_zeros(0)


@register_rule(nn.Linear, WSConv2d)
class DenseTerms(LayerTerms):
    """Linear, Conv2d and WSConv2d layers."""

    def __init__(self, module: nn.Module, calls: list[Call], views: int, strategy: Strategy):
        self.module, self.calls, self.views = module, calls, views
        self.dense = _Dense(module)
        self.ws = module if isinstance(module, WSConv2d) else None
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        p, d = weight.shape[0], weight[0].numel()
        batch = calls[0][0].shape[0] // views
        positions = views * sum(self.dense.positions(g) for _, g in calls)
        self.materialise = strategy == "materialise" or (
            strategy == "auto"
            # Materialising costs B·T·p·d, the ghost norm B·T²·(p + d) (T positions).
            and p * d <= positions * (p + d)
            and batch * p * d * weight.element_size() <= MATERIALISE_BYTES
        )
        self.train_weight = trainable(weight)
        self.train_bias = trainable(getattr(module, "bias", None))
        self.train_gain = self.ws is not None and trainable(self.ws.gain)
        sq = weight.new_zeros(batch)
        self.bias_rows: torch.Tensor | None = None
        if self.train_bias:
            self.bias_rows = sum_calls(self.dense.bias_rows(g, views) for _, g in calls)
            sq = sq + sq_rows(self.bias_rows)
        self.per_example: torch.Tensor | None = None
        if self.train_weight or self.train_gain:
            if self.materialise:
                self.per_example = sum_calls(self.dense.per_example(x, g, views) for x, g in calls)
                sq = sq + self._materialised_sq(self.per_example)
            else:
                pairs = [self.dense.rows(x, g, views) for x, g in calls]
                a = torch.cat([r[0] for r in pairs], 1) if len(pairs) > 1 else pairs[0][0]
                g = torch.cat([r[1] for r in pairs], 1) if len(pairs) > 1 else pairs[0][1]
                sq = sq + self._ghost_sq(a, g)
        self.sq_norms = sq

    # --- weight standardisation ------------------------------------------------------
    def _standardisation(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w̃ (p, d), γ/s (p,) and whether the variance term is live (p,), for WSConv2d.

        ŵ = γ·w̃ with w̃ = (w − μ)/s and s = sqrt(max(‖w − μ‖², eps)). For G = ∂L/∂ŵ:
        ∂L/∂γ = ⟨G, w̃⟩ and ∂L/∂w = (γ/s)(G − mean(G) − w̃⟨G, w̃⟩·[‖w − μ‖² ≥ eps]);
        below eps, s is a constant and only the mean is projected out.
        """
        ws = self.ws
        assert ws is not None
        with torch.no_grad():
            w = self.dense.matrix(ws.weight)
            centred = w - w.mean(1, keepdim=True)
            energy = centred.pow(2).sum(1)  # fan_in · var
            s = energy.clamp(min=ws.eps).sqrt()
            return centred / s[:, None], ws.gain.reshape(-1) / s, energy >= ws.eps

    def _map_ws(self, grad_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(…, p, d) gradients w.r.t. ŵ → (gradients w.r.t. w, w.r.t. γ (…, p)), im2col order."""
        tilde, ratio, live = self._standardisation()
        gain = (grad_hat * tilde).sum(-1)
        centred = grad_hat - grad_hat.mean(-1, keepdim=True)
        weight = ratio[:, None] * (centred - tilde * (gain * live)[..., None])
        return weight, gain

    def _materialised_sq(self, per_example: torch.Tensor) -> torch.Tensor:
        if self.ws is None:
            return sq_rows(per_example)
        # ‖∂w‖² = Σₒ (γₒ/sₒ)²(‖Gₒ‖² − (Σ Gₒ)²/d − liveₒ⟨Gₒ, w̃ₒ⟩²): the projection removes
        # the orthonormal directions 1/√d and w̃ₒ (w̃ₒ ⟂ 1, ‖w̃ₒ‖ = 1 when live), so no
        # (B, p, d) temporary is needed.
        tilde, ratio, live = self._standardisation()
        gain = torch.einsum("bpd,pd->bp", per_example, tilde)
        sq = per_example.new_zeros(len(gain))
        if self.train_weight:
            full = torch.linalg.vector_norm(per_example, dim=-1).pow(2)
            mean_part = per_example.sum(-1).pow(2) / per_example.shape[-1]
            per_channel = (full - mean_part - live * gain.pow(2)).clamp(min=0)
            sq = sq + (per_channel * ratio.pow(2)).sum(1)
        return sq + sq_rows(gain) if self.train_gain else sq

    def _ghost_sq(self, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if self.ws is None:
            return _ghost_sq_norms(a, g)
        # ‖∂w‖² = Σₒ (γₒ/sₒ)²(‖Gₒ‖² − d·mean(Gₒ)² − liveₒ⟨Gₒ, w̃ₒ⟩²): Gₒ ⟂ 1 and w̃ₒ.
        tilde, ratio, live = self._standardisation()
        d = tilde.shape[1]
        gain = torch.einsum("btp,btp->bp", g, a @ tilde.T)  # ⟨Gₒ, w̃ₒ⟩
        sq = a.new_zeros(a.shape[0])
        if self.train_weight:
            mean = torch.einsum("btp,bt->bp", g, a.sum(-1)) / d
            full = _ghost_sq_norms(a, g * ratio)
            projected = (ratio.pow(2) * (d * mean.pow(2) + live * gain.pow(2))).sum(1)
            sq = sq + (full - projected).clamp(min=0)
        return sq + gain.pow(2).sum(1) if self.train_gain else sq

    # --- the clipped sum ---------------------------------------------------------------
    def clipped_sum(
        self, scale: torch.Tensor, drop: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        module, out = self.module, {}
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        if self.bias_rows is not None:
            rows = self.bias_rows if drop is None else self.bias_rows.masked_fill(drop[:, None], 0)
            out["bias"] = scale.to(rows.dtype) @ rows
        if not (self.train_weight or self.train_gain):
            return out
        if self.per_example is not None:
            per_example = self.per_example
            if drop is not None:
                per_example = per_example.masked_fill(drop[:, None, None], 0)
            grad_hat = torch.tensordot(scale.to(per_example.dtype), per_example, dims=1)
        else:
            row_scale = scale.repeat_interleave(self.views)
            grad_hat = 0
            for x, g in self.calls:
                g = g * row_scale.to(g.dtype).view(-1, *[1] * (g.dim() - 1))
                if drop is not None:
                    g = g.masked_fill(row_mask(drop, self.views, g), 0)
                    x = x.masked_fill(row_mask(drop, self.views, x), 0)
                grad_hat = grad_hat + self.dense.weighted_product(x, g)
            assert isinstance(grad_hat, torch.Tensor)
        if self.ws is None:
            out["weight"] = self.dense.unmatrix(grad_hat, weight.shape)
            return out
        grad_w, grad_gain = self._map_ws(grad_hat)
        if self.train_weight:
            out["weight"] = self.dense.unmatrix(grad_w, weight.shape)
        if self.train_gain:
            out["gain"] = grad_gain.reshape(self.ws.gain.shape)
        return out
