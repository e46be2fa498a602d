"""Per-example gradients with ``torch.func``, clipped and summed.

For a batch of B examples, each with K augmented views (augmentation multiplicity, De et
al. §3.1), example i's gradient is the *average* of its K view-gradients, gᵢ = ∇(1/K Σₖ ℓ),
and it is clipped as a whole: cᵢ = min(1, C/‖gᵢ‖), the norm taken over all trainable
parameters together. The sum Σᵢ cᵢgᵢ then changes by at most C when one example is added
or removed, whatever the model, the data or K.

This is the reference path: it materialises every gᵢ with ``vmap(grad(...))`` (B × number
of parameters memory). Faster norm-only paths must agree with it.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.func import functional_call, grad, vmap

from dpvision.errors import DPVisionError


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


def clipped_gradient_sum(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    max_grad_norm: float,
    views: bool = False,
    mask: torch.Tensor | None = None,
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

    Privacy:
      Releases nothing by itself. Its output has L2 sensitivity C under add/remove-one
      (each example's contribution is clipped to C), which is what the caller's noise must
      be scaled to. Non-finite per-example gradients are zeroed and counted, not
      propagated.
    """
    if not max_grad_norm > 0:
        raise DPVisionError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    batch = inputs if views else inputs.unsqueeze(1)

    def example_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (x,))
        return loss_fn(out, y.expand(x.shape[0])).mean()  # mean over the K views

    per_example = vmap(grad(example_loss), in_dims=(None, 0, 0))(params, batch, targets)
    squares = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_example.values()]).sum(0)
    norms = squares.sqrt()
    finite = torch.isfinite(norms)
    keep = finite if mask is None else finite & mask.to(torch.bool)
    scale = torch.where(
        keep, (max_grad_norm / norms.clamp_min(1e-12)).clamp(max=1.0), torch.zeros_like(norms)
    )
    grads = {}
    for name, g in per_example.items():
        g = torch.where(keep.view(-1, *[1] * (g.dim() - 1)), g, torch.zeros_like(g))
        grads[name] = torch.tensordot(scale.to(g.dtype), g, dims=1)
    return ClippedGradientSum(
        grads=grads,
        l2_sensitivity=float(max_grad_norm),
        count=int(keep.sum()),
        nonfinite=int((~finite).sum()),
        norms=norms.detach(),
    )
