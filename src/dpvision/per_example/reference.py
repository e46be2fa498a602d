"""Per-example gradients with ``torch.func``, clipped and summed.

For a batch of B examples, each with K augmented views (augmentation multiplicity, De et
al. §3.1), example i's gradient is the *average* of its K view-gradients, gᵢ = ∇(1/K Σₖ ℓ),
and it is clipped as a whole: cᵢ = min(1, C/‖gᵢ‖), the norm taken over all trainable
parameters together. The sum Σᵢ cᵢgᵢ then changes by at most C when one example is added
or removed, whatever the model, the data or K.

This is the reference path: it materialises every gᵢ with ``vmap(grad(...))`` (B × number
of parameters memory). Faster norm-only paths must agree with it.
"""

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call, grad, vmap

from dpvision.errors import DPVisionError
from dpvision.mechanisms import clipping
from dpvision.per_example.groups import GroupNorms, group_of
from dpvision.per_example.precision import exact_arithmetic


@dataclass
class ClippedGradientSum:
    """Σᵢ clip(gᵢ, C) per parameter name, with what the privacy argument needs to know.

    Attributes:
      grads: parameter name → summed clipped gradient (the parameter's shape).
      l2_sensitivity: C; adding or removing one example moves ``grads`` (all parameters
        together) by at most this much in L2 norm.
      count: examples that contributed (mask true).
      nonfinite: examples whose gradient was not finite; they contribute zero.
      norms: the per-example gradient norms before clipping (B,), for diagnostics.
    """

    grads: dict[str, torch.Tensor]
    l2_sensitivity: float
    count: int
    nonfinite: int
    norms: torch.Tensor

    @classmethod
    def zeros(
        cls, params: Mapping[str, torch.Tensor], *, l2_sensitivity: float
    ) -> "ClippedGradientSum":
        """The empty sum over ``params`` (name → parameter), of the sensitivity its parts
        will state: what physical micro-batches are accumulated into."""
        like = next(iter(params.values()), None)
        return cls(
            grads={name: torch.zeros_like(p) for name, p in params.items()},
            l2_sensitivity=float(l2_sensitivity),
            count=0,
            nonfinite=0,
            norms=torch.zeros(0) if like is None else like.new_zeros(0),
        )

    def add_(self, other: "ClippedGradientSum") -> None:
        """Adds the clipped sum of other examples (disjoint from these) in place.

        Raises:
          DPVisionError: ``other`` states another sensitivity: the total's would be
            neither, and noise scaled to one of them would be wrong.
        """
        if other.l2_sensitivity != self.l2_sensitivity:
            raise DPVisionError(
                f"cannot add a clipped sum of sensitivity {other.l2_sensitivity:g} to one of "
                f"{self.l2_sensitivity:g}"
            )
        for name, value in other.grads.items():
            self.grads[name] += value
        self.count += other.count
        self.nonfinite += other.nonfinite
        self.norms = torch.cat([self.norms, other.norms.to(self.norms)])


def clipped_gradient_sum(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    max_grad_norm: float,
    views: bool = False,
    mask: torch.Tensor | None = None,
    precision: torch.dtype | None = None,
    groups: GroupNorms | None = None,
) -> ClippedGradientSum:
    """Clips each example's gradient to ``max_grad_norm`` and sums them.

    Args:
      model: any module built from layers that treat examples independently (no BatchNorm).
      loss_fn: ``loss_fn(outputs, targets)`` with reduction "none" or "mean" over the views of
        one example (it is called once per example, on its K views).
      inputs: (B, ...) or, with ``views=True``, (B, K, ...) augmented views.
      targets: (B,) labels (each example's label is shared by its views).
      max_grad_norm: C > 0.
      views: whether ``inputs`` carries a view dimension K.
      mask: optional (B,) booleans; rows that are false (padding) contribute nothing.
      precision: None, or the autocast dtype of the model's forward (and so backward) pass;
        the loss, the norms, the clip factors and the sum are float32 either way (IEEE
        float32: :func:`~dpvision.per_example.precision.exact_arithmetic`).
      groups: group-wise clipping (:mod:`dpvision.per_example.groups`): each example's
        gradient restricted to group g is clipped to C_g instead (``max_grad_norm`` unused).

    Privacy:
      Releases nothing by itself. Its output has L2 sensitivity C under add/remove-one
      (each example's contribution is clipped to C), or √(Σ C_g²) with ``groups``, which is
      what the caller's noise must be scaled to. Non-finite per-example gradients are
      zeroed and counted, not propagated.
    """
    if not max_grad_norm > 0:
        raise DPVisionError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    batch = inputs if views else inputs.unsqueeze(1)
    keep = (
        torch.ones(len(batch), dtype=torch.bool, device=inputs.device)
        if mask is None
        else mask.to(device=inputs.device, dtype=torch.bool)
    )
    grads, norms, kept = functional_clipped_sum(
        model,
        loss_fn,
        params,
        buffers,
        batch,
        targets,
        keep,
        max_grad_norm=max_grad_norm,
        precision=precision,
        groups=groups,
    )
    return ClippedGradientSum(
        grads=grads,
        l2_sensitivity=float(max_grad_norm) if groups is None else groups.l2_sensitivity,
        count=int(kept.sum()),
        nonfinite=int((~torch.isfinite(norms)).sum()),
        norms=norms.detach(),
    )


