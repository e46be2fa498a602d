"""ε lower bounds from one training run (Steinke, Nasr & Jagielski, NeurIPS 2023).

m canaries are each included in the training set independently with probability ½. After
one training run the auditor guesses, for r of them, whether they were included (it may
abstain on the others); v of its guesses are right. For an (ε, δ)-DP training algorithm the
number of right guesses is stochastically dominated by that of ε-DP randomized response on
r bits, up to a δ term (the paper's main theorem):

    P[V ≥ v] ≤ P[Binomial(r, q) ≥ v] + δ · max_{1≤i≤v} (2m/i) · P[v − i ≤ Binomial(r, q) < v],

with q = e^ε / (1 + e^ε). That right-hand side is the p-value of the hypothesis "the run is
(ε, δ)-DP"; the lower bound is the largest ε it rejects at the stated confidence. Since
(ε, δ)-DP implies (ε', δ)-DP for every ε' > ε, one rejected ε rejects every smaller one: the
bound is valid whatever the shape of the p-value in ε.

The guesses must be fixed by a rule chosen before the scores are seen (here: the k₊
highest scores guess "in", the k₋ lowest guess "out"); choosing k₊ and k₋ after looking is
a multiple test and needs its own correction.

Everything here is arithmetic on the scores and the inclusion bits of canaries, which are
the auditor's own data: it releases nothing about private data.
"""

import math

import numpy as np
from scipy import stats

from dpvision.errors import DPVisionError


def one_run_p_value(
    *, canaries: int, guesses: int, correct: int, epsilon: float, delta: float
) -> float:
    """P[at least ``correct`` right guesses out of ``guesses``] for an (ε, δ)-DP run with
    ``canaries`` canaries (m ≥ r ≥ v ≥ 0), an upper bound by the theorem above (at most 1).

    >>> round(one_run_p_value(canaries=100, guesses=100, correct=50, epsilon=0.0, delta=0.0), 4)
    0.5398
    """
    m, r, v = canaries, guesses, correct
    if not 0 <= v <= r <= m:
        raise DPVisionError(f"need 0 <= correct <= guesses <= canaries, got {v}, {r}, {m}")
    if not (epsilon >= 0 and 0 <= delta <= 1):
        raise DPVisionError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    q = 1.0 / (1.0 + math.exp(-epsilon)) if epsilon < 700 else 1.0
    tail = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) ≥ v]
    if delta == 0 or v == 0:
        return min(1.0, tail)
    # below[j] = P[Binomial(r, q) = v − j] for j = 1..v; the window sums are its prefix sums.
    below = stats.binom.pmf(v - np.arange(1, v + 1), r, q)
    windows = np.cumsum(below)  # P[v − i ≤ Binomial < v] for i = 1..v
    alpha = float(np.max(2.0 * m / np.arange(1, v + 1) * windows))
    return min(1.0, tail + delta * alpha)


def one_run_epsilon_lower_bound(
    *, canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95
) -> float:
    """The largest ε (to 10⁻⁴) that ``correct`` right guesses out of ``guesses`` reject at
    ``confidence``: with probability at least ``confidence`` over the canaries' inclusion
    and the run, an (ε, δ)-DP run gives a bound ≤ ε. 0 when nothing is rejected.

    >>> bound = one_run_epsilon_lower_bound(canaries=1000, guesses=100, correct=100, delta=0.0)
    >>> round(bound, 3)  # all 100 right: q¹⁰⁰ ≤ 0.05 for q ≥ 0.05^(1/100), ε = ln(q/(1 − q))
    3.493
    """
    if not 0 < confidence < 1:
        raise DPVisionError(f"confidence must be in (0, 1), got {confidence}")
    level = 1.0 - confidence

    def rejected(epsilon: float) -> bool:
        p = one_run_p_value(
            canaries=canaries, guesses=guesses, correct=correct, epsilon=epsilon, delta=delta
        )
        return p <= level

    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high):  # the p-value tends to 1 as ε grows whenever v ≤ r
        low, high = high, 2 * high
        if high > 1e3:
            return low
    while high - low > 1e-4:
        middle = (low + high) / 2
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return low  # rejected: a valid bound


def guesses_from_scores(scores: np.ndarray, *, guess_in: int, guess_out: int) -> np.ndarray:
    """+1 (guess "included") for the ``guess_in`` highest scores, −1 for the ``guess_out``
    lowest, 0 (abstain) for the rest; ties broken by position (a fixed rule)."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if guess_in < 0 or guess_out < 0 or guess_in + guess_out > len(scores):
        raise DPVisionError(
            f"need guess_in + guess_out <= {len(scores)} canaries, got {guess_in} + {guess_out}"
        )
    order = np.argsort(scores, kind="stable")
    guesses = np.zeros(len(scores), dtype=np.int8)
    guesses[order[:guess_out]] = -1
    if guess_in:
        guesses[order[-guess_in:]] = 1
    return guesses


def audit_one_run(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    guess_in: int,
    guess_out: int,
    delta: float,
    confidence: float = 0.95,
) -> dict[str, float | int]:
    """The one-run bound of a canary audit: ``scores`` (higher = more likely included) and
    ``included`` (the coin of each canary) of one training run.

    Returns the canary count m, the guesses r, the right guesses v and the ε lower bound.
    """
    included = np.asarray(included, dtype=bool).reshape(-1)
    guesses = guesses_from_scores(scores, guess_in=guess_in, guess_out=guess_out)
    if len(included) != len(guesses):
        raise DPVisionError(f"{len(guesses)} scores but {len(included)} inclusion bits")
    made = guesses != 0
    right = int(np.sum(made & ((guesses == 1) == included)))
    m, r = len(guesses), int(made.sum())
    bound = one_run_epsilon_lower_bound(
        canaries=m, guesses=r, correct=right, delta=delta, confidence=confidence
    )
    return {"canaries": m, "guesses": r, "correct": right, "epsilon_lower_bound": bound}
