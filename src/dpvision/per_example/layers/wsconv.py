"""The rule of ``WSConv2d``: the dense rule (:mod:`~dpvision.per_example.layers.dense`) on the
standardised weight ŵ, its gradients mapped through the weight standardisation to the raw
weight and the gain.

ŵ = γ·w̃ with w̃ = (w − μ)/s and s = sqrt(max(‖w − μ‖², eps)). For G = ∂L/∂ŵ:
∂L/∂γ = ⟨G, w̃⟩ and ∂L/∂w = (γ/s)(G − mean(G) − w̃⟨G, w̃⟩·[‖w − μ‖² ≥ eps]).
"""

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.models.layers import WSConv2d, same_padding
from dpvision.per_example.layers.base import (
    Call,
    Strategy,
    float32_calls,
    register_rule,
    sq_rows,
    trainable,
)
from dpvision.per_example.layers.dense import DenseTerms, DenseView, Im2colGhost, PixelGhost


class WSConvView(DenseView):
    """How a WSConv2d sees its calls: a convolution with its own padding and geometry."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.is_conv = True

    def padded(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        module = self.module
        assert isinstance(module, WSConv2d)
        if module.padding == "same":
            top, bottom = same_padding(x.shape[-2], module.kernel_size, module.stride)
            left, right = same_padding(x.shape[-1], module.kernel_size, module.stride)
            if top == bottom and left == right:
                return x, (top, left)
            return F.pad(x, (left, right, top, bottom)), (0, 0)
        return x, (module.padding, module.padding)

    def geometry(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        module = self.module
        assert isinstance(module, WSConv2d)
        k, s = module.kernel_size, module.stride
        return (k, k), (s, s), (1, 1)


@register_rule(WSConv2d, low_precision=True)
class WSConvTerms(DenseTerms):
    """WSConv2d layers: the raw weight's and the gain's per-example gradients.

    With materialised rows, :attr:`per_example` holds the raw weight's per-example gradients
    (already mapped); on the ghost paths the weight's norm is the bound (γₒ/sₒ)‖Gₒ‖.
    """

    view = WSConvView

    def __init__(self, module: nn.Module, calls: list[Call], views: int, strategy: Strategy):
        assert isinstance(module, WSConv2d)
        self.ws = module
        self.train_gain = trainable(module.gain)
        # The per-example gain gradients (B, p), read by both the norms and the sum.
        self.gain_rows: torch.Tensor | None = None
        self.mapped = False  # whether per_example holds the raw weight's gradients
        super().__init__(module, calls, views, strategy)

    def _ghost_extra_cost(self, product: int) -> int:
        return product  # ⟨Gₒ, w̃ₒ⟩ needs aₜ·w̃ₒ: a product or a convolution

    def _weight_terms_needed(self) -> bool:
        return self.train_weight or self.train_gain

    # --- weight standardisation ------------------------------------------------------
    def _standardisation(
        self, natural: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w̃ (p, d), γ/s (p,) and whether the variance term is live (p,).

        ŵ = γ·w̃ with w̃ = (w − μ)/s and s = sqrt(max(‖w − μ‖², eps)). For G = ∂L/∂ŵ:
        ∂L/∂γ = ⟨G, w̃⟩ and ∂L/∂w = (γ/s)(G − mean(G) − w̃⟨G, w̃⟩·[‖w − μ‖² ≥ eps]);
        below eps, s is a constant and only the mean is projected out.
        """
        ws = self.ws
        with torch.no_grad():
            w = ws.weight.reshape(len(ws.weight), -1) if natural else self.dense.matrix(ws.weight)
            centred = w - w.mean(1, keepdim=True)
            energy = centred.pow(2).sum(1)  # fan_in · var
            s = energy.clamp(min=ws.eps).sqrt()
            return centred / s[:, None], ws.gain.reshape(-1) / s, energy >= ws.eps

    def _map_ws(self, grad_hat: torch.Tensor, natural: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(…, p, d) gradients w.r.t. ŵ → (gradients w.r.t. w, w.r.t. γ (…, p)), in the
        weight's own order if ``natural``, else im2col order."""
        tilde, ratio, live = self._standardisation(natural)
        gain = (grad_hat * tilde).sum(-1)
        centred = grad_hat - grad_hat.mean(-1, keepdim=True)
        weight = ratio[:, None] * (centred - tilde * (gain * live)[..., None])
        return weight, gain

    def _map_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_map_ws` of per-example (B, p, d) gradients, in place (``rows`` is this
        rule's own tensor) and without temporaries of that size."""
        tilde, ratio, live = self._standardisation(self.natural)
        gain = torch.einsum("bpd,pd->bp", rows, tilde)
        rows.sub_(rows.mean(-1, keepdim=True))
        rows.addcmul_(tilde, (gain * live)[..., None], value=-1.0)
        rows.mul_(ratio[:, None])
        return rows, gain

    # --- the norms ---------------------------------------------------------------------
    def _materialised_sq(self, per_example: torch.Tensor) -> torch.Tensor:
        # Each example's gradients of the raw weight and of the gain, formed once: their
        # norms and, in clipped_sum, their clipped sums read these very rows (a norm by
        # ‖G‖² − d·mean² − ⟨G, w̃⟩² cancels, and could miss what the mapped sum adds).
        weight_rows, self.gain_rows = self._map_rows(float32_calls(per_example))
        self.per_example = weight_rows if self.train_weight else None
        self.mapped = True
        sq = sq_rows(weight_rows) if self.train_weight else weight_rows.new_zeros(len(weight_rows))
        return sq + sq_rows(self.gain_rows) if self.train_gain else sq

    def _ghost_sq(self, source: Im2colGhost | PixelGhost) -> torch.Tensor:
        g = source.g
        tilde, ratio, _ = self._standardisation(natural=isinstance(source, PixelGhost))
        gain = torch.einsum("btp,btp->bp", g, self._project(source, tilde))  # ⟨Gₒ, w̃ₒ⟩
        self.gain_rows = gain  # the gain's per-example gradients: its sum reads them too
        sq = g.new_zeros(g.shape[0])
        if self.train_weight:
            # An upper bound, ‖∂wₒ‖ ≤ (γₒ/sₒ)‖Gₒ‖: the projection off 1 and w̃ₒ only shrinks.
            # The exact ‖Gₒ‖² − d·mean(Gₒ)² − ⟨Gₒ, w̃ₒ⟩² cancels in float32: a patch α·1 + ρ·v
            # (v ⟂ 1, w̃; the weights are public) made it 0 while the mapped sum added 400 C.
            # With the bound, an example whose gradient lies mostly along 1 or w̃ₒ is clipped
            # more than it needs; the mapped sum adds at most C.
            sq = sq + source.sq_norms(g * ratio)
        return sq + gain.pow(2).sum(1) if self.train_gain else sq

    def _project(self, source: Im2colGhost | PixelGhost, tilde: torch.Tensor) -> torch.Tensor:
        """(B, T, p) aₜ·w̃ₒ from the recorded input: a product with the im2col rows, or a
        convolution of the pixels with w̃."""
        if isinstance(source, Im2colGhost):
            return source.project(tilde)
        return source.convolve(tilde.reshape(self.ws.weight.shape))

    # --- the clipped sum ---------------------------------------------------------------
    def clipped_sum(
        self, scale: torch.Tensor, drop: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        out = self._bias_sum(scale, drop)
        if self.gain_rows is not None and self.train_gain:
            rows = self.gain_rows if drop is None else self.gain_rows.masked_fill(drop[:, None], 0)
            out["gain"] = (scale.to(rows.dtype) @ rows).reshape(self.ws.gain.shape)
        if not self.train_weight:
            return out
        grad_hat, natural = self._weight_sum(scale, drop)
        if not self.mapped:  # gradients of ŵ: map them to the raw weight
            grad_hat = self._map_ws(grad_hat, natural)[0]
        out["weight"] = self._unmatrix(grad_hat, natural)
        return out
