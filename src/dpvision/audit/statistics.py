"""Turning membership-inference outcomes into statistically valid ε lower bounds.

The hypothesis test of Hall et al. (2013), as used by De et al. (2022, App. A.2) after
Tramèr et al. (2022): an adversary sees a model trained on D or on D' = D ∪ {z} and says
"z was in" when the model's score on z (its loss) falls on one side of a threshold. Its
false-positive rate α (says "in" for a model trained on D) and false-negative rate β must
satisfy, for any (ε, δ)-DP training algorithm,

    α + e^ε β ≥ 1 − δ    and    e^ε α + β ≥ 1 − δ,

so ε ≥ max(ln((1 − β − δ)/α), ln((1 − α − δ)/β)). With α and β only *estimated* from a
finite number of trainings, the bound is made valid with one-sided Clopper-Pearson
intervals: an upper bound on α and an upper bound on β (a lower bound on the true-positive
rate 1 − β), each at significance (1 − confidence)/2, so that both hold together with
probability at least ``confidence`` (union bound). The threshold and its direction are
chosen on a *selection* split of the runs and the bound is computed on the disjoint
*evaluation* split, so the choice does not bias it.

Everything here is plain NumPy/SciPy on the scores; it releases nothing (the scores of an
audit come from models trained on public or synthetic audit data).
"""

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from dpvision.errors import DPVisionError


def clopper_pearson(
    successes: int | np.ndarray, trials: int | np.ndarray, significance: float
) -> tuple[np.ndarray, np.ndarray]:
    """One-sided Clopper-Pearson bounds (lower, upper) on a binomial proportion.

    Each side on its own holds with probability at least 1 − ``significance``: P(p < lower)
    ≤ significance and P(p > upper) ≤ significance. Exact (conservative) for every n.

    >>> lower, upper = clopper_pearson(0, 100, 0.05)
    >>> float(lower), round(float(upper), 5)  # upper = 1 − 0.05^(1/100)
    (0.0, 0.02951)
    """
    if not 0 < significance < 1:
        raise DPVisionError(f"significance must be in (0, 1), got {significance}")
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    if np.any(n < 1) or np.any(k < 0) or np.any(k > n):
        raise DPVisionError("need 0 <= successes <= trials and trials >= 1")
    with np.errstate(invalid="ignore", divide="ignore"):
        lower = np.where(k > 0, stats.beta.ppf(significance, k, n - k + 1), 0.0)
        upper = np.where(k < n, stats.beta.ppf(1 - significance, k + 1, n - k), 1.0)
    return lower, upper


