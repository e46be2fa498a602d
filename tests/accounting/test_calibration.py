"""Calibration round trips: noise (or steps) then epsilon lands at or just under the target."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpvision.accounting import (
    MAX_NOISE_MULTIPLIER,
    calibrate_noise_multiplier,
    calibrate_steps,
    compose_events,
    compute_epsilon,
    gaussian_event,
    poisson_gaussian_event,
)
from dpvision.errors import DPVisionError

_GRID = {
    "target_epsilon": st.floats(0.05, 10.0),
    "delta": st.sampled_from([1e-5, 1e-6, 8e-7]),
    "sample_rate": st.sampled_from([1.0, 0.08, 0.001]),
    "steps": st.sampled_from([1, 100, 5000]),
}


def _round_trip(accountant, target_epsilon, delta, sample_rate, steps):
    sigma = calibrate_noise_multiplier(
        target_epsilon=target_epsilon,
        target_delta=delta,
        sample_rate=sample_rate,
        steps=steps,
        accountant=accountant,
    )
    event = poisson_gaussian_event(noise_multiplier=sigma, sample_rate=sample_rate, steps=steps)
    epsilon = compute_epsilon(event, delta=delta, accountant=accountant)
    assert epsilon <= target_epsilon
    assert epsilon >= 0.99 * target_epsilon


@pytest.mark.parametrize("accountant", ["rdp", "classic-rdp"])
@settings(max_examples=10, deadline=None, derandomize=True)  # 100 each in the slow test below
@given(**_GRID)
def test_round_trip_rdp_family(accountant, target_epsilon, delta, sample_rate, steps):
    _round_trip(accountant, target_epsilon, delta, sample_rate, steps)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(target_epsilon=_GRID["target_epsilon"], delta=_GRID["delta"], steps=_GRID["steps"])
def test_round_trip_gaussian(target_epsilon, delta, steps):
    _round_trip("gaussian", target_epsilon, delta, 1.0, steps)


@pytest.mark.slow  # the grid's corners below run by default; 100 draws in the extended test
@settings(max_examples=3, deadline=None, derandomize=True)
@given(**_GRID)
def test_round_trip_pld(target_epsilon, delta, sample_rate, steps):
    _round_trip("pld", target_epsilon, delta, sample_rate, steps)


@pytest.mark.full
@pytest.mark.parametrize("accountant", ["pld", "rdp", "classic-rdp"])
@settings(max_examples=100, deadline=None, derandomize=True)
@given(**_GRID)
def test_round_trip_extended(accountant, target_epsilon, delta, sample_rate, steps):
    _round_trip(accountant, target_epsilon, delta, sample_rate, steps)


@pytest.mark.parametrize(
    ("target_epsilon", "delta", "sample_rate", "steps"),
    [
        (0.05, 8e-7, 1.0, 5000),
        (0.05, 1e-6, 0.001, 1),
        (10.0, 1e-5, 0.001, 5000),
        (10.0, 1e-5, 0.08, 100),
        (0.05, 8e-7, 0.08, 5000),
    ],
)
def test_round_trip_pld_grid_corners(target_epsilon, delta, sample_rate, steps):
    _round_trip("pld", target_epsilon, delta, sample_rate, steps)


def test_reproduces_seed_004_noise_multiplier():
    sigma = calibrate_noise_multiplier(
        target_epsilon=3.0,
        target_delta=1e-5,
        sample_rate=8192 / 60000,
        steps=7 * 40,
        accountant="classic-rdp",
    )
    assert sigma == pytest.approx(4.05, abs=0.01)  # ScatterNet+linear on Fashion-MNIST


def test_preceding_event_counts_against_the_budget():
    prior = gaussian_event(noise_multiplier=8.0)  # e.g. private normalisation statistics
    common = {
        "target_epsilon": 2.0,
        "target_delta": 1e-5,
        "sample_rate": 0.05,
        "steps": 200,
        "accountant": "pld",
    }
    sigma_alone = calibrate_noise_multiplier(**common)
    sigma_after = calibrate_noise_multiplier(**common, preceding_event=prior)
    assert sigma_after > sigma_alone
    total = compose_events(
        [prior, poisson_gaussian_event(noise_multiplier=sigma_after, sample_rate=0.05, steps=200)]
    )
    assert 0.99 * 2.0 <= compute_epsilon(total, delta=1e-5, accountant="pld") <= 2.0


@pytest.mark.parametrize("accountant", ["pld", "rdp", "gaussian", "classic-rdp"])
def test_unreachable_target_is_a_clear_error(accountant):
    # Regression: RDP once returned σ = 10⁴ (ε = 0.6) here instead of refusing.
    with pytest.raises(DPVisionError, match=f"no noise multiplier up to {MAX_NOISE_MULTIPLIER:g}"):
        calibrate_noise_multiplier(
            target_epsilon=1e-4,
            target_delta=1e-10,
            sample_rate=1.0,
            steps=10**6,
            accountant=accountant,
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_epsilon": 0.0}, "target_epsilon must be > 0"),
        ({"target_epsilon": -1.0}, "target_epsilon must be > 0"),
        ({"target_delta": 1.0}, "target_delta must be in"),
        ({"sample_rate": 0.0}, "sample_rate must be in"),
        ({"sample_rate": 1.5}, "sample_rate must be in"),
        ({"steps": 0}, "steps must be >= 1"),
        ({"steps": 2.5}, "whole number"),
    ],
)
def test_bad_parameters(kwargs, message):
    params = {"target_epsilon": 1.0, "target_delta": 1e-5, "sample_rate": 0.1, "steps": 10}
    with pytest.raises(DPVisionError, match=message):
        calibrate_noise_multiplier(**{**params, **kwargs})


@pytest.mark.parametrize("accountant", ["pld", "rdp", "classic-rdp"])
def test_steps_is_the_largest_count_within_budget(accountant):
    kwargs = {"noise_multiplier": 1.5, "sample_rate": 0.01}
    steps = calibrate_steps(target_epsilon=2.0, target_delta=1e-5, accountant=accountant, **kwargs)

    def eps(t):
        return compute_epsilon(
            poisson_gaussian_event(steps=t, **kwargs), delta=1e-5, accountant=accountant
        )

    assert eps(steps) <= 2.0 < eps(steps + 1)


def test_steps_with_one_step_over_budget_is_an_error():
    with pytest.raises(DPVisionError, match="a single step"):
        calibrate_steps(
            target_epsilon=0.1, target_delta=1e-5, noise_multiplier=0.5, sample_rate=1.0
        )


def test_a_repeated_calibration_is_answered_from_the_cache(monkeypatch):
    from dpvision.accounting import calibration

    calls = []
    honest = calibration._calibrate
    monkeypatch.setattr(calibration, "_SOLVED", calibration.OrderedDict())
    monkeypatch.setattr(
        calibration, "_calibrate", lambda *a, **k: calls.append(a) or honest(*a, **k)
    )
    common = {"target_delta": 1e-5, "sample_rate": 0.01, "steps": 300, "accountant": "pld"}
    first = calibrate_noise_multiplier(target_epsilon=2.0, **common)
    assert calibrate_noise_multiplier(target_epsilon=2.0, **common) == first
    assert len(calls) == 1
    # any argument that changes the answer is part of the key, the preceding event included
    prior = gaussian_event(noise_multiplier=8.0)
    after = calibrate_noise_multiplier(target_epsilon=2.0, preceding_event=prior, **common)
    assert after > first
    assert calibrate_noise_multiplier(target_epsilon=2.0, preceding_event=prior, **common) == after
    assert calibrate_noise_multiplier(target_epsilon=1.0, **common) > first
    assert calibrate_noise_multiplier(target_epsilon=2.0, **{**common, "steps": 600}) > first
    assert len(calls) == 4