def functional_clipped_sum(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    batch: torch.Tensor,
    targets: torch.Tensor,
    keep: torch.Tensor,
    *,
    max_grad_norm: float,
    precision: torch.dtype | None = None,
    groups: GroupNorms | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The pure core of :func:`clipped_gradient_sum`, safe to ``vmap`` over stacked models.

    Args:
      model: the module whose ``forward`` is called with ``params`` and ``buffers``.
      loss_fn: as in :func:`clipped_gradient_sum`.
      params, buffers: the tensors to call ``model`` with (``torch.func.functional_call``).
      batch: (B, K, ...) inputs, K views per example (K = 1 without augmentation).
      targets: (B,) labels.
      keep: (B,) booleans; examples that are false contribute nothing (not sampled, padding).
      max_grad_norm: C.
      precision: as in :func:`clipped_gradient_sum`.

    Returns:
      (Σᵢ cᵢgᵢ per parameter name, the norms ‖gᵢ‖ (B,), the examples that contributed (B,)).

    Privacy:
      Releases nothing. The sum has L2 sensitivity C under add/remove-one: cᵢ comes from
      :func:`dpvision.mechanisms.clip_factors`, the norm taken over all of ``params``; with
      ``groups``, each group's factor from that group's norm, sensitivity √(Σ C_g²). The
      norms and the sum are computed under
      :func:`~dpvision.per_example.precision.exact_arithmetic`, the sum as products and a
      sum over rows (no matrix product that TF32 could round), so cᵢ bounds what the sum
      adds up to float32 rounding whatever the caller's TF32 and autocast settings.
    """

    def example_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(x.device, precision):  # the forward alone in the low precision
            out = functional_call(model, (p, buffers), (x,))
        if precision is not None:
            out = out.float()
        return loss_fn(out, y.expand(x.shape[0])).mean()  # mean over the K views

    per_example = vmap(grad(example_loss), in_dims=(None, 0, 0))(params, batch, targets)
    # Under autocast a gradient may come back in the low precision: upcast it (exactly) to
    # its parameter's dtype, so that its norm and the clipped sum are taken in float32.
    per_example = {k: g.to(params[k].dtype) for k, g in per_example.items()}
    # The norms and the sum in IEEE float32 whatever the user's TF32, matmul-precision and
    # autocast settings (dpvision.per_example.precision).
    with exact_arithmetic(batch.device):
        norms = torch.linalg.vector_norm(
            torch.stack(
                [torch.linalg.vector_norm(g.flatten(1), dim=1) for g in per_example.values()]
            ),
            dim=0,
        )
        kept = torch.isfinite(norms) & keep
        if groups is None:
            scales = {
                name: clipping.clip_factors(norms, max_grad_norm, keep) for name in per_example
            }
        else:
            sq: dict[str, torch.Tensor] = {}
            for name, g in per_example.items():
                part = torch.linalg.vector_norm(g.flatten(1), dim=1).pow(2)
                sq[group_of(name)] = sq[group_of(name)] + part if group_of(name) in sq else part
            factors = groups.factors(sq, kept)
            scales = {name: factors[group_of(name)] for name in per_example}
        grads = {}
        for name, g in per_example.items():
            shape = (-1, *[1] * (g.dim() - 1))
            # Rows with cᵢ = 0 may hold NaN or inf, which 0 · x would propagate: zero them first.
            g = torch.where(kept.view(shape), g, 0.0)
            # Products and a sum over the rows, not a matrix product: no kernel rounds gᵢ
            # (TF32) otherwise than the gᵢ its norm was taken of.
            grads[name] = g.mul_(scales[name].to(g.dtype).view(shape)).sum(0)
    return grads, norms, kept


def autocast(device: torch.device, precision: torch.dtype | None) -> Any:
    """Autocast to ``precision`` on ``device``'s kind, or nothing (float32)."""
    if precision is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision)
