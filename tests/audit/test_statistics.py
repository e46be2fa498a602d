"""The audit statistics on synthetic scores whose privacy is known exactly.

Membership-inference scores drawn from two known distributions stand in for the canary
losses of models trained without (D) and with (D') the canary:

* N(0, 1) vs N(−μ, 1) is exactly μ-GDP, so its ε(δ) is known in closed form (up to a root);
* randomized response on {0, 1} is exactly ε-DP (pure, δ = 0), with ties in the scores;
* identical distributions are 0-DP.

The reported bound must never exceed the true ε (validity, also checked as a frequency over
many repetitions) and must come close to what the number of runs allows (power).
"""

import math

import numpy as np
import pytest
from scipy import integrate, optimize, stats
from sklearn.metrics import roc_auc_score

from dpvision.audit.statistics import (
    Threshold,
    advantage_upper_bound,
    audit_scores,
    clopper_pearson,
    epsilon_from_rates,
    epsilon_lower_bounds,
    gaussian_tv_distance,
    membership_auc,
    select_threshold,
)
from dpvision.errors import DPVisionError

# ---------------------------------------------------------------------------------------------
# Oracles, written independently of the module under test (SciPy only).


def _gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)."""
    return stats.norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * stats.norm.cdf(
        -epsilon / mu - mu / 2
    )


def _gdp_epsilon(delta: float, mu: float) -> float:
    """The smallest ε with δ(ε) ≤ delta for μ-GDP (the true ε of N(0,1) vs N(±μ,1))."""
    if _gdp_delta(0.0, mu) <= delta:
        return 0.0
    return optimize.brentq(lambda e: _gdp_delta(e, mu) - delta, 0.0, 200.0, xtol=1e-12)


def _oracle_bound(mu: float, delta: float, runs: int, confidence: float) -> float:
    """The best Clopper-Pearson ε bound that ``runs`` evaluation runs per side can give on
    N(0,1) vs N(−μ,1) with the *ideal* threshold and the *expected* counts: what a perfect
    audit of that size achieves, the yardstick for power."""
    s = (1 - confidence) / 2
    t = np.linspace(-mu - 8, 8, 20001)
    fp = np.floor(runs * stats.norm.cdf(t))
    tp = np.floor(runs * stats.norm.cdf(t + mu))
    alpha = np.where(fp < runs, stats.beta.ppf(1 - s, fp + 1, runs - fp), 1.0)
    tpr_lower = np.where(tp > 0, stats.beta.ppf(s, tp, runs - tp + 1), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        first = np.log(np.maximum(tpr_lower - delta, 0) / alpha)
        second = np.log(np.maximum(1 - alpha - delta, 0) / (1 - tpr_lower))
    return float(np.nanmax(np.fmax(first, second)))


def _gaussian_scores(mu: float, runs: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(runs), rng.standard_normal(runs) - mu


def test_gdp_oracle_is_right():
    # 1-GDP at ε = 0 has δ = TV = 2Φ(1/2) − 1; the root is where the curve crosses δ.
    assert _gdp_delta(0.0, 1.0) == pytest.approx(2 * stats.norm.cdf(0.5) - 1, rel=1e-12)
    epsilon = _gdp_epsilon(1e-5, 2.0)
    assert _gdp_delta(epsilon, 2.0) == pytest.approx(1e-5, rel=1e-6)
    assert _gdp_epsilon(1e-5, 2.0) > _gdp_epsilon(1e-2, 2.0) > _gdp_epsilon(1e-2, 1.0)


# ---------------------------------------------------------------------------------------------
# Clopper-Pearson intervals.


@pytest.mark.parametrize("n", [1, 7, 100, 5000])
@pytest.mark.parametrize("significance", [0.0005, 0.05, 0.3])
def test_clopper_pearson_closed_forms_at_the_ends(n, significance):
    lower, upper = clopper_pearson(0, n, significance)
    assert float(lower) == 0.0
    assert float(upper) == pytest.approx(1 - significance ** (1 / n), rel=1e-9)
    lower, upper = clopper_pearson(n, n, significance)
    assert float(lower) == pytest.approx(significance ** (1 / n), rel=1e-9)
    assert float(upper) == 1.0


@pytest.mark.parametrize(("k", "n"), [(0, 10), (1, 10), (5, 10), (10, 10), (3, 57), (812, 1000)])
@pytest.mark.parametrize("significance", [0.025, 0.0005])
def test_clopper_pearson_matches_scipy_exact_interval(k, n, significance):
    ci = stats.binomtest(k, n).proportion_ci(method="exact", confidence_level=1 - 2 * significance)
    lower, upper = clopper_pearson(k, n, significance)
    assert float(lower) == pytest.approx(ci.low, rel=1e-9, abs=1e-14)
    assert float(upper) == pytest.approx(ci.high, rel=1e-9, abs=1e-14)


@pytest.mark.parametrize("n", [10, 57])
def test_clopper_pearson_is_exact_by_definition(n):
    # The upper bound for k is the p at which P(K ≤ k) falls to the significance, the lower
    # bound the p at which P(K ≥ k) does: the intervals are exact, not just conservative.
    significance = 0.05
    k = np.arange(n + 1)
    lower, upper = clopper_pearson(k, n, significance)
    assert lower.shape == upper.shape == (n + 1,)
    assert np.all(lower < upper)
    assert np.all(np.diff(lower) > 0)
    assert np.all(np.diff(upper) > 0)
    np.testing.assert_allclose(stats.binom.cdf(k[:-1], n, upper[:-1]), significance, rtol=1e-8)
    np.testing.assert_allclose(stats.binom.sf(k[1:] - 1, n, lower[1:]), significance, rtol=1e-8)


@pytest.mark.parametrize("p", [0.02, 0.3])
def test_clopper_pearson_coverage(p):
    n, draws, significance = 60, 40000, 0.05
    k = np.random.default_rng(7).binomial(n, p, size=draws)
    lower, upper = clopper_pearson(k, n, significance)
    slack = 3 * math.sqrt(significance * (1 - significance) / draws)
    assert np.mean(p > upper) <= significance + slack
    assert np.mean(p < lower) <= significance + slack
    # Exact miss probabilities (sum of the binomial pmf over the k that miss p).
    pmf = stats.binom.pmf(np.arange(n + 1), n, p)
    lower_k, upper_k = clopper_pearson(np.arange(n + 1), n, significance)
    assert pmf[p > upper_k].sum() <= significance
    assert pmf[p < lower_k].sum() <= significance


def test_clopper_pearson_input_errors():
    for significance in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(DPVisionError):
            clopper_pearson(1, 10, significance)
    with pytest.raises(DPVisionError):
        clopper_pearson(11, 10, 0.05)
    with pytest.raises(DPVisionError):
        clopper_pearson(-1, 10, 0.05)
    with pytest.raises(DPVisionError):
        clopper_pearson(0, 0, 0.05)


# ---------------------------------------------------------------------------------------------
# From rates to ε.


def test_epsilon_from_rates_values():
    assert float(epsilon_from_rates(0.1, 0.2, 0.0)) == pytest.approx(math.log(8))
    # Symmetric in the two error rates (the second inequality of the test).
    assert float(epsilon_from_rates(0.2, 0.1, 0.0)) == pytest.approx(math.log(8))
    assert float(epsilon_from_rates(0.1, 0.2, 0.05)) == pytest.approx(math.log(0.75 / 0.1))
    assert float(epsilon_from_rates(0.5, 0.5, 0.0)) == 0.0  # a coin flip proves nothing
    assert float(epsilon_from_rates(0.7, 0.6, 0.0)) == 0.0  # worse than a coin flip: 0, not < 0
    assert float(epsilon_from_rates(0.1, 0.2, 0.95)) == 0.0  # δ swallows everything
    assert float(epsilon_from_rates(0.0, 0.2, 0.0)) == math.inf  # a perfect test
    np.testing.assert_allclose(
        epsilon_from_rates(np.array([0.1, 0.5]), np.array([0.2, 0.5]), 0.0), [math.log(8), 0.0]
    )


def test_epsilon_lower_bounds_matches_a_loop_over_thresholds():
    rng = np.random.default_rng(3)
    out, inside = rng.standard_normal(300), rng.standard_normal(250) - 1.5
    thresholds = np.array([-3.0, -2.0, -1.0, -0.5, 0.0, 1.0, 3.0])
    got = epsilon_lower_bounds(out, inside, thresholds, delta=1e-3, confidence=0.95)
    s = 0.025
    for t, bound in zip(thresholds, got, strict=True):
        fp, tp = int(np.sum(out <= t)), int(np.sum(inside <= t))
        alpha = stats.beta.ppf(1 - s, fp + 1, 300 - fp) if fp < 300 else 1.0
        tpr_lower = stats.beta.ppf(s, tp, 250 - tp + 1) if tp > 0 else 0.0
        expected = max(
            0.0,
            math.log(max(tpr_lower - 1e-3, 1e-300) / alpha),
            math.log(max(1 - alpha - 1e-3, 1e-300) / (1 - tpr_lower)),
        )
        assert bound == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_threshold_says_in():
    scores = np.array([-1.0, 0.0, 1.0])
    np.testing.assert_array_equal(Threshold(0.0, 1).says_in(scores), [True, True, False])
    np.testing.assert_array_equal(Threshold(0.0, -1).says_in(scores), [False, True, True])


# ---------------------------------------------------------------------------------------------
# The Gaussian mechanism: μ-GDP, with its exact ε(δ).

# (μ, δ, the least share of the true ε that 20000 runs per side must reach at confidence
# 0.999). A finite audit cannot reach the true ε at small δ (the optimal test lives in a
# tail that 18000 runs cannot resolve), hence the share against the oracle below as well.
_GAUSSIAN_CASES = [
    (1.0, 1e-2, 0.6),
    (1.0, 1e-5, 0.33),
    (2.0, 1e-2, 0.55),
    (2.0, 1e-5, 0.33),
    (3.0, 1e-2, 0.42),
    (3.0, 1e-5, 0.27),
]


@pytest.mark.parametrize(("mu", "delta", "min_share"), _GAUSSIAN_CASES)
def test_gaussian_bound_is_valid_and_powerful(mu, delta, min_share):
    runs = 20000
    true_epsilon = _gdp_epsilon(delta, mu)
    out, inside = _gaussian_scores(mu, runs, seed=int(100 * mu) + int(-math.log10(delta)))
    result = audit_scores(out, inside, delta=delta)
    bound = result.epsilon_lower_bound
    assert 0 < bound <= true_epsilon
    assert bound >= min_share * true_epsilon
    # Power against what any audit of this size could show (measured: 0.79 to 1.05 of it).
    oracle = _oracle_bound(mu, delta, result.evaluation_runs, result.confidence)
    assert oracle <= true_epsilon
    assert bound >= 0.75 * oracle
    assert result.sign == 1
    assert result.selection_runs == 2000
    assert result.evaluation_runs == 18000
    assert result.confidence == 0.999
    # AUC of N(0,1) vs N(−μ,1) is Φ(μ/√2); the advantage of one test is at most the TV.
    assert result.auc == pytest.approx(stats.norm.cdf(mu / math.sqrt(2)), abs=0.01)
    assert result.advantage <= gaussian_tv_distance(0.0, 1.0, -mu, 1.0) + 0.02
    assert result.fpr_upper >= result.fpr
    assert result.tpr_lower <= result.tpr


@pytest.mark.parametrize("mu", [1.0, 2.0])
def test_gaussian_members_with_higher_scores_are_detected(mu):
    delta = 1e-5
    rng = np.random.default_rng(11)
    out, inside = rng.standard_normal(20000), rng.standard_normal(20000) + mu
    result = audit_scores(out, inside, delta=delta)
    assert result.sign == -1
    assert result.threshold > 0  # "in" when the score is high
    assert 0.3 * _gdp_epsilon(delta, mu) < result.epsilon_lower_bound <= _gdp_epsilon(delta, mu)
    assert result.auc == pytest.approx(stats.norm.cdf(mu / math.sqrt(2)), abs=0.01)
    assert result.tpr > result.fpr


def test_audit_fields_are_consistent_with_the_evaluation_split():
    delta, confidence, runs = 1e-3, 0.99, 3000
    out, inside = _gaussian_scores(1.5, runs, seed=5)
    result = audit_scores(out, inside, delta=delta, confidence=confidence, selection_fraction=0.2)
    select = result.selection_runs
    assert select == 600
    assert result.evaluation_runs == runs - select
    test = Threshold(result.threshold, result.sign)
    fp, tp = int(test.says_in(out[select:]).sum()), int(test.says_in(inside[select:]).sum())
    n = runs - select
    assert result.fpr == fp / n
    assert result.tpr == tp / n
    assert result.advantage == pytest.approx(result.tpr - result.fpr)
    s = (1 - confidence) / 2  # the two one-sided bounds share the confidence (union bound)
    assert result.fpr_upper == pytest.approx(stats.beta.ppf(1 - s, fp + 1, n - fp), rel=1e-9)
    assert result.tpr_lower == pytest.approx(stats.beta.ppf(s, tp, n - tp + 1), rel=1e-9)
    alpha, beta = result.fpr_upper, 1 - result.tpr_lower
    expected = max(0.0, math.log((1 - beta - delta) / alpha), math.log((1 - alpha - delta) / beta))
    assert result.epsilon_lower_bound == pytest.approx(expected, rel=1e-9)
    assert result.auc == pytest.approx(membership_auc(out[select:], inside[select:], 1))
    # The threshold is the one select_threshold picks on the selection split.
    chosen, _ = select_threshold(out[:select], inside[:select], delta=delta, confidence=confidence)
    assert chosen == test


# ---------------------------------------------------------------------------------------------
# Randomized response: pure ε-DP, scores in {0, 1} (all ties).


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0, 4.0])
def test_randomized_response_bound_approaches_epsilon_from_below(epsilon):
    runs = 60000
    rng = np.random.default_rng(int(10 * epsilon))
    p_in_says_zero = math.exp(epsilon) / (1 + math.exp(epsilon))
    p_out_says_zero = 1 / (1 + math.exp(epsilon))
    inside = (rng.random(runs) >= p_in_says_zero).astype(np.float64)  # 0 with prob e^ε/(1+e^ε)
    out = (rng.random(runs) >= p_out_says_zero).astype(np.float64)
    result = audit_scores(out, inside, delta=0.0)
    assert result.epsilon_lower_bound <= epsilon
    assert result.epsilon_lower_bound >= 0.85 * epsilon
    assert result.sign == 1
    assert result.threshold == 0.0
    assert result.fpr == pytest.approx(p_out_says_zero, abs=0.01)
    assert result.tpr == pytest.approx(p_in_says_zero, abs=0.01)
    # With only two values, the AUC counts ties as ½: ½ + (tpr − fpr)/2.
    assert result.auc == pytest.approx(0.5 + (result.tpr - result.fpr) / 2, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# No separation.


def test_identical_distributions_give_no_bound():
    rng = np.random.default_rng(21)
    out, inside = rng.standard_normal(5000), rng.standard_normal(5000)
    result = audit_scores(out, inside, delta=1e-5)
    assert 0.0 <= result.epsilon_lower_bound < 0.3
    assert result.auc == pytest.approx(0.5, abs=0.025)
    assert abs(result.advantage) < 0.05


def test_constant_scores_give_exactly_zero():
    result = audit_scores(np.full(200, 2.5), np.full(200, 2.5), delta=1e-5)
    assert result.epsilon_lower_bound == 0.0
    assert result.auc == 0.5
    assert result.advantage == 0.0


# ---------------------------------------------------------------------------------------------
# Validity as a frequency: at confidence c, the bound exceeds the true ε at most 1 − c of the
# time. Each check also shows that the same statistics *without* the Clopper-Pearson
# intervals (the point estimates) exceed it far more often, so the check has teeth.

_MU, _DELTA = 1.0, 0.1  # the optimal test sits at FPR ≈ 5%, within reach of a few hundred runs


@pytest.mark.parametrize("confidence", [0.9, 0.5])
def test_fixed_threshold_bound_is_valid_as_a_frequency(confidence):
    true_epsilon = _gdp_epsilon(_DELTA, _MU)
    # The optimal threshold: where the likelihood ratio φ(x + μ)/φ(x) equals e^ε.
    x = -(true_epsilon + _MU**2 / 2) / _MU
    fpr, tpr = stats.norm.cdf(x), stats.norm.cdf(x + _MU)
    assert math.exp(true_epsilon) * fpr + (1 - tpr) == pytest.approx(1 - _DELTA)  # tight there
    runs, repetitions = 1000, 20000
    rng = np.random.default_rng(31)
    fp, tp = rng.binomial(runs, fpr, repetitions), rng.binomial(runs, tpr, repetitions)
    s = (1 - confidence) / 2
    _, fpr_upper = clopper_pearson(fp, runs, s)
    tpr_lower, _ = clopper_pearson(tp, runs, s)
    bounds = epsilon_from_rates(fpr_upper, 1 - tpr_lower, _DELTA)
    slack = 3 * math.sqrt(confidence * (1 - confidence) / repetitions)
    assert np.mean(bounds > true_epsilon) <= (1 - confidence) + slack
    point = epsilon_from_rates(fp / runs, 1 - tp / runs, _DELTA)
    assert np.mean(point > true_epsilon) > 0.4


def test_audit_bound_is_valid_as_a_frequency():
    confidence, runs, repetitions = 0.9, 400, 300
    true_epsilon = _gdp_epsilon(_DELTA, _MU)
    rng = np.random.default_rng(41)
    bounds, points = [], []
    for _ in range(repetitions):
        out, inside = rng.standard_normal(runs), rng.standard_normal(runs) - _MU
        result = audit_scores(
            out, inside, delta=_DELTA, confidence=confidence, selection_fraction=0.5
        )
        bounds.append(result.epsilon_lower_bound)
        points.append(float(epsilon_from_rates(result.fpr, 1 - result.tpr, _DELTA)))
    exceed = np.mean(np.array(bounds) > true_epsilon)
    slack = 3 * math.sqrt(0.1 * 0.9 / repetitions)
    assert exceed <= (1 - confidence) + slack
    assert np.mean(np.array(points) > true_epsilon) > 0.2  # without the intervals: invalid
    assert np.mean(bounds) > 0.25 * true_epsilon  # and not valid by being always 0


# ---------------------------------------------------------------------------------------------
# The threshold is chosen on the selection split only.


def test_threshold_is_chosen_on_selection_runs_only():
    rng = np.random.default_rng(51)
    runs, select = 2000, 200
    # Selection runs perfectly separated (members low), evaluation runs not separated at all.
    out = np.concatenate([2 + rng.random(select), rng.standard_normal(runs - select)])
    inside = np.concatenate([-2 - rng.random(select), rng.standard_normal(runs - select)])
    result = audit_scores(out, inside, delta=1e-5, selection_fraction=0.1)
    assert result.selection_runs == select
    assert result.evaluation_runs == runs - select
    assert result.sign == 1
    assert result.epsilon_lower_bound < 0.1
    # Evaluating the same test on all runs (selection included) would claim a lot: the split
    # is what keeps the bound honest.
    leaky = epsilon_lower_bounds(
        out, inside, np.array([result.threshold]), delta=1e-5, confidence=0.999
    )
    assert float(leaky[0]) > 0.5  # measured: 0.97


def test_direction_is_chosen_on_selection_runs_only():
    rng = np.random.default_rng(52)
    runs, select = 2000, 200
    # Selection says members score high; evaluation says the opposite (members low).
    out = np.concatenate([-2 - rng.random(select), rng.standard_normal(runs - select)])
    inside = np.concatenate([2 + rng.random(select), rng.standard_normal(runs - select) - 3])
    result = audit_scores(out, inside, delta=1e-5, selection_fraction=0.1)
    assert result.sign == -1
    assert result.epsilon_lower_bound == 0.0
    assert result.auc < 0.1  # the chosen direction is wrong on the evaluation runs


# ---------------------------------------------------------------------------------------------
# AUC and advantage.


def test_membership_auc_matches_sklearn():
    rng = np.random.default_rng(61)
    out, inside = rng.standard_normal(700), rng.standard_normal(500) - 0.7
    labels = np.concatenate([np.ones(500), np.zeros(700)])
    scores = np.concatenate([inside, out])
    assert membership_auc(out, inside, 1) == pytest.approx(roc_auc_score(labels, -scores))
    assert membership_auc(out, inside, -1) == pytest.approx(roc_auc_score(labels, scores))
    assert membership_auc(out, inside, 1) > 0.6
    # Ties (integer scores) count ½.
    out_int, in_int = rng.integers(0, 4, 300), rng.integers(0, 3, 200)
    labels = np.concatenate([np.ones(200), np.zeros(300)])
    scores = np.concatenate([in_int, out_int]).astype(np.float64)
    assert membership_auc(out_int, in_int, 1) == pytest.approx(roc_auc_score(labels, -scores))
    assert membership_auc(out_int, in_int, 1) + membership_auc(out_int, in_int, -1) == (
        pytest.approx(1.0)
    )


@pytest.mark.parametrize(
    ("epsilon", "delta", "expected"),
    [
        (1.0, 0.01, 0.47),
        (2.0, 0.01, 0.76),
        (4.0, 0.01, 0.96),
        (8.0, 0.01, 1.00),
        (1.0, 1 / 60000, 0.46),
        (2.0, 1 / 60000, 0.76),
        (4.0, 1 / 60000, 0.96),
        (8.0, 1 / 60000, 1.00),
    ],
)
def test_advantage_upper_bound_matches_de_et_al_table_9(epsilon, delta, expected):
    assert round(advantage_upper_bound(epsilon, delta), 2) == expected


def test_advantage_upper_bound_edges():
    assert advantage_upper_bound(0.0, 0.0) == 0.0
    assert advantage_upper_bound(math.inf, 0.0) == 1.0
    assert advantage_upper_bound(50.0, 0.5) == 1.0
    # (e^ε − 1 + 2δ)/(e^ε + 1) is the largest 1 − α − β allowed by both inequalities.
    assert advantage_upper_bound(1.0, 0.0) == pytest.approx(math.tanh(0.5))


# ---------------------------------------------------------------------------------------------
# Total variation between Gaussians.


@pytest.mark.parametrize(("m1", "m2", "s"), [(0.0, 1.0, 1.0), (-2.0, 3.0, 2.5), (5.0, 5.1, 0.1)])
def test_gaussian_tv_equal_variances_closed_form(m1, m2, s):
    expected = 2 * stats.norm.cdf(abs(m1 - m2) / (2 * s)) - 1
    assert gaussian_tv_distance(m1, s, m2, s) == pytest.approx(expected, rel=1e-10, abs=1e-14)


def _tv_by_quadrature(m1: float, s1: float, m2: float, s2: float) -> float:
    lo = min(m1 - 12 * s1, m2 - 12 * s2)
    hi = max(m1 + 12 * s1, m2 + 12 * s2)
    value, _ = integrate.quad(
        lambda x: 0.5 * abs(stats.norm.pdf(x, m1, s1) - stats.norm.pdf(x, m2, s2)),
        lo,
        hi,
        points=sorted({m1, m2}),
        limit=500,
        epsabs=1e-12,
        epsrel=1e-10,
    )
    return value


@pytest.mark.parametrize(
    ("m1", "s1", "m2", "s2"),
    [
        (0.0, 1.0, 0.0, 2.0),  # same mean: two crossings
        (0.0, 1.0, 1.0, 1.5),
        (-1.0, 0.3, 2.0, 3.0),
        (0.0, 1.0, 10.0, 0.5),  # nearly disjoint
        (1.0, 1.0, 1.2, 1.01),  # nearly equal variances
    ],
)
def test_gaussian_tv_unequal_variances_by_quadrature(m1, s1, m2, s2):
    expected = _tv_by_quadrature(m1, s1, m2, s2)
    assert gaussian_tv_distance(m1, s1, m2, s2) == pytest.approx(expected, abs=1e-7)
    assert gaussian_tv_distance(m2, s2, m1, s1) == pytest.approx(expected, abs=1e-7)


def test_gaussian_tv_identical_and_symmetric_and_degenerate():
    assert gaussian_tv_distance(1.3, 0.7, 1.3, 0.7) == 0.0
    rng = np.random.default_rng(71)
    for m1, m2, s1, s2 in zip(
        rng.normal(size=20),
        rng.normal(size=20),
        rng.uniform(0.1, 3, 20),
        rng.uniform(0.1, 3, 20),
        strict=True,
    ):
        forward = gaussian_tv_distance(m1, s1, m2, s2)
        assert 0.0 <= forward <= 1.0
        assert forward == pytest.approx(gaussian_tv_distance(m2, s2, m1, s1), abs=1e-12)
    assert gaussian_tv_distance(0.0, 0.0, 0.0, 0.0) == 0.0  # the same point mass
    assert gaussian_tv_distance(0.0, 0.0, 1.0, 0.0) == 1.0
    assert gaussian_tv_distance(0.0, 0.0, 0.0, 1.0) == 1.0  # point mass vs a density
    assert gaussian_tv_distance(0.0, 1.0, 40.0, 1.0) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# Input errors.


def test_audit_scores_input_errors():
    good = np.zeros(100)
    with pytest.raises(DPVisionError, match="finite"):
        audit_scores(np.r_[good, np.nan], np.r_[good, 0.0], delta=1e-5)
    with pytest.raises(DPVisionError, match="finite"):
        audit_scores(good, np.r_[good[:-1], np.inf], delta=1e-5)
    with pytest.raises(DPVisionError, match="too few"):
        audit_scores(np.zeros(1), np.zeros(1), delta=1e-5)
    with pytest.raises(DPVisionError, match="too few"):
        audit_scores(np.zeros(0), np.zeros(0), delta=1e-5)
    with pytest.raises(DPVisionError, match="too few"):
        audit_scores(good, np.zeros(4), delta=1e-5)  # 10% of 4 runs rounds to none
    with pytest.raises(DPVisionError, match="too few"):
        audit_scores(np.zeros(2), np.zeros(2), delta=1e-5, selection_fraction=0.9)
    for confidence in (0.0, 1.0, -0.5, 1.5, math.nan):
        with pytest.raises(DPVisionError, match="confidence"):
            audit_scores(good, good, delta=1e-5, confidence=confidence)
    for fraction in (0.0, 1.0):
        with pytest.raises(DPVisionError, match="selection_fraction"):
            audit_scores(good, good, delta=1e-5, selection_fraction=fraction)
