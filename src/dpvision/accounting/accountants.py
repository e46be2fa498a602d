"""Accountants: (ε, δ) for a DpEvent, under add/remove-one adjacency.

Four accountants, all valid upper bounds on the privacy loss of the described mechanism:

* ``pld`` — privacy loss distributions (dp-accounting's ``PLDAccountant`` with pessimistic
  discretisation, interval min(1e-4, ε/1000)). The tightest for Poisson-sampled steps.
* ``rdp`` — Rényi DP (dp-accounting's ``RdpAccountant``) with the RDP-to-(ε, δ) conversion of
  Balle et al. (2020), minimised over :data:`RDP_ORDERS`.
* ``gaussian`` — exact μ-GDP composition of unsampled Gaussians (:mod:`.gaussian`): the
  tightest answer for full-batch learners; it refuses events with Poisson sampling.
* ``classic-rdp`` — Rényi DP with the older conversion ε = min_α [RDP(α) + log(1/δ)/(α − 1)]
  (Mironov 2017, Prop. 3), as in Opacus 0.13 and seed 004's code, over
  :data:`CLASSIC_RDP_ORDERS`. It is looser, and is here to reproduce published numbers.

For the same event, pld ≤ rdp ≤ classic-rdp (RDP_ORDERS contains CLASSIC_RDP_ORDERS, and the
Balle et al. conversion is tighter at every order), and gaussian ≤ pld for full batch.
"""

import enum
import logging
import math
import threading

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp

from dpvision.accounting._checks import check_delta, check_epsilon
from dpvision.accounting.gaussian import (
    gaussian_delta,
    gaussian_epsilon,
    gdp_mu,
    is_unsampled_gaussian,
)
from dpvision.accounting.repeated import (
    Run,
    poisson_gaussian_runs,
    runs_epsilon,
    runs_rdp,
    step_pld,
    step_rdp,
)
from dpvision.errors import DPVisionError


class Accountant(enum.StrEnum):
    """The privacy accountants dpvision offers (values are the CLI spellings)."""

    PLD = "pld"
    RDP = "rdp"
    GAUSSIAN = "gaussian"
    CLASSIC_RDP = "classic-rdp"


# Orders of Opacus 0.13, which seed 004's code uses, extended with large orders so that
# small-ε full-batch targets (optimal α in the hundreds) remain reachable.
CLASSIC_RDP_ORDERS: tuple[float, ...] = tuple(
    sorted(
        {round(1 + x / 10, 10) for x in range(1, 100)}
        | set(map(float, range(12, 64)))
        | {80.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0, 2048.0, 4096.0}
    )
)

# jax_privacy's grid (linspace(1.01, 8, 50) ∪ 8..63 ∪ linspace(65, 512, 10)), so that its
# published values are reproduced, joined with the classic orders and dp-accounting's
# default grid. A larger grid can only lower the RDP bound.
RDP_ORDERS: tuple[float, ...] = tuple(
    sorted(
        {round(float(a), 10) for a in np.linspace(1.01, 8, 50)}
        | set(map(float, range(8, 64)))
        | {float(a) for a in np.linspace(65, 512, 10, dtype=int)}
        | {float(a) for a in rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS}
        | set(CLASSIC_RDP_ORDERS)
    )
)

PLD_DISCRETIZATION = 1e-4
PLD_MIN_DISCRETIZATION = 1e-7


