"""Numerically stable linear algebra on noisy (released) matrices.

Everything here is post-processing of already-privatised statistics: it costs no privacy.
"""

import torch


def symmetrize(matrix: torch.Tensor) -> torch.Tensor:
    """(M + Mᵀ)/2 over the last two dimensions.

    Applied to a symmetric statistic plus i.i.d. Gaussian noise, this keeps the statistic and
    halves the variance of the off-diagonal noise (post-processing, free).
    """
    return matrix.transpose(-1, -2).add(matrix).mul_(0.5)  # one new tensor, not two


def psd_project(matrix: torch.Tensor) -> torch.Tensor:
    """The nearest (Frobenius) positive semi-definite matrix: eigenvalues clamped at 0.

    As in the public code of Mehta et al. (`*_sanitizer.py`), applied to noisy Gram matrices,
    whose noise can make them indefinite.
    """
    eigenvalues, eigenvectors = torch.linalg.eigh(symmetrize(matrix))
    return (eigenvectors * eigenvalues.clamp_min(0).unsqueeze(-2)) @ eigenvectors.transpose(-1, -2)


def _cholesky_solve(factor: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """x with L Lᵀ x = rhs, by two triangular solves (on the CPU, ``torch.cholesky_solve``
    copies each factor first and took 30 times as long for one right-hand side, d = 768)."""
    half = torch.linalg.solve_triangular(factor, rhs, upper=False)
    return torch.linalg.solve_triangular(factor.transpose(-1, -2), half, upper=True)


def solve_psd(
    matrix: torch.Tensor, rhs: torch.Tensor, *, ridge: float, overwrite_matrix: bool = False
) -> torch.Tensor:
    """Solves (P(M) + ridge·I) x = rhs, with M the symmetrised ``matrix`` and P the PSD
    projection.

    With ridge > 0 the system is positive definite whatever the noise in ``matrix``, so the
    solve never fails and its conditioning is bounded by (λ_max + ridge)/ridge.

    Both the Cholesky factorisation and the eigendecomposition read the lower triangle
    only. Where M is positive definite (its Cholesky factorisation succeeds), P(M) = M and one
    Cholesky solve of M + ridge·I gives the solution, several times faster than an
    eigendecomposition; the other matrices of a batch are solved through their eigenvalues,
    clamped at 0. Both paths compute the same x up to rounding.

    Args:
      matrix: (..., d, d) symmetric up to noise.
      rhs: (..., d) or (..., d, k).
      ridge: λ ≥ 0 added after the projection (must be > 0 unless the matrix is well posed).
      overwrite_matrix: the lower triangles of ``matrix`` hold the symmetric matrices (their
        strict upper triangles are never read) and ``matrix`` may be overwritten, which
        saves a symmetrised copy (as SciPy's ``overwrite_a`` saves one).
    """
    vector = rhs.dim() == matrix.dim() - 1
    right = rhs.unsqueeze(-1) if vector else rhs
    d, k = matrix.shape[-1], right.shape[-1]
    batch = matrix.shape[:-2]
    sym = (matrix if overwrite_matrix else symmetrize(matrix)).reshape(-1, d, d)
    right = right.expand(*batch, d, k).reshape(-1, d, k)
    factor, info = torch.linalg.cholesky_ex(sym)
    definite = info == 0
    if bool(definite.all()):  # the common case at scale: all in place, no eigenvalues
        sym.diagonal(dim1=-2, dim2=-1).add_(ridge)
        solution = _cholesky_solve(torch.linalg.cholesky(sym, out=factor), right)
    else:
        solution = torch.empty_like(right, dtype=torch.result_type(sym, right))
        rest = ~definite
        eigenvalues, eigenvectors = torch.linalg.eigh(sym[rest])
        inverse = 1.0 / (eigenvalues.clamp_min(0) + ridge)
        solution[rest] = eigenvectors @ (
            inverse.unsqueeze(-1) * (eigenvectors.transpose(-1, -2) @ right[rest])
        )
        if bool(definite.any()):
            shifted = sym[definite]
            shifted.diagonal(dim1=-2, dim2=-1).add_(ridge)
            solution[definite] = _cholesky_solve(torch.linalg.cholesky(shifted), right[definite])
    solution = solution.reshape(*batch, d, k)
    return solution.squeeze(-1) if vector else solution
