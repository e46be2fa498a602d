"""Exact Gaussian (GDP) composition, checked against a high-precision mpmath oracle."""

import math

import mpmath
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpvision.accounting import (
    compose_events,
    gaussian_delta,
    gaussian_epsilon,
    gaussian_event,
    gdp_mu,
)


def _oracle_delta(mu: float, epsilon: float) -> mpmath.mpf:
    with mpmath.workdps(60):
        mu, epsilon = mpmath.mpf(mu), mpmath.mpf(epsilon)
        phi = lambda x: mpmath.ncdf(x)  # noqa: E731
        return phi(-epsilon / mu + mu / 2) - mpmath.exp(epsilon) * phi(-epsilon / mu - mu / 2)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(mu=st.floats(1e-3, 30.0), epsilon=st.floats(0.0, 60.0))
def test_delta_matches_high_precision_oracle(mu, epsilon):
    expected = float(_oracle_delta(mu, epsilon))
    got = gaussian_delta(mu=mu, epsilon=epsilon)
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-300)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(mu=st.floats(1e-3, 20.0), delta=st.sampled_from([1e-3, 1e-5, 1e-6, 8e-7, 1e-10]))
def test_epsilon_is_the_smallest_valid_one(mu, delta):
    epsilon = gaussian_epsilon(mu=mu, delta=delta)
    assert float(_oracle_delta(mu, epsilon)) <= delta * (1 + 1e-9)
    if epsilon > 0:  # slightly less ε would not be valid: the answer is tight
        assert float(_oracle_delta(mu, epsilon * (1 - 1e-6))) > delta


def test_mu_of_a_composition():
    event = compose_events(
        [gaussian_event(noise_multiplier=8.0), gaussian_event(noise_multiplier=2.0, count=100)]
    )
    assert gdp_mu(event) == pytest.approx(math.sqrt(1 / 64 + 100 / 4))


def test_known_value_mu_one():
    # μ = 1 at δ = 1e-5: ε ≈ 4.3772 (same as one Gaussian mechanism with σ = 1).
    assert gaussian_epsilon(mu=1.0, delta=1e-5) == pytest.approx(4.377178, abs=1e-5)
