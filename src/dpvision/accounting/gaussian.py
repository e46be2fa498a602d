r"""Exact privacy of composed *unsampled* Gaussian mechanisms (Gaussian DP).

A Gaussian mechanism with noise multiplier σ (noise std σΔ on a query of L2 sensitivity Δ)
is exactly μ-GDP with μ = 1/σ (Dong, Roth & Su 2022). Composing k of them, with noise
multipliers σ₁…σ_k, is exactly μ-GDP with

.. math:: \mu = \sqrt{\textstyle\sum_i \sigma_i^{-2}},

and μ-GDP is equivalent to (ε, δ(ε))-DP for every ε ≥ 0 with (Balle & Wang 2018, Thm. 8)

.. math:: \delta(\varepsilon) = \Phi\!\left(-\frac{\varepsilon}{\mu} + \frac{\mu}{2}\right)
          - e^{\varepsilon}\,\Phi\!\left(-\frac{\varepsilon}{\mu} - \frac{\mu}{2}\right).

Nothing is approximated, so for full-batch learners this is the tightest valid answer. It
does not apply to Poisson-sampled steps (the composition of subsampled Gaussians is not
Gaussian); use PLD or RDP for those.

>>> round(gaussian_epsilon(mu=1.0, delta=1e-5), 4)
4.3772
"""

import math

import dp_accounting
from scipy import optimize, special

from dpvision.errors import DPVisionError


def _mu_squared(event: dp_accounting.DpEvent) -> float:
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return 0.0
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return math.inf
    if isinstance(event, dp_accounting.GaussianDpEvent):
        sigma = float(event.noise_multiplier)
        return math.inf if sigma == 0 else sigma**-2
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return int(event.count) * _mu_squared(event.event)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return math.fsum(_mu_squared(e) for e in event.events)
    if isinstance(event, dp_accounting.PoissonSampledDpEvent) and event.sampling_probability == 1:
        return _mu_squared(event.event)
    raise DPVisionError(
        "the gaussian accountant is exact only for full-batch (unsampled) Gaussian mechanisms, "
        f"but this run contains {type(event).__name__}"
        + (
            f" with sample rate {event.sampling_probability:g}"
            if isinstance(event, dp_accounting.PoissonSampledDpEvent)
            else ""
        )
        + "; use the pld or rdp accountant"
    )


def gdp_mu(event: dp_accounting.DpEvent) -> float:
    """Returns μ such that ``event`` (a composition of unsampled Gaussians) is exactly μ-GDP.

    Raises:
      DPVisionError: if the event contains anything but unsampled Gaussian mechanisms.
    """
    return math.sqrt(_mu_squared(event))


def is_unsampled_gaussian(event: dp_accounting.DpEvent) -> bool:
    """True when the event is a composition of unsampled Gaussian mechanisms only."""
    try:
        _mu_squared(event)
    except DPVisionError:
        return False
    return True


def _log_delta(epsilon: float, mu: float) -> float:
    # δ = Φ(a) − e^ε Φ(b) = Φ(a)·(1 − exp(ε + log Φ(b) − log Φ(a))); both logs stay finite
    # far into the tails, where the two terms would cancel catastrophically in plain floats.
    log_a = float(special.log_ndtr(-epsilon / mu + mu / 2))
    log_b = float(special.log_ndtr(-epsilon / mu - mu / 2))
    gap = epsilon + log_b - log_a
    if gap >= 0:  # only reachable through rounding when δ ≈ 0
        return -math.inf
    return log_a + math.log(-math.expm1(gap))


def gaussian_delta(*, mu: float, epsilon: float) -> float:
    """Returns the exact δ at which a μ-GDP mechanism is (ε, δ)-DP."""
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    return math.exp(_log_delta(float(epsilon), float(mu)))


def gaussian_epsilon(*, mu: float, delta: float) -> float:
    """Returns the smallest ε at which a μ-GDP mechanism is (ε, δ)-DP (rounded up, never down)."""
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    log_target = math.log(delta)
    if _log_delta(0.0, mu) <= log_target:
        return 0.0
    # δ(ε) ≤ Φ(−ε/μ + μ/2), so at ε = μ²/2 − μ·(Φ⁻¹(δ) − 1) it is Φ(Φ⁻¹(δ) − 1) < δ, with a
    # margin that survives rounding however large μ is (σ ≈ 1e-9 gives μ ≈ 1e9).
    upper = mu * mu / 2 - mu * (float(special.ndtri(delta)) - 1.0)
    for _ in range(64):
        if _log_delta(upper, mu) < log_target:
            break
        upper *= 2
    else:
        raise DPVisionError(f"cannot compute ε for μ = {mu:g} at δ = {delta:g}")
    root = float(
        optimize.brentq(
            lambda e: _log_delta(e, mu) - log_target, 0.0, upper, xtol=1e-13, rtol=1e-15
        )
    )
    # brentq's answer may sit a hair below the true root; step up until δ(ε) ≤ target.
    while _log_delta(root, mu) > log_target:
        root = math.nextafter(root, math.inf) * (1 + 1e-15)
    return root


def zcdp_epsilon(event: dp_accounting.DpEvent, *, delta: float) -> float:
    """ε from the zCDP bound ρ + 2√(ρ log(1/δ)), with ρ = μ²/2 (Bun & Steinke 2016, Prop. 1.3).

    This is the figure Mehta et al. report for DP-LS, DP-Newton and DP-FC; it is valid but
    looser than :func:`gaussian_epsilon` on the same event, and is offered for comparison.
    """
    rho = gdp_mu(event) ** 2 / 2
    return rho + 2 * math.sqrt(rho * math.log(1 / delta))
