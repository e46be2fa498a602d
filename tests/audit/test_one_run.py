"""One-run auditing (Steinke, Nasr & Jagielski 2023): the bound is valid at its stated
confidence on honest mechanisms and catches too little noise."""

import math

import numpy as np
import pytest
from scipy import stats

from dpvision.accounting import calibrate_noise_multiplier
from dpvision.audit.one_run import (
    audit_one_run,
    guesses_from_scores,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)
from dpvision.errors import DPVisionError


def _randomized_response(rng, canaries, epsilon):
    """Each canary's bit is reported truthfully with probability e^ε/(1 + e^ε): ε-DP, and
    the mechanism for which the theorem is tight."""
    included = rng.random(canaries) < 0.5
    truthful = rng.random(canaries) < 1 / (1 + math.exp(-epsilon))
    return included, np.where(truthful, included, ~included)


def test_without_delta_the_p_value_is_the_binomial_tail():
    q = 1 / (1 + math.exp(-1.5))
    expected = stats.binom.sf(69, 100, q)
    assert one_run_p_value(
        canaries=500, guesses=100, correct=70, epsilon=1.5, delta=0.0
    ) == pytest.approx(expected, rel=1e-12)
    with_delta = one_run_p_value(canaries=500, guesses=100, correct=70, epsilon=1.5, delta=1e-3)
    assert expected < with_delta <= 1.0


def test_honest_randomized_response_exceeds_its_epsilon_at_the_stated_rate():
    """200 audits of ε = 1 randomized response at 95 % confidence: the bound may exceed 1 in
    5 % of them (mean 10); more than 20 has probability 0.2 % for a valid bound."""
    rng = np.random.default_rng(0)
    over = 0
    for _ in range(200):
        included, reported = _randomized_response(rng, 400, 1.0)
        correct = int(np.sum(reported == included))
        bound = one_run_epsilon_lower_bound(
            canaries=400, guesses=400, correct=correct, delta=0.0, confidence=0.95
        )
        over += bound > 1.0
    assert over <= 20
    assert over >= 1  # tight for this mechanism: the bound does reach ε now and then


def test_randomized_response_with_more_privacy_loss_than_claimed_is_caught():
    rng = np.random.default_rng(1)
    included, reported = _randomized_response(rng, 1000, 3.0)
    correct = int(np.sum(reported == included))
    bound = one_run_epsilon_lower_bound(canaries=1000, guesses=1000, correct=correct, delta=0.0)
    assert bound > 2.5


def _gaussian_dirac_canaries(rng, canaries, sigma):
    """White-box canaries: canary i contributes the Dirac e_i (norm 1) to a released sum,
    with N(0, σ²) noise per coordinate; the score of canary i is coordinate i."""
    included = rng.random(canaries) < 0.5
    return included, included + rng.normal(0.0, sigma, canaries)


@pytest.mark.parametrize("factor", [1.0, 0.3])
def test_a_gaussian_release_is_audited_against_its_claim(factor):
    epsilon, delta = 2.0, 1e-5
    sigma = calibrate_noise_multiplier(
        target_epsilon=epsilon, target_delta=delta, sample_rate=1.0, steps=1
    )
    rng = np.random.default_rng(2)
    bounds = []
    for _ in range(5):
        included, scores = _gaussian_dirac_canaries(rng, 1000, factor * sigma)
        report = audit_one_run(
            scores, included, guess_in=100, guess_out=100, delta=delta, confidence=0.95
        )
        assert report["canaries"] == 1000
        assert report["guesses"] == 200
        bounds.append(report["epsilon_lower_bound"])
    if factor == 1.0:
        assert max(bounds) <= epsilon  # honest: never above the claim in these seeds
    else:
        assert min(bounds) > epsilon  # 0.3 of the noise: caught in every seed


def test_guesses_follow_the_fixed_rule():
    guesses = guesses_from_scores(np.array([0.1, 0.9, 0.5, 0.3, 0.7]), guess_in=2, guess_out=1)
    assert guesses.tolist() == [-1, 1, 0, 0, 1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"canaries": 10, "guesses": 11, "correct": 5, "epsilon": 1.0, "delta": 0.0},
        {"canaries": 10, "guesses": 5, "correct": 6, "epsilon": 1.0, "delta": 0.0},
        {"canaries": 10, "guesses": 5, "correct": 2, "epsilon": -1.0, "delta": 0.0},
        {"canaries": 10, "guesses": 5, "correct": 2, "epsilon": 1.0, "delta": 2.0},
    ],
)
def test_impossible_counts_are_one_line_errors(kwargs):
    with pytest.raises(DPVisionError):
        one_run_p_value(**kwargs)


def test_too_many_guesses_is_an_error():
    with pytest.raises(DPVisionError, match="guess_in"):
        guesses_from_scores(np.zeros(3), guess_in=2, guess_out=2)
