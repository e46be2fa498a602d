"""Calibration: the noise multiplier, or the number of steps, that meets a target (ε, δ).

Both calibrators search on the accountant that will report the result, and return a value
whose ε *as measured by that accountant* is at or below the target: never above it. The
noise search stops once the measured ε is within ``epsilon_tolerance`` (relative) of the
target, so the budget is used and not wasted.

A ``preceding_event`` (e.g. private normalisation statistics, or an earlier training phase)
is composed before the calibrated mechanism, so the target covers the whole run.

The noise search is a pure function of its arguments; its answers are kept for the life of
the process (the last 256), so a sweep over seeds calibrates each configuration once.
"""

import math
from collections import OrderedDict
from collections.abc import Callable

import dp_accounting

from dpvision.accounting._checks import (
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sample_rate,
    check_steps,
)
from dpvision.accounting.accountants import (
    Accountant,
    compute_epsilon,
    default_accountant,
    parse_accountant,
)
from dpvision.accounting.events import compose_events, poisson_gaussian_event
from dpvision.accounting.gaussian import gdp_mu
from dpvision.errors import DPVisionError

MAX_NOISE_MULTIPLIER = 1e4
MIN_NOISE_MULTIPLIER = 1e-2
MAX_STEPS = 10**9
# A small step keeps the bracket search out of the region far above the target, where PLD
# is slow (its loss distribution gets wide).
_BRACKET_FACTOR = 1.25
_MAX_BRACKET_FACTOR = 4.0


_SOLVED: "OrderedDict[tuple[object, ...], float]" = OrderedDict()
_SOLVED_SIZE = 256


class _UnreachableError(Exception):
    pass


def _cache_key(
    *args: object, preceding_event: dp_accounting.DpEvent | None
) -> tuple[object, ...] | None:
    """The key of one calibration, or None where the preceding event has no faithful text
    (attrs events print every field; an abbreviated array or an address would not)."""
    text = repr(preceding_event)
    if "..." in text or " at 0x" in text:
        return None
    return (*args, text)