class _DropExcludedOrderNotices(logging.Filter):
    """Drops dp-accounting's notice that a fractional RDP order failed to converge.

    dp-accounting then *excludes* that order from the minimum, which can only make ε larger
    (conservative), and the remaining orders still bound it; at small σ it logs this once per
    order and per call, which would bury the output of calibration searches.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_DropExcludedOrderNotices())


def parse_accountant(name: "str | Accountant") -> Accountant:
    """Returns the :class:`Accountant` named ``name``, or a one-line error listing the choices."""
    try:
        return Accountant(name)
    except ValueError:
        choices = ", ".join(a.value for a in Accountant)
        raise DPVisionError(f"unknown accountant {name!r}; choose one of: {choices}") from None


def default_accountant(event: dp_accounting.DpEvent) -> Accountant:
    """The tightest valid accountant for ``event``: exact GDP for full batch, RDP for a
    private selection (:mod:`.selection`; PLD has no rule for it), else PLD."""
    if is_unsampled_gaussian(event):
        return Accountant.GAUSSIAN
    return Accountant.RDP if _has_selection(event) else Accountant.PLD


def _has_selection(event: dp_accounting.DpEvent) -> bool:
    """Whether ``event`` contains a repeat-and-select (a private selection) anywhere."""
    if isinstance(event, dp_accounting.dp_event.RepeatAndSelectDpEvent):
        return True
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return any(_has_selection(inner) for inner in event.events)
    inner = getattr(event, "event", None)  # self-composed and sampled events wrap one
    return isinstance(inner, dp_accounting.DpEvent) and _has_selection(inner)


def _rdp_accountant(event: dp_accounting.DpEvent, orders: tuple[float, ...]) -> rdp.RdpAccountant:
    accountant = rdp.RdpAccountant(list(orders))
    if not accountant.supports(event):
        raise DPVisionError(f"the RDP accountant cannot account for {type(event).__name__}")
    accountant.compose(event)
    return accountant


def _pld_interval(epsilon_scale: float) -> float:
    """The PLD discretisation interval for a run whose ε is about ``epsilon_scale``.

    The pessimistic discretisation error grows with the interval and the number of
    compositions; a fixed 1e-4 made PLD looser than RDP at ε ≈ 0.01 (σ = 13, q = 0.001,
    T = 1000: 0.01001 vs 0.00981, true ≈ 0.00878). A thousandth of ε keeps the error to
    about 0.1 % of ε; 1e-4 is kept for ε ≥ 0.1, where it already is that accurate.
    """
    if not math.isfinite(epsilon_scale):
        return PLD_DISCRETIZATION
    return min(PLD_DISCRETIZATION, max(PLD_MIN_DISCRETIZATION, epsilon_scale / 1000))


def _pld_accountant(event: dp_accounting.DpEvent, interval: float) -> pld.PLDAccountant:
    accountant = pld.PLDAccountant(value_discretization_interval=interval)
    if not accountant.supports(event):
        raise DPVisionError(f"the PLD accountant cannot account for {type(event).__name__}")
    accountant.compose(event)
    return accountant


def _classic_log_terms(
    event: dp_accounting.DpEvent, runs: "tuple[Run, ...] | None" = None
) -> tuple[np.ndarray, np.ndarray]:
    if runs is not None:
        curve = runs_rdp(runs, CLASSIC_RDP_ORDERS)
    else:
        curve = np.asarray(_rdp_accountant(event, CLASSIC_RDP_ORDERS).rdp, dtype=float)
    return np.asarray(CLASSIC_RDP_ORDERS, dtype=float), curve


def _rdp_epsilon(
    event: dp_accounting.DpEvent, runs: "tuple[Run, ...] | None", delta: float
) -> float:
    """ε at ``delta`` by RDP over :data:`RDP_ORDERS` (Balle et al.'s conversion, as
    dp-accounting's ``RdpAccountant``); from the cached step curves when ``runs`` holds the
    event."""
    if runs is None:
        return float(_rdp_accountant(event, RDP_ORDERS).get_epsilon(delta))
    epsilon, _ = rdp.rdp_privacy_accountant.compute_epsilon(
        list(RDP_ORDERS), runs_rdp(runs, RDP_ORDERS), delta
    )
    return float(epsilon)


def compute_epsilon(
    event: dp_accounting.DpEvent,
    *,
    delta: float,
    accountant: "Accountant | str | None" = None,
) -> float:
    """Returns the ε at which ``event`` is (ε, δ)-DP under add/remove-one adjacency.

    Args:
      event: What ran, e.g. from :func:`~dpvision.accounting.poisson_gaussian_event`.
      delta: The target δ in (0, 1).
      accountant: Which accountant; ``None`` picks :func:`default_accountant`.

    Returns:
      ε ≥ 0 (``inf`` when no finite ε holds, e.g. for a non-private event).

    >>> from dpvision.accounting import poisson_gaussian_event
    >>> event = poisson_gaussian_event(noise_multiplier=4.0, sample_rate=1024 / 50000,
    ...                                steps=10000)
    >>> round(compute_epsilon(event, delta=1e-5, accountant="pld"), 4)
    2.0925
    """
    delta = check_delta(delta)
    which = default_accountant(event) if accountant is None else parse_accountant(accountant)
    if which is Accountant.GAUSSIAN:
        return gaussian_epsilon(mu=gdp_mu(event), delta=delta)
    runs = poisson_gaussian_runs(event)  # DP-SGD's record: cached per (σ, q), see .repeated
    if which is Accountant.PLD:
        # RDP (cheap) sizes the discretisation to the ε being computed.
        scale = _rdp_epsilon(event, runs, delta)
        if runs is not None:
            return max(0.0, runs_epsilon(runs, delta, _pld_interval(scale)))
        return max(0.0, float(_pld_accountant(event, _pld_interval(scale)).get_epsilon(delta)))
    if which is Accountant.RDP:
        return max(0.0, _rdp_epsilon(event, runs, delta))
    orders, rdp_values = _classic_log_terms(event, runs)
    with np.errstate(over="ignore", invalid="ignore"):
        candidates = rdp_values + math.log(1 / delta) / (orders - 1)
    best = float(np.nanmin(candidates))
    return max(0.0, best)


def prepare_steps(noise_multiplier: float, sample_rate: float, accountant: Accountant) -> None:
    """Builds, in a background thread, what ε of Poisson-sampled Gaussian steps (σ, q) will
    need (:mod:`.repeated`: the step's RDP curve, and its PLD at the discretisation of any ε
    ≥ 0.1), so that a training loop's first ``get_epsilon`` does not wait for it. Changes no
    value: ε is computed as without it. Public arguments only; touches no data."""
    if not (noise_multiplier > 0 and 0 < sample_rate < 1):
        return

    def build() -> None:
        step_rdp(noise_multiplier, sample_rate, RDP_ORDERS)
        if accountant is Accountant.PLD:
            step_pld(noise_multiplier, sample_rate, PLD_DISCRETIZATION).prepare()
        elif accountant is Accountant.CLASSIC_RDP:
            step_rdp(noise_multiplier, sample_rate, CLASSIC_RDP_ORDERS)

    threading.Thread(target=build, name="dpvision-accounting", daemon=True).start()


def compute_delta(
    event: dp_accounting.DpEvent,
    *,
    epsilon: float,
    accountant: "Accountant | str | None" = None,
) -> float:
    """Returns the δ at which ``event`` is (ε, δ)-DP under add/remove-one adjacency."""
    epsilon = check_epsilon(epsilon)
    which = default_accountant(event) if accountant is None else parse_accountant(accountant)
    if which is Accountant.GAUSSIAN:
        return gaussian_delta(mu=gdp_mu(event), epsilon=epsilon)
    if which is Accountant.PLD:
        return min(1.0, float(_pld_accountant(event, _pld_interval(epsilon)).get_delta(epsilon)))
    if which is Accountant.RDP:
        return min(1.0, float(_rdp_accountant(event, RDP_ORDERS).get_delta(epsilon)))
    orders, rdp_values = _classic_log_terms(event)
    with np.errstate(over="ignore", invalid="ignore"):
        log_deltas = (orders - 1) * (rdp_values - epsilon)
    return min(1.0, math.exp(float(np.nanmin(log_deltas))))
