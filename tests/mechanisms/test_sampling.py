"""Poisson sampling: batch sizes are Binomial(n, q), inclusion is independent and uniform."""

import numpy as np
import pytest
from scipy import stats

from dpvision.errors import DPVisionError
from dpvision.mechanisms import PoissonSampler

N, Q, STEPS = 2000, 0.01, 4000


def _sizes(sampler) -> np.ndarray:
    return np.array([len(batch) for batch in sampler])


def _binomial_chi2_pvalue(sizes: np.ndarray, n: int, q: float) -> float:
    """χ² goodness of fit of the batch sizes to Binomial(n, q), tails pooled."""
    low, high = stats.binom.ppf([0.001, 0.999], n, q).astype(int)
    edges = np.arange(low, high + 1)
    observed = np.array(
        [(sizes <= low).sum(), *[(sizes == k).sum() for k in edges[1:-1]], (sizes >= high).sum()]
    )
    probs = np.array(
        [
            stats.binom.cdf(low, n, q),
            *[stats.binom.pmf(k, n, q) for k in edges[1:-1]],
            stats.binom.sf(high - 1, n, q),
        ]
    )
    return float(stats.chisquare(observed, probs / probs.sum() * len(sizes)).pvalue)


def test_batch_sizes_have_binomial_mean_variance_and_shape():
    sizes = _sizes(PoissonSampler(num_examples=N, sample_rate=Q, steps=STEPS, seed=1))
    assert sizes.mean() == pytest.approx(N * Q, rel=0.03)
    assert sizes.var() == pytest.approx(N * Q * (1 - Q), rel=0.1)
    assert _binomial_chi2_pvalue(sizes, N, Q) > 1e-3


def test_the_chi2_test_rejects_fixed_size_batches():
    # Shuffled fixed-size batches (what seeds 003 and 004 actually trained with) would fail.
    fixed = np.full(STEPS, int(N * Q))
    assert _binomial_chi2_pvalue(fixed, N, Q) < 1e-6


def test_every_example_is_included_at_rate_q():
    sampler = PoissonSampler(num_examples=200, sample_rate=0.1, steps=5000, seed=2)
    counts = np.zeros(200)
    for batch in sampler:
        counts[batch] += 1
    # Each count is Binomial(5000, 0.1): mean 500, std ≈ 21.
    assert stats.chisquare(counts).pvalue > 1e-3
    assert abs(counts.mean() - 500) < 5


def test_empty_batches_happen_and_are_yielded():
    sizes = _sizes(PoissonSampler(num_examples=10, sample_rate=0.05, steps=200, seed=0))
    assert (sizes == 0).sum() > 50  # P(empty) = 0.95^10 ≈ 0.60


def test_state_round_trip_resumes_the_same_batches():
    full = [b.tolist() for b in PoissonSampler(num_examples=50, sample_rate=0.2, steps=10, seed=7)]
    first = PoissonSampler(num_examples=50, sample_rate=0.2, steps=10, seed=7)
    head = [next(iter(first)).tolist() for _ in range(4)]
    resumed = PoissonSampler(num_examples=50, sample_rate=0.2, steps=10, seed=999)
    resumed.load_state_dict(first.state_dict())
    assert head + [b.tolist() for b in resumed] == full


def test_full_batch_and_bad_parameters():
    assert len(PoissonSampler(num_examples=5, sample_rate=1.0, steps=1, seed=0).sample()) == 5
    with pytest.raises(DPVisionError):
        PoissonSampler(num_examples=0, sample_rate=0.1, steps=1, seed=0)
    with pytest.raises(DPVisionError):
        PoissonSampler(num_examples=5, sample_rate=0.0, steps=1, seed=0)