def _solve_noise(
    epsilon_at: Callable[[float], float], target: float, start: float, tolerance: float
) -> float:
    """Finds σ in [MIN, MAX] with target·(1 − tolerance) ≤ ε(σ) ≤ target; ε decreases in σ.

    Brackets the root from ``start`` by a factor of 1.25 that squares after each step
    that does not cross the target (up to 4), then runs the Illinois variant of
    false position on log ε against log σ (ε is close to a power law in σ, so this takes a
    handful of accountant calls where bisection takes a dozen). Only points with
    ε ≤ target are ever returned.
    """
    sigma = min(max(start, MIN_NOISE_MULTIPLIER), MAX_NOISE_MULTIPLIER)
    eps = epsilon_at(sigma)
    if eps <= target:
        hi, eps_hi = sigma, eps
        step = _BRACKET_FACTOR
        while True:
            if eps_hi >= target * (1 - tolerance):
                return hi
            lo = hi / step
            if lo < MIN_NOISE_MULTIPLIER:
                return hi  # even almost no noise meets this (very large) target
            eps_lo = epsilon_at(lo)
            if eps_lo > target:
                break
            hi, eps_hi = lo, eps_lo
            step = min(step * step, _MAX_BRACKET_FACTOR)
    else:
        lo, eps_lo = sigma, eps
        step = _BRACKET_FACTOR
        while True:
            if lo >= MAX_NOISE_MULTIPLIER:
                raise _UnreachableError
            hi = min(lo * step, MAX_NOISE_MULTIPLIER)
            eps_hi = epsilon_at(hi)
            if eps_hi <= target:
                break
            lo, eps_lo = hi, eps_hi
            step = min(step * step, _MAX_BRACKET_FACTOR)

    # Aim false position at the middle of the acceptance window [target·(1 − tol), target],
    # so iterates land inside it instead of creeping up to its edge from one side.
    aim = target * (1 - tolerance / 2)

    def gap(eps: float) -> float:  # log ε − log aim; +inf for an infinite ε
        return math.inf if not math.isfinite(eps) else math.log(max(eps, 1e-300) / aim)

    x_lo, x_hi = math.log(lo), math.log(hi)
    g_lo, g_hi = gap(eps_lo), gap(eps_hi)
    last_side = 0
    while eps_hi < target * (1 - tolerance) and x_hi - x_lo > 1e-12:
        x = x_hi - g_hi * (x_hi - x_lo) / (g_hi - g_lo) if math.isfinite(g_lo) else math.nan
        margin = 0.01 * (x_hi - x_lo)
        if not x_lo + margin < x < x_hi - margin:
            x = (x_lo + x_hi) / 2
        eps_x = epsilon_at(math.exp(x))
        if eps_x <= target:  # acceptable: becomes the new upper end (returned if in window)
            x_hi, g_hi, eps_hi = x, min(gap(eps_x), 0.0), eps_x
            if last_side == -1:
                g_lo /= 2
            last_side = -1
        else:
            x_lo, g_lo = x, gap(eps_x)
            if last_side == 1:
                g_hi /= 2
            last_side = 1
    return math.exp(x_hi)


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: "Accountant | str | None" = None,
    preceding_event: dp_accounting.DpEvent | None = None,
    epsilon_tolerance: float = 1e-3,
) -> float:
    """Returns σ such that ``steps`` Poisson-Gaussian steps at rate q are (ε, δ)-DP.

    Args:
      target_epsilon: ε to reach; the returned σ gives ε ≤ target, and ≥ target·(1 − tol)
        unless σ hits its lower search limit of 0.01.
      target_delta: δ in (0, 1).
      sample_rate: q in (0, 1]; 1 means full batch.
      steps: The number of noisy steps T ≥ 1.
      accountant: Which accountant measures ε; ``None`` picks the tightest valid one.
      preceding_event: Mechanisms that ran before and count against the same budget.
      epsilon_tolerance: Relative slack under the target at which the search stops.

    Raises:
      DPVisionError: for invalid parameters, or when no σ ≤ 10⁴ reaches the target.

    >>> sigma = calibrate_noise_multiplier(target_epsilon=3.0, target_delta=1e-5,
    ...     sample_rate=2048 / 60000, steps=1160, accountant="classic-rdp")
    >>> round(sigma, 2)  # seed 004's Fashion-MNIST CNN (σ = 2.15 published)
    2.15
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(target_delta, "target_delta")
    sample_rate = check_sample_rate(sample_rate)
    steps = check_steps(steps)
    if not 0 < epsilon_tolerance < 1:
        raise DPVisionError(f"epsilon_tolerance must be in (0, 1), got {epsilon_tolerance}")
    prior = [] if preceding_event is None else [preceding_event]

    def event_at(sigma: float) -> dp_accounting.DpEvent:
        step_event = poisson_gaussian_event(
            noise_multiplier=sigma, sample_rate=sample_rate, steps=steps
        )
        return compose_events([*prior, step_event])

    which = (
        default_accountant(event_at(1.0)) if accountant is None else parse_accountant(accountant)
    )
    if which is Accountant.GAUSSIAN:
        gdp_mu(event_at(1.0))  # refuses Poisson-sampled events before any search

    key = _cache_key(
        target, delta, sample_rate, steps, which, epsilon_tolerance, preceding_event=preceding_event
    )
    if key is not None and key in _SOLVED:
        _SOLVED.move_to_end(key)
        return _SOLVED[key]
    try:
        sigma = _calibrate(event_at, which, target, delta, epsilon_tolerance)
    except _UnreachableError:
        raise DPVisionError(
            f"no noise multiplier up to {MAX_NOISE_MULTIPLIER:g} reaches ε = {target:g} at "
            f"δ = {delta:g} with sample rate {sample_rate:g} and {steps} steps ({which.value}); "
            "raise the target ε or δ, or use fewer steps or a lower sample rate"
        ) from None
    if key is not None:
        _SOLVED[key] = sigma
        if len(_SOLVED) > _SOLVED_SIZE:
            _SOLVED.popitem(last=False)
    return sigma


def _calibrate(
    event_at: Callable[[float], dp_accounting.DpEvent],
    which: Accountant,
    target: float,
    delta: float,
    epsilon_tolerance: float,
) -> float:
    """The search behind :func:`calibrate_noise_multiplier`; raises _UnreachableError."""

    def epsilon_with(acc: Accountant) -> Callable[[float], float]:
        return lambda sigma: compute_epsilon(event_at(sigma), delta=delta, accountant=acc)

    # RDP is cheap at any ε, so it locates σ first; the requested accountant then refines
    # from there, without ever evaluating (slow) PLD far above the target. Whatever is
    # returned was measured by the requested accountant to be at or under the target.
    try:
        start = _solve_noise(epsilon_with(Accountant.RDP), target, 1.0, epsilon_tolerance)
    except _UnreachableError:
        if which is Accountant.RDP:
            raise
        start = MAX_NOISE_MULTIPLIER  # a tighter accountant may still reach the target
    if which is Accountant.RDP:
        return start
    return _solve_noise(epsilon_with(which), target, start, epsilon_tolerance)


def calibrate_steps(
    *,
    target_epsilon: float,
    target_delta: float,
    noise_multiplier: float,
    sample_rate: float,
    accountant: "Accountant | str | None" = None,
    preceding_event: dp_accounting.DpEvent | None = None,
    max_steps: int = MAX_STEPS,
) -> int:
    """Returns the largest number of steps T whose ε stays at or below the target.

    Raises:
      DPVisionError: for invalid parameters, or when even one step exceeds the target.
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(target_delta, "target_delta")
    sigma = check_noise_multiplier(noise_multiplier)
    sample_rate = check_sample_rate(sample_rate)
    max_steps = check_steps(max_steps, "max_steps")
    prior = [] if preceding_event is None else [preceding_event]

    def epsilon_at(steps: int) -> float:
        event = compose_events(
            [
                *prior,
                poisson_gaussian_event(
                    noise_multiplier=sigma, sample_rate=sample_rate, steps=steps
                ),
            ]
        )
        which = default_accountant(event) if accountant is None else parse_accountant(accountant)
        return compute_epsilon(event, delta=delta, accountant=which)

    if epsilon_at(1) > target:
        raise DPVisionError(
            f"a single step with noise multiplier {sigma:g} and sample rate {sample_rate:g} "
            f"already exceeds ε = {target:g} at δ = {delta:g}; raise the noise multiplier"
        )
    good, bad = 1, 2
    while epsilon_at(bad) <= target:
        good = bad
        if good >= max_steps:
            return max_steps
        bad = min(2 * bad, max_steps)
    while bad - good > 1:
        mid = (good + bad) // 2
        if epsilon_at(mid) <= target:
            good = mid
        else:
            bad = mid
    return good
