"""Private selection (Papernot & Steinke 2022): the ε dpvision reports for "best of K runs"
equals the paper's bound computed here from scratch, and K is drawn as stated."""

import math

import numpy as np
import pytest
from scipy import optimize

from dpvision.accounting import (
    RDP_ORDERS,
    Repetitions,
    compute_epsilon,
    default_accountant,
    gaussian_event,
    poisson_gaussian_event,
    repeat_and_select_event,
)
from dpvision.errors import DPVisionError

DELTA = 1e-5


def _gaussian_rdp(order: float, sigma: float) -> float:
    """RDP of one full-batch Gaussian of noise multiplier σ (Mironov 2017, Prop. 7)."""
    return order / (2 * sigma**2)


def _epsilon_from_rdp(orders: np.ndarray, rdp: np.ndarray, delta: float) -> float:
    """Balle et al. (2020), Theorem 21: ε = min_α RDP(α) + log((α−1)/α) − log(δα)/(α−1)."""
    usable = orders > 1.01
    a, r = orders[usable], rdp[usable]
    return float(np.min(r + np.log1p(-1 / a) - np.log(delta * a) / (a - 1)))


def _delta_from_rdp(orders: np.ndarray, rdp: np.ndarray, epsilon: float) -> float:
    """The same conversion solved for δ (log space), with the KL bound δ ≤ √(1 − e^−RDP)."""
    kl = 0.5 * np.log1p(-np.exp(-rdp))
    a = orders
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.where(a > 1.01, (a - 1) * (rdp - epsilon + np.log1p(-1 / a)) - np.log(a), np.inf)
    return float(min(1.0, math.exp(np.min(np.minimum(kl, bound)))))


def _tnb_gamma(mean: float, shape: float) -> float:
    """γ of the truncated negative binomial with this mean, by Brent's method."""
    if shape == 1:
        return 1 / mean

    def excess(gamma: float) -> float:
        if shape == 0:
            return (1 / gamma - 1) / math.log(1 / gamma) - mean
        return shape * (1 - gamma) / (gamma * (1 - gamma**shape)) - mean

    return optimize.brentq(excess, 1e-15, 1 - 1e-15, xtol=1e-15, rtol=1e-15)


def _papernot_steinke_from_rdp(rdp: np.ndarray, mean: float, shape: float) -> float:
    """ε at δ = 1e-5 of the best of K runs of a mechanism with RDP ``rdp`` at RDP_ORDERS,
    from the paper's theorems.

    Theorem 2 (TNB(η, γ)): RDP'(λ) = RDP(λ) + (1+η)(1 − 1/λ̂)RDP(λ̂) + (1+η)log(1/γ)/λ̂
    + log(μ)/(λ−1), for any λ̂ (minimised over the grid). Theorem 6 (Poisson): RDP'(λ) =
    RDP(λ) + μ·δ̂ + log(μ)/(λ−1), with δ̂ the δ of one run at ε̂ = log(1 + 1/(λ−1)). RDP
    grows with the order, so each order may take the bound of any larger one.
    """
    orders = np.asarray(RDP_ORDERS, dtype=float)
    out = np.full_like(orders, np.inf)
    if math.isinf(shape):
        for i, a in enumerate(orders):
            if a > 1:
                delta_hat = _delta_from_rdp(orders, rdp, math.log1p(1 / (a - 1)))
                out[i] = rdp[i] + mean * delta_hat + math.log(mean) / (a - 1)
    else:
        gamma = _tnb_gamma(mean, shape)
        constant = (1 + shape) * min(
            (1 - 1 / b) * r + math.log(1 / gamma) / b for b, r in zip(orders, rdp, strict=True)
        )
        for i, a in enumerate(orders):
            if a > 1:
                out[i] = rdp[i] + constant + math.log(mean) / (a - 1)
    out = np.minimum.accumulate(out[::-1])[::-1]  # monotonicity in the order
    return _epsilon_from_rdp(orders, out, DELTA)


def _papernot_steinke_epsilon(sigma: float, mean: float, shape: float) -> float:
    """ε at δ = 1e-5 of the best of K full-batch Gaussians of noise multiplier σ."""
    orders = np.asarray(RDP_ORDERS, dtype=float)
    return _papernot_steinke_from_rdp(
        np.array([_gaussian_rdp(a, sigma) for a in orders]), mean, shape
    )


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 2.0, math.inf])
@pytest.mark.parametrize(("sigma", "mean"), [(5.0, 10.0), (20.0, 3.0), (2.0, 30.0)])
def test_reported_epsilon_is_the_papernot_steinke_bound(sigma, mean, shape):
    event = repeat_and_select_event(
        gaussian_event(noise_multiplier=sigma), Repetitions(mean, shape)
    )
    assert default_accountant(event) == "rdp"
    reported = compute_epsilon(event, delta=DELTA)
    assert reported == pytest.approx(_papernot_steinke_epsilon(sigma, mean, shape), rel=1e-6)


