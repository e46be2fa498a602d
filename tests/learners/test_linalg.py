"""The solves on released (noisy) matrices: the Cholesky fast path equals the eigen path."""

import torch

from dpvision.learners.linalg import psd_project, solve_psd, symmetrize


def _eigen_solution(matrix: torch.Tensor, rhs: torch.Tensor, ridge: float) -> torch.Tensor:
    """(P(M) + ridge·I)⁻¹ rhs by the definition: project, add the ridge, solve."""
    d = matrix.shape[-1]
    system = psd_project(matrix) + ridge * torch.eye(d, dtype=matrix.dtype)
    return torch.linalg.solve(system, rhs.unsqueeze(-1)).squeeze(-1)


def _noisy_grams(generator: torch.Generator, d: int = 12) -> torch.Tensor:
    """A batch of Gram matrices plus asymmetric noise: two positive definite, two not."""
    x = torch.randn(4, 3 * d, d, generator=generator, dtype=torch.float64)
    grams = x.transpose(-1, -2) @ x
    noise = torch.randn(4, d, d, generator=generator, dtype=torch.float64)
    return grams + noise * torch.tensor([0.1, 0.1, 40.0, 40.0], dtype=torch.float64)[:, None, None]


def test_both_paths_give_the_projected_ridge_solution():
    generator = torch.Generator().manual_seed(0)
    grams = _noisy_grams(generator)
    rhs = torch.randn(4, 12, generator=generator, dtype=torch.float64)
    definite = torch.linalg.cholesky_ex(symmetrize(grams)).info == 0
    assert definite.tolist() == [True, True, False, False]  # the batch takes both paths
    got = solve_psd(grams, rhs, ridge=0.5)
    assert torch.allclose(got, _eigen_solution(grams, rhs, 0.5), rtol=1e-10, atol=1e-12)


def test_a_single_matrix_and_several_right_hand_sides():
    generator = torch.Generator().manual_seed(1)
    grams = _noisy_grams(generator)
    rhs = torch.randn(12, 3, generator=generator, dtype=torch.float64)
    for matrix in grams:
        got = solve_psd(matrix, rhs, ridge=2.0)
        want = torch.stack([_eigen_solution(matrix, column, 2.0) for column in rhs.T], dim=1)
        assert got.shape == (12, 3)
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_the_input_matrix_is_left_unchanged():
    generator = torch.Generator().manual_seed(2)
    grams = _noisy_grams(generator)
    before = grams.clone()
    solve_psd(grams, torch.ones(4, 12, dtype=torch.float64), ridge=1.0)
    assert torch.equal(grams, before)
