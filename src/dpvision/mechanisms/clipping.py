"""Clipping: bound each example's contribution, so a sum of contributions has a known
sensitivity.

After :func:`clip_rows`, every row has L2 norm at most C, so adding or removing one example
changes a sum of rows by at most C (and a sum of outer products x̃x̃ᵀ by at most C² in
Frobenius norm).
"""

import torch


def clip_rows(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scales each row to L2 norm at most ``max_norm``: x · min(1, C/‖x‖).

    Rows that are not finite are zeroed (they then contribute nothing, which keeps every
    sensitivity bound valid).
    """
    finite = torch.isfinite(x).all(dim=1, keepdim=True)
    x = torch.where(finite, x, torch.zeros_like(x))
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    return x * torch.clamp(max_norm / norms.clamp_min(1e-30), max=1.0)