def test_selection_costs_more_than_one_run_and_far_less_than_composition():
    one = gaussian_event(noise_multiplier=5.0)
    single = compute_epsilon(one, delta=DELTA, accountant="rdp")
    selected = compute_epsilon(repeat_and_select_event(one, Repetitions(10, 1)), delta=DELTA)
    composed = compute_epsilon(gaussian_event(noise_multiplier=5.0, count=30), delta=DELTA)
    assert single < selected < composed  # 30 runs: the geometric's 95th percentile is 29


def test_a_selection_inside_a_composition_is_accounted_with_rdp():
    from dpvision.accounting import compose_events

    step = poisson_gaussian_event(noise_multiplier=1.0, sample_rate=0.01, steps=100)
    tuned = repeat_and_select_event(step, Repetitions(5, math.inf))
    event = compose_events([gaussian_event(noise_multiplier=10.0), tuned])
    assert default_accountant(event) == "rdp"
    assert compute_epsilon(event, delta=DELTA) > compute_epsilon(tuned, delta=DELTA)
    with pytest.raises(DPVisionError, match="PLD accountant cannot account"):
        compute_epsilon(event, delta=DELTA, accountant="pld")


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0, math.inf])
def test_the_number_of_runs_has_the_stated_mean(shape):
    repetitions = Repetitions(mean=6.0, shape=shape)
    rng = np.random.default_rng(0)
    draws = np.array([repetitions.sample(rng) for _ in range(20000)])
    assert draws.mean() == pytest.approx(6.0, rel=0.03)
    assert draws.min() >= (0 if math.isinf(shape) else 1)
    if not math.isinf(shape):
        assert repetitions.gamma == pytest.approx(_tnb_gamma(6.0, shape), rel=1e-9)


def test_one_run_on_average_is_exactly_one_run():
    rng = np.random.default_rng(1)
    assert {Repetitions(1, 0.5).sample(rng) for _ in range(50)} == {1}


@pytest.mark.parametrize(
    ("mean", "shape", "message"),
    [
        (0.5, 1.0, "mean number of runs must be a number >= 1"),
        (math.inf, 1.0, "mean number of runs"),
        (math.nan, 1.0, "mean number of runs"),
        (5, -1.0, "shape of the number of runs must be >= 0"),
        (5, math.nan, "shape of the number of runs"),
    ],
)
def test_bad_repetitions_are_one_line_errors(mean, shape, message):
    with pytest.raises(DPVisionError, match=message) as error:
        Repetitions(mean, shape)
    assert "\n" not in str(error.value)


def test_describe_names_the_distribution():
    assert Repetitions(10, math.inf).describe() == "Poisson, mean 10"
    assert Repetitions(10, 1).describe() == "geometric, mean 10"
    assert Repetitions(10, 0).describe() == "logarithmic, mean 10"
    assert Repetitions(4, 0.5).describe() == "truncated negative binomial, η = 0.5, mean 4"


@pytest.mark.parametrize("distribution", ["geometric", "tnb:0.5", "poisson"])
def test_a_tune_run_reports_the_papernot_steinke_bound_of_its_candidates(distribution, tmp_path):
    """`dpvision tune` over full-batch candidates of different lengths (a mixture): the
    ledger's ε is the paper's bound on the pointwise maximum of the candidates' RDP
    (T·α/(2σ²) for training, α/(2σ_v²) for the noisy score), computed here from scratch."""
    from dpvision.config import resolve
    from dpvision.runs.tune import TuneSettings, parse_search, run_tune

    base = resolve(
        sets=[
            "dataset='digits'",
            "method='dp-sgd-linear'",
            "features='pixels'",
            "learner.batch_size=100000",  # full batch: q = 1
            "epsilon=2.0",
        ]
    )
    search = parse_search(["learner.epochs=2,5", "learner.learning_rate=0.5,1.0"])
    settings = TuneSettings(distribution, mean_runs=3.0)
    result, _ = run_tune(base, search, settings, quiet=True)
    tuning = result["tuning"]
    orders = np.asarray(RDP_ORDERS, dtype=float)
    steps = [c["learner.epochs"] for c in tuning["candidates"]]
    inner = np.max(
        [
            orders * (t / (2 * s**2) + 1 / (2 * tuning["score_noise"] ** 2))
            for t, s in zip(steps, tuning["noise_multipliers"], strict=True)
        ],
        axis=0,
    )
    shape = math.inf if tuning["shape"] == "inf" else tuning["shape"]
    expected = _papernot_steinke_from_rdp(inner, 3.0, shape)
    assert result["epsilon"] == pytest.approx(expected, rel=1e-6)
    assert 0.999 * 2.0 <= result["epsilon"] <= 2.0  # calibrated to the target, never above
    assert result["accountant"] == "rdp"
    [entry] = result["privacy_ledger"]
    assert entry["mechanism"] == "repeat-and-select"
    assert len(entry["candidates"]) == 4
