"""The Gaussian noise helper: its scale is right in both directions (two-sided KS test)."""

import pytest
import torch
from scipy import stats

from dpvision.accounting import PrivacyLedger
from dpvision.errors import DPVisionError
from dpvision.mechanisms import (
    add_gaussian_noise,
    add_symmetric_gaussian_noise_,
    gaussian_noise,
    release_gaussian,
)
from dpvision.mechanisms.noise import STREAM_SIZE, fill_standard_normal

SENSITIVITY, SIGMA = 0.7, 3.0
SCALE = SENSITIVITY * SIGMA


def _noise_sample(n: int = 20000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    zeros = torch.zeros(n, dtype=torch.float64)
    return add_gaussian_noise(
        zeros, l2_sensitivity=SENSITIVITY, noise_multiplier=SIGMA, generator=generator
    )


def _ks_pvalue(sample: torch.Tensor, scale: float) -> float:
    return float(stats.kstest(sample.numpy(), stats.norm(loc=0.0, scale=scale).cdf).pvalue)


def test_noise_passes_ks_at_the_right_scale():
    assert _ks_pvalue(_noise_sample(), SCALE) > 1e-3


@pytest.mark.parametrize("wrong_factor", [0.67, 1.5])
def test_ks_rejects_a_wrong_scale(wrong_factor):
    # If the helper drew noise at 0.67x or 1.5x the right scale, the test above would fail:
    # equivalently, the right-scale sample is rejected against the wrong-scale reference.
    assert _ks_pvalue(_noise_sample(), SCALE * wrong_factor) < 1e-6
    broken = _noise_sample() * wrong_factor
    assert _ks_pvalue(broken, SCALE) < 1e-6


def test_noise_does_not_modify_its_input_and_keeps_dtype():
    value = torch.ones(5, dtype=torch.float32)
    noisy = add_gaussian_noise(value, l2_sensitivity=1.0, noise_multiplier=1.0)
    assert torch.equal(value, torch.ones(5))
    assert noisy.dtype == torch.float32


def test_same_generator_seed_gives_same_noise():
    draw = lambda: gaussian_noise(  # noqa: E731
        (3,), l2_sensitivity=1.0, noise_multiplier=2.0, generator=torch.Generator().manual_seed(7)
    )
    assert torch.equal(draw(), draw())


def test_release_records_what_ran():
    ledger = PrivacyLedger()
    release_gaussian(
        torch.zeros(4),
        l2_sensitivity=2.0,
        noise_multiplier=5.0,
        ledger=ledger,
        released="sum of clipped features",
    )
    (entry,) = ledger.entries
    assert (entry.noise_multiplier, entry.sample_rate, entry.count, entry.l2_sensitivity) == (
        5.0,
        1.0,
        1,
        2.0,
    )


@pytest.mark.parametrize(
    ("sensitivity", "sigma"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (float("inf"), 1.0)]
)
def test_bad_scale_is_an_error(sensitivity, sigma):
    with pytest.raises(DPVisionError):
        add_gaussian_noise(torch.zeros(2), l2_sensitivity=sensitivity, noise_multiplier=sigma)


def test_integer_tensor_is_refused():
    with pytest.raises(DPVisionError, match="floating"):
        add_gaussian_noise(
            torch.zeros(2, dtype=torch.int64), l2_sensitivity=1.0, noise_multiplier=1.0
        )


def _parallel_draw(seed: int, threads: int | None = None) -> torch.Tensor:
    out = torch.empty(3 * STREAM_SIZE + 5, dtype=torch.float64)  # four streams, one short
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return fill_standard_normal(out, torch.Generator().manual_seed(seed)) * SCALE
    finally:
        torch.set_num_threads(before)


def test_parallel_streams_have_the_right_scale_and_are_independent():
    noise = _parallel_draw(0)
    assert _ks_pvalue(noise[::50], SCALE) > 1e-3  # every stream is represented
    assert _ks_pvalue(noise[-20000:], SCALE) > 1e-3  # the short last stream too
    streams = noise[: 3 * STREAM_SIZE].reshape(3, STREAM_SIZE)
    assert abs(float(torch.corrcoef(streams[:, :100000]).triu(1).abs().max())) < 0.02
    assert not torch.equal(streams[0, :10], streams[1, :10])


def test_parallel_streams_are_reproducible_whatever_the_thread_count():
    assert torch.equal(_parallel_draw(7, threads=1), _parallel_draw(7, threads=2))
    assert not torch.equal(_parallel_draw(7)[:100], _parallel_draw(8)[:100])


def test_symmetric_noise_is_the_symmetrised_release_on_the_lower_triangle():
    d, b = 40, 30
    statistic = torch.randn(
        b, d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    statistic = statistic + statistic.transpose(1, 2)
    noisy = add_symmetric_gaussian_noise_(
        statistic.clone(),
        l2_sensitivity=SENSITIVITY,
        noise_multiplier=SIGMA,
        generator=torch.Generator().manual_seed(4),
    )
    upper = torch.ones(d, d, dtype=torch.bool).triu(1)
    assert torch.equal(noisy[:, upper], statistic[:, upper])  # left as it was
    noise = noisy - statistic
    diagonal = noise.diagonal(dim1=1, dim2=2).reshape(-1)
    below = noise[:, upper.T].reshape(-1)
    # Var S_ii = (σΔ)², Var S_ij = (σΔ)²/2: those of (N + Nᵀ)/2 with i.i.d. N(0, (σΔ)²).
    assert _ks_pvalue(diagonal, SCALE) > 1e-3
    assert _ks_pvalue(below, SCALE / 2**0.5) > 1e-3
    assert _ks_pvalue(below, SCALE) < 1e-6  # not the unsymmetrised scale
