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
from collections.abc import Callable
from typing import Any

import torch
from torch.func import functional_call, grad, vmap

from dpvision.mechanisms.clip_policy import ClipPolicy, resolve_policy
from dpvision.mechanisms.clipped_sum import ClippedGradientSum
from dpvision.mechanisms.groups import GroupNorms
from dpvision.per_example.precision import exact_arithmetic


def clipped_gradient_sum(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    max_grad_norm: float | None = None,
    views: bool = False,
    mask: torch.Tensor | None = None,
    precision: torch.dtype | None = None,
    groups: GroupNorms | None = None,
    policy: ClipPolicy | None = None,
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
      groups: group-wise clipping (:mod:`dpvision.mechanisms.groups`): each example's
        gradient restricted to group g is clipped to C_g instead (``max_grad_norm`` unused).
      policy: instead of ``max_grad_norm`` or ``groups``, any
        :class:`~dpvision.mechanisms.clip_policy.ClipPolicy`.

    Privacy:
      Releases nothing by itself. Its output has L2 sensitivity C under add/remove-one
      (each example's contribution is clipped to C), or √(Σ C_g²) with ``groups`` (the
      policy's ``l2_sensitivity``), which is what the caller's noise must be scaled to.
      Non-finite per-example gradients are zeroed and counted, not propagated.
    """
    policy = resolve_policy(max_grad_norm, groups, policy)
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
        policy=policy,
        precision=precision,
    )
    return ClippedGradientSum(
        grads=grads,
        l2_sensitivity=policy.l2_sensitivity,
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
    policy: ClipPolicy,
    precision: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The pure core of :func:`clipped_gradient_sum`, safe to ``vmap`` over stacked models.

    Args:
      model: the module whose ``forward`` is called with ``params`` and ``buffers``.
      loss_fn: as in :func:`clipped_gradient_sum`.
      params: the parameters to call ``model`` with (``torch.func.functional_call``).
      buffers: the buffers to call it with.
      batch: (B, K, ...) inputs, K views per example (K = 1 without augmentation).
      targets: (B,) labels.
      keep: (B,) booleans; examples that are false contribute nothing (not sampled, padding).
      policy: the clip norms (:class:`~dpvision.mechanisms.clip_policy.ClipPolicy`).
      precision: as in :func:`clipped_gradient_sum`.

    Returns:
      (Σᵢ cᵢgᵢ per parameter name, the norms ‖gᵢ‖ (B,), the examples that contributed (B,)).

    Privacy:
      Releases nothing. The sum has the policy's L2 sensitivity under add/remove-one
      (flat: C, cᵢ from :func:`dpvision.mechanisms.clip_factors`, the norm taken over all
      of ``params``; per layer: each group's factor from that group's norm, √(Σ C_g²)). The
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
        part_norms = {
            name: torch.linalg.vector_norm(g.flatten(1), dim=1) for name, g in per_example.items()
        }
        norms = torch.linalg.vector_norm(torch.stack(list(part_norms.values())), dim=0)
        kept = torch.isfinite(norms) & keep
        factors = policy.factors(
            norms,
            lambda: ((policy.group(name), norm.pow(2)) for name, norm in part_norms.items()),
            kept,
        )
        scales = {name: factors[policy.group(name)] for name in per_example}
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