def epsilon_from_rates(
    fpr_upper: float | np.ndarray, fnr_upper: float | np.ndarray, delta: float
) -> np.ndarray:
    """max(0, ln((1 − β − δ)/α), ln((1 − α − δ)/β)) for upper bounds α on the FPR and β on
    the FNR: the ε that any (ε, δ)-DP algorithm must at least have.

    >>> float(epsilon_from_rates(0.1, 0.2, 0.0))  # ln(0.8 / 0.1)
    2.0794415416798357
    """
    alpha = np.asarray(fpr_upper, dtype=np.float64)
    beta = np.asarray(fnr_upper, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        first = np.log(np.maximum(1 - beta - delta, 0) / alpha)
        second = np.log(np.maximum(1 - alpha - delta, 0) / beta)
    bound = np.fmax(first, second)
    return np.where(np.isnan(bound), 0.0, np.maximum(bound, 0.0))


def _counts(
    scores_out: np.ndarray, scores_in: np.ndarray, thresholds: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(false positives, true positives) of "in if score ≤ t" for every t."""
    out_sorted, in_sorted = np.sort(scores_out), np.sort(scores_in)
    fp = np.searchsorted(out_sorted, thresholds, side="right")
    tp = np.searchsorted(in_sorted, thresholds, side="right")
    return fp, tp


def epsilon_lower_bounds(
    scores_out: np.ndarray,
    scores_in: np.ndarray,
    thresholds: np.ndarray,
    *,
    delta: float,
    confidence: float,
) -> np.ndarray:
    """The Clopper-Pearson ε lower bound of the test "in if score ≤ t", for each t.

    ``scores_out`` come from models trained without the canary (on D), ``scores_in`` from
    models trained with it (on D'). The bound for one t holds with probability at least
    ``confidence``; choose t on other data (see :func:`audit_scores`).
    """
    significance = (1 - confidence) / 2
    fp, tp = _counts(scores_out, scores_in, thresholds)
    _, fpr_upper = clopper_pearson(fp, len(scores_out), significance)
    tpr_lower, _ = clopper_pearson(tp, len(scores_in), significance)
    return epsilon_from_rates(fpr_upper, 1 - tpr_lower, delta)


@dataclass(frozen=True)
class Threshold:
    """A membership test: "in" when ``sign · score ≤ sign · value`` (sign +1: low loss = in)."""

    value: float
    sign: int

    def says_in(self, scores: np.ndarray) -> np.ndarray:
        return np.asarray(self.sign * np.asarray(scores) <= self.sign * self.value)


def select_threshold(
    scores_out: np.ndarray, scores_in: np.ndarray, *, delta: float, confidence: float
) -> tuple[Threshold, float]:
    """The threshold and direction with the largest ε lower bound on these scores.

    Every observed score, in both directions (low loss means "in", or high loss does), is a
    candidate. Returns (the test, its bound on these scores), the bound being optimistic
    because it was maximised here: evaluate the test on fresh scores.
    """
    best = (Threshold(math.inf, 1), -1.0)
    for sign in (1, -1):
        out, inside = sign * np.asarray(scores_out), sign * np.asarray(scores_in)
        candidates = np.unique(np.concatenate([out, inside]))
        bounds = epsilon_lower_bounds(out, inside, candidates, delta=delta, confidence=confidence)
        i = int(np.argmax(bounds))
        if bounds[i] > best[1]:
            best = (Threshold(float(sign * candidates[i]), sign), float(bounds[i]))
    return best


def membership_auc(scores_out: np.ndarray, scores_in: np.ndarray, sign: int = 1) -> float:
    """P(a model trained with z scores lower than one without, ties counting ½): the AUC of
    the score as a membership classifier (Mann-Whitney U / (n_in · n_out)), for the
    direction ``sign`` (+1: low score means "in")."""
    out, inside = -sign * np.asarray(scores_out), -sign * np.asarray(scores_in)
    ranks = stats.rankdata(np.concatenate([inside, out]))
    n_in, n_out = len(inside), len(out)
    u = ranks[:n_in].sum() - n_in * (n_in + 1) / 2
    return float(u / (n_in * n_out))


def max_advantage(scores_out: np.ndarray, scores_in: np.ndarray, sign: int = 1) -> float:
    """max over thresholds t of TPR − FPR for "in if sign · score ≤ sign · t" (≥ 0)."""
    out, inside = sign * np.asarray(scores_out), sign * np.asarray(scores_in)
    candidates = np.unique(np.concatenate([out, inside]))
    fp, tp = _counts(out, inside, candidates)
    return float(max(0.0, np.max(tp / len(inside) - fp / len(out))))


def advantage_upper_bound(epsilon: float, delta: float) -> float:
    """The largest membership advantage 1 − α − β an (ε, δ)-DP algorithm allows:
    (e^ε − 1 + 2δ)/(e^ε + 1) (Humphries et al., 2020), capped at 1.

    >>> round(advantage_upper_bound(1.0, 0.01), 2)  # De et al. Table 9, |D| = 100
    0.47
    """
    if math.isinf(epsilon):
        return 1.0
    return min(1.0, (math.expm1(epsilon) + 2 * delta) / (math.exp(epsilon) + 1))


def gaussian_tv_distance(mean_a: float, std_a: float, mean_b: float, std_b: float) -> float:
    """Total variation distance between N(mean_a, std_a²) and N(mean_b, std_b²).

    Exact: the densities cross at most twice, and TV = Σ over the regions where a's density
    is above b's of (P_a − P_b). Phase I of the audit ranks configurations by the TV distance
    of Gaussians fitted to the two score samples (De et al., App. A.2).

    >>> round(gaussian_tv_distance(0.0, 1.0, 1.0, 1.0), 4)  # 2Φ(1/2) − 1
    0.3829
    """
    if not (std_a > 0 and std_b > 0):
        return 0.0 if (mean_a == mean_b and std_a == std_b) else 1.0
    # Solve a·x² + b·x + c = 0 for the points where the two log-densities are equal.
    qa = 1 / (2 * std_b**2) - 1 / (2 * std_a**2)
    qb = mean_a / std_a**2 - mean_b / std_b**2
    qc = mean_b**2 / (2 * std_b**2) - mean_a**2 / (2 * std_a**2) + math.log(std_b / std_a)
    if abs(qa) < 1e-12 * max(abs(qb), 1e-300):
        roots = [] if qb == 0 else [-qc / qb]
    else:
        disc = qb * qb - 4 * qa * qc
        roots = (
            []
            if disc < 0
            else sorted([(-qb - math.sqrt(disc)) / (2 * qa), (-qb + math.sqrt(disc)) / (2 * qa)])
        )
    edges = [-math.inf, *roots, math.inf]
    cdf_a = [stats.norm.cdf(e, mean_a, std_a) for e in edges]
    cdf_b = [stats.norm.cdf(e, mean_b, std_b) for e in edges]
    total = sum(
        max(0.0, (cdf_a[i + 1] - cdf_a[i]) - (cdf_b[i + 1] - cdf_b[i]))
        for i in range(len(edges) - 1)
    )
    return float(min(1.0, total))


@dataclass(frozen=True)
class AuditStatistics:
    """What a membership-inference audit measured on the evaluation runs.

    Attributes:
      epsilon_lower_bound: ε that the algorithm must have, with probability ≥ ``confidence``.
      confidence: the joint confidence of the two Clopper-Pearson bounds.
      threshold, sign: the test, chosen on the selection runs (sign +1: low loss = "in").
      fpr, tpr: observed rates of the test on the evaluation runs.
      fpr_upper, tpr_lower: their Clopper-Pearson bounds.
      auc: membership AUC on the evaluation runs (in the chosen direction).
      advantage: tpr − fpr of the chosen test on the evaluation runs.
      max_advantage: the largest tpr − fpr of any threshold (chosen direction) on the
        evaluation runs: descriptive, like the AUC (seed 003 Table 9's "advantage").
      selection_runs, evaluation_runs: runs per side (D and D') in each split.
    """

    epsilon_lower_bound: float
    confidence: float
    threshold: float
    sign: int
    fpr: float
    tpr: float
    fpr_upper: float
    tpr_lower: float
    auc: float
    advantage: float
    max_advantage: float
    selection_runs: int
    evaluation_runs: int


def audit_scores(
    scores_out: np.ndarray,
    scores_in: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.999,
    selection_fraction: float = 0.1,
) -> AuditStatistics:
    """The ε lower bound of a membership-inference audit from its canary scores.

    The first ``selection_fraction`` of each side's runs choose the threshold and direction
    (:func:`select_threshold`); the rest evaluate it with Clopper-Pearson bounds. The runs
    must be independent trainings, in the order they were made (no sorting by score).

    Args:
      scores_out: canary scores (losses) of models trained on D, one per run.
      scores_in: canary scores of models trained on D' = D ∪ {z}.
      delta: the δ of the claimed guarantee.
      confidence: probability that the reported bound is valid (0.999 in De et al.).
      selection_fraction: share of the runs used to choose the threshold.
    """
    scores_out = np.asarray(scores_out, dtype=np.float64)
    scores_in = np.asarray(scores_in, dtype=np.float64)
    if not 0 < confidence < 1:
        raise DPVisionError(f"confidence must be in (0, 1), got {confidence}")
    if not 0 <= delta < 1:
        raise DPVisionError(f"delta must be in [0, 1), got {delta}")
    if not 0 < selection_fraction < 1:
        raise DPVisionError(f"selection_fraction must be in (0, 1), got {selection_fraction}")
    if not (np.isfinite(scores_out).all() and np.isfinite(scores_in).all()):
        raise DPVisionError("canary scores must be finite (a training diverged?)")
    n = min(len(scores_out), len(scores_in))
    select = round(selection_fraction * n)
    if select < 1 or n - select < 1:
        raise DPVisionError(f"{n} runs per side are too few to split into selection/evaluation")
    test, _ = select_threshold(
        scores_out[:select], scores_in[:select], delta=delta, confidence=confidence
    )
    out, inside = scores_out[select:], scores_in[select:]
    fp, tp = int(test.says_in(out).sum()), int(test.says_in(inside).sum())
    significance = (1 - confidence) / 2
    _, fpr_upper = clopper_pearson(fp, len(out), significance)
    tpr_lower, _ = clopper_pearson(tp, len(inside), significance)
    bound = float(epsilon_from_rates(fpr_upper, 1 - tpr_lower, delta))
    fpr, tpr = fp / len(out), tp / len(inside)
    return AuditStatistics(
        epsilon_lower_bound=bound,
        confidence=confidence,
        threshold=test.value,
        sign=test.sign,
        fpr=fpr,
        tpr=tpr,
        fpr_upper=float(fpr_upper),
        tpr_lower=float(tpr_lower),
        auc=membership_auc(out, inside, test.sign),
        advantage=tpr - fpr,
        max_advantage=max_advantage(out, inside, test.sign),
        selection_runs=select,
        evaluation_runs=min(len(out), len(inside)),
    )
