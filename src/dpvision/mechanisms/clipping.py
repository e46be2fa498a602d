"""Clipping: bound each example's contribution, so a sum of contributions has a known
sensitivity.

After :func:`clip_rows`, every row has L2 norm at most C, so adding or removing one example
changes a sum of rows by at most C (and a sum of outer products x̃x̃ᵀ by at most C² in
Frobenius norm).
"""

import torch


def clip_factors(
    norms: torch.Tensor, max_norm: float, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """The per-example scales cᵢ = min(1, C/‖gᵢ‖) that bound each contribution cᵢgᵢ by C.

    This is dpvision's one clipping rule: every path that clips (rows of features, per-example
    gradients by ``torch.func`` or by book-keeping, the linear head) calls it. Examples whose
    norm is not finite, and those where ``keep`` is false, get cᵢ = 0 (they then contribute
    nothing, which keeps every sensitivity bound valid).

    >>> clip_factors(torch.tensor([0.5, 2.0, float("nan")]), 1.0)
    tensor([1.0000, 0.5000, 0.0000])
    """
    finite = torch.isfinite(norms)
    if keep is not None:
        finite = finite & keep.to(device=norms.device, dtype=torch.bool)
    scale = torch.clamp(max_norm / norms.clamp_min(1e-30), max=1.0)
    return torch.where(finite, scale, torch.zeros_like(scale))


def clip_rows(x: torch.Tensor, max_norm: float, *, inplace: bool = False) -> torch.Tensor:
    """Scales each row to L2 norm at most ``max_norm``: x · min(1, C/‖x‖).

    Rows that are not finite are zeroed (they then contribute nothing, which keeps every
    sensitivity bound valid). With ``inplace``, ``x`` itself is scaled and returned (saves
    a copy of a chunk the caller owns).
    """
    # A row with a non-finite entry has a non-finite norm, so one pass for the norms and one
    # for the product suffice; such rows (rare) are then zeroed, since NaN·0 is NaN.
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    factors = clip_factors(norms, max_norm)
    clipped = x.mul_(factors) if inplace else x * factors
    finite = torch.isfinite(norms)
    if not bool(finite.all()):
        clipped.masked_fill_(~finite, 0.0)
    return clipped
