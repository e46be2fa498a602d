"""The clipped sum of book-keeping's layer terms: per-example norms over all layers, the
clip policy's factors, then each layer's weighted sum (exact IEEE float32)."""

from collections.abc import Mapping

import torch

from dpvision.mechanisms.clip_policy import ClipPolicy
from dpvision.mechanisms.clipped_sum import ClippedGradientSum
from dpvision.per_example.layers import LayerTerms
from dpvision.per_example.precision import exact_arithmetic
from dpvision.per_example.tape import UnsupportedError
from dpvision.profiling import phase


def clip_terms(
    terms: list[tuple[str, LayerTerms]],
    params: Mapping[str, torch.Tensor],
    batch: int,
    *,
    policy: ClipPolicy,
    mask: torch.Tensor | None = None,
    grad_scale: float = 1.0,
) -> ClippedGradientSum:
    """Clips with the per-example norms over all layers' terms and sums per parameter.

    Args:
      terms: (layer path, its terms) for every layer that received a gradient.
      params: name → trainable parameter (zeros are returned for those no term covers).
      batch: B, the number of examples.
      policy: the clip norms (:class:`~dpvision.mechanisms.clip_policy.ClipPolicy`); per
        layer, each layer's terms get that layer's own factor min(1, C_g/‖g_{i,g}‖), and a
        layer whose terms span several groups raises
        :class:`~dpvision.per_example.tape.UnsupportedError`.
      mask: optional (B,) booleans; false rows contribute nothing.
      grad_scale: the per-example gradients are ``grad_scale`` times what the terms saw
        (e.g. the batch size, when the output gradients came from a mean-reduced loss).

    The clipped sums are computed under
    :func:`~dpvision.per_example.precision.exact_arithmetic`; the terms' norms must have been
    computed under it too (wrap :func:`~dpvision.per_example.layers.layer_terms` in it), so
    that each cᵢ bounds the contribution the sums actually add.

    Privacy:
      Releases nothing. The result has L2 sensitivity C under add/remove-one: cᵢ = min(1,
      C/‖gᵢ‖) with the norm over all trainable parameters together (the policy's
      sensitivity: √(Σ C_g²) per layer); examples whose norm is not finite, and masked
      examples, get cᵢ = 0 and their rows are zeroed. This holds up to float32 rounding
      when the norms and the sums are both IEEE float32 (see above), not with TF32 or
      reduced-precision products.
    """
    like = next(iter(params.values()), None)
    with exact_arithmetic(None if like is None else like.device):
        return _clip_terms(
            terms,
            params,
            batch,
            policy=policy,
            mask=mask,
            grad_scale=grad_scale,
        )


def _clip_terms(
    terms: list[tuple[str, LayerTerms]],
    params: Mapping[str, torch.Tensor],
    batch: int,
    *,
    policy: ClipPolicy,
    mask: torch.Tensor | None,
    grad_scale: float,
) -> ClippedGradientSum:
    """:func:`clip_terms` inside its exact arithmetic (same arguments and privacy: releases
    nothing; the result has the policy's L2 sensitivity)."""
    like = next(iter(params.values()), None)
    with phase("clip_factors"):
        sq = torch.zeros(batch) if like is None else like.new_zeros(batch)
        for _, layer in terms:
            sq = sq + layer.sq_norms.to(sq.dtype)
        norms = sq.sqrt() * grad_scale
        finite = torch.isfinite(norms)
        keep = finite
        if mask is not None:
            keep = keep & mask.to(device=keep.device, dtype=torch.bool)
        # A layer's group is that of its parameters (its path, per layer).
        keys = [policy.group(f"{path}.") for path, _ in terms]
        factors = policy.factors(
            norms,
            lambda: (
                (key, layer.sq_norms.to(sq.dtype) * grad_scale**2)
                for key, (_, layer) in zip(keys, terms, strict=True)
            ),
            keep,
        )
        scales = [factors[key] for key in keys]
        drop = None if bool(keep.all()) else ~keep
    grads: dict[str, torch.Tensor] = {}
    for (path, layer), scale in zip(terms, scales, strict=True):
        with phase(f"clipped_sum[{layer.kind}]"):
            sums = layer.clipped_sum(scale * grad_scale, drop)
        for local, value in sums.items():
            name = f"{path}.{local}" if path else local
            if policy.group(name) != policy.group(f"{path}."):
                raise UnsupportedError(
                    f"per-layer clipping of {name}: its layer's rule covers parameters of "
                    "several layers"
                )
            grads[name] = value
    for name, param in params.items():
        if name not in grads:
            grads[name] = torch.zeros_like(param)
    return ClippedGradientSum(
        grads={name: grads[name] for name in params},
        l2_sensitivity=policy.l2_sensitivity,
        count=int(keep.sum()),
        nonfinite=int((~finite).sum()),
        norms=norms.detach(),
    )
