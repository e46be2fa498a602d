"""Row clipping: the bound every sensitivity in dpvision rests on."""

import math

import pytest
import torch

from dpvision.mechanisms import clip_rows


def test_rows_are_clipped_to_the_bound_and_short_rows_kept():
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [1e30, -1e30]], dtype=torch.float64)
    clipped = clip_rows(x, 1.0)
    norms = torch.linalg.vector_norm(clipped, dim=1)
    assert norms[0] == pytest.approx(1.0)
    assert torch.equal(clipped[1], x[1])
    assert norms[2] == pytest.approx(1.0)


def test_non_finite_rows_become_zero():
    x = torch.tensor([[math.nan, 1.0], [math.inf, 0.0], [1.0, 1.0]], dtype=torch.float64)
    clipped = clip_rows(x, 0.5)
    assert torch.equal(clipped[:2], torch.zeros(2, 2, dtype=torch.float64))
    assert torch.linalg.vector_norm(clipped[2]) == pytest.approx(0.5)


def test_a_finite_row_whose_norm_overflows_contributes_nothing():
    x = torch.tensor([[1e200, 1e200], [3.0, 4.0]], dtype=torch.float64)
    clipped = clip_rows(x, 1.0)
    assert torch.equal(clipped[0], torch.zeros(2, dtype=torch.float64))
    assert torch.allclose(clipped[1], torch.tensor([0.6, 0.8], dtype=torch.float64))


def test_sum_moves_by_at_most_the_bound_when_one_row_is_added():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 7, generator=generator, dtype=torch.float64) * 10
    extra = torch.full((1, 7), 1e8, dtype=torch.float64)
    change = clip_rows(torch.cat([x, extra]), 2.0).sum(0) - clip_rows(x, 2.0).sum(0)
    assert torch.linalg.vector_norm(change) == pytest.approx(2.0)


def test_inplace_clipping_scales_the_given_tensor():
    x = torch.tensor([[3.0, 4.0], [math.nan, 0.0], [0.3, 0.4]], dtype=torch.float64)
    want = clip_rows(x, 1.0)
    got = clip_rows(x, 1.0, inplace=True)
    assert got is x
    assert torch.equal(got, want)
