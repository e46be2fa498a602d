"""Numerically stable linear algebra on noisy (released) matrices.

Everything here is post-processing of already-privatised statistics: it costs no privacy.
"""

import torch


def symmetrize(matrix: torch.Tensor) -> torch.Tensor:
    """(M + Mᵀ)/2 over the last two dimensions.

    Applied to a symmetric statistic plus i.i.d. Gaussian noise, this keeps the statistic and
    halves the variance of the off-diagonal noise (post-processing, free).
    """
    return (matrix + matrix.transpose(-1, -2)) / 2


def psd_project(matrix: torch.Tensor) -> torch.Tensor:
    """The nearest (Frobenius) positive semi-definite matrix: eigenvalues clamped at 0.

    As in the public code of Mehta et al. (`*_sanitizer.py`), applied to noisy Gram matrices,
    whose noise can make them indefinite.
    """
    eigenvalues, eigenvectors = torch.linalg.eigh(symmetrize(matrix))
    return (eigenvectors * eigenvalues.clamp_min(0).unsqueeze(-2)) @ eigenvectors.transpose(-1, -2)


def solve_psd(matrix: torch.Tensor, rhs: torch.Tensor, *, ridge: float) -> torch.Tensor:
    """Solves (P(M) + ridge·I) x = rhs, with P the PSD projection, via one eigendecomposition.

    With ridge > 0 the system is positive definite whatever the noise in ``matrix``, so the
    solve never fails and its conditioning is bounded by (λ_max + ridge)/ridge.

    Args:
      matrix: (..., d, d) symmetric up to noise.
      rhs: (..., d) or (..., d, k).
      ridge: λ ≥ 0 added after the projection (must be > 0 unless the matrix is well posed).
    """
    eigenvalues, eigenvectors = torch.linalg.eigh(symmetrize(matrix))
    inverse = 1.0 / (eigenvalues.clamp_min(0) + ridge)
    vector = rhs.dim() == matrix.dim() - 1
    right = rhs.unsqueeze(-1) if vector else rhs
    solution = eigenvectors @ (inverse.unsqueeze(-1) * (eigenvectors.transpose(-1, -2) @ right))
    return solution.squeeze(-1) if vector else solution
