"""Private selection: run a private mechanism a random number of times, keep the best run.

Papernot & Steinke (ICLR 2022, "Hyperparameter tuning with Renyi differential privacy")
bound the privacy of this selection when the number of runs K is itself random: the
mechanism Q (draw candidate hyper-parameters, train, score privately) is repeated K times
and only the best-scoring output is released. The loss grows by a term in the *mean* of K,
not by K-fold composition. :class:`Repetitions` is the distribution of K:

* ``shape = inf``: Poisson with mean μ (K may be 0: nothing is released), Theorem 6;
* ``0 ≤ shape < inf``: the truncated negative binomial TNB(η = shape, γ) on K ≥ 1, with γ
  chosen so that E[K] = μ; η = 1 is the geometric, η = 0 the logarithmic distribution,
  Theorem 2.

The accounting is dp-accounting's ``RepeatAndSelectDpEvent`` under its RDP accountant
(PLD has no rule for it), so an event containing one is accounted with ``rdp``
(:func:`~dpvision.accounting.default_accountant`).

Privacy: the theorems need Q to be one fixed mechanism; candidates drawn at random (from a
data-independent distribution) make Q a mixture, which is as private as its least private
component at every Rényi order (Rényi divergence is jointly quasi-convex: van Erven &
Harremoës 2014, Theorem 13; releasing which candidate ran keeps the bound).
:func:`selection_rdp` bounds Q by the pointwise maximum of the candidates' RDP curves, each
from dp-accounting's RDP accountant. The score Q outputs must itself be private (e.g. a
noisy count of correct validation examples) and its release part of Q's event.
"""

import dataclasses
import math
from collections.abc import Sequence

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from dpvision.accounting.accountants import RDP_ORDERS
from dpvision.errors import DPVisionError

__all__ = [
    "Repetitions",
    "rdp_curve",
    "repeat_and_select_event",
    "selection_epsilon",
    "selection_rdp",
]

_GAMMA_TOLERANCE = 1e-12


@dataclasses.dataclass(frozen=True)
class Repetitions:
    """The distribution of the number of runs K of a private selection.

    Attributes:
      mean: μ = E[K] ≥ 1.
      shape: ``math.inf`` (Poisson), or η ≥ 0 of the truncated negative binomial
        (1: geometric, 0: logarithmic). Smaller η gives a tighter bound at the same mean but
        a heavier tail of K.

    >>> Repetitions(mean=10, shape=1).gamma
    0.1
    """

    mean: float
    shape: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.mean, int | float) and math.isfinite(self.mean)) or self.mean < 1:
            raise DPVisionError(f"the mean number of runs must be a number >= 1, got {self.mean!r}")
        if not isinstance(self.shape, int | float) or math.isnan(self.shape) or self.shape < 0:
            raise DPVisionError(
                f"the shape of the number of runs must be >= 0 (inf: Poisson), got {self.shape!r}"
            )

    @property
    def poisson(self) -> bool:
        return math.isinf(self.shape)

    @property
    def gamma(self) -> float:
        """γ of TNB(η, γ) whose mean is :attr:`mean` (the success probability); ``nan`` for
        Poisson. The mean falls as γ grows, so γ is found by bisection, to 1e-12 relative,
        rounded down (the side on which the mean is at least :attr:`mean`)."""
        if self.poisson:
            return math.nan
        if self.shape == 1:
            return 1 / self.mean
        if self.mean == 1:
            return 1.0
        low, high = 0.0, 1.0
        while high - low > _GAMMA_TOLERANCE * high:
            middle = (low + high) / 2
            if _tnb_mean(middle, self.shape) < self.mean:
                high = middle
            else:
                low = middle
        return low

    def sample(self, rng: np.random.Generator) -> int:
        """Draws K from ``rng``, which must be secret: K depends on no data, but the bound
        holds only while K stays hidden (:mod:`dpvision.runs.tune`)."""
        if self.poisson:
            return int(rng.poisson(self.mean))
        gamma = self.gamma
        if gamma >= 1:
            return 1
        if self.shape == 0:
            return int(rng.logseries(1 - gamma))
        while True:  # the negative binomial conditioned on K >= 1
            draw = int(rng.negative_binomial(self.shape, gamma))
            if draw >= 1:
                return draw

    def describe(self) -> str:
        """The distribution in words, for logs and reports."""
        if self.poisson:
            return f"Poisson, mean {self.mean:g}"
        names = {0.0: "logarithmic", 1.0: "geometric"}
        name = names.get(float(self.shape), f"truncated negative binomial, η = {self.shape:g}")
        return f"{name}, mean {self.mean:g}"


def repeat_and_select_event(
    event: dp_accounting.DpEvent, repetitions: Repetitions
) -> dp_accounting.DpEvent:
    """Describes releasing the best of K runs of the mechanism ``event`` describes, K drawn
    from ``repetitions`` (the other runs' outputs are never released)."""
    return dp_accounting.dp_event.RepeatAndSelectDpEvent(
        event, float(repetitions.mean), float(repetitions.shape)
    )


def rdp_curve(event: dp_accounting.DpEvent, orders: Sequence[float] = RDP_ORDERS) -> np.ndarray:
    """The RDP of ``event`` at each of ``orders`` (dp-accounting's RDP accountant)."""
    accountant = rdp.RdpAccountant(list(orders))
    if not accountant.supports(event):
        raise DPVisionError(f"the RDP accountant cannot account for {type(event).__name__}")
    accountant.compose(event)
    return np.asarray(accountant.rdp, dtype=float)


def selection_rdp(
    candidates: Sequence[dp_accounting.DpEvent],
    repetitions: Repetitions,
    orders: Sequence[float] = RDP_ORDERS,
) -> np.ndarray:
    """The RDP at ``orders`` of releasing the best of K runs of Q, K ~ ``repetitions``,
    where each run of Q runs one of ``candidates`` drawn independently of the data.

    Q's RDP is bounded by the candidates' pointwise maximum (the mixture bound of the module
    docstring); the Papernot–Steinke rule is dp-accounting's, the one its RDP accountant
    applies to a ``RepeatAndSelectDpEvent`` (so one candidate gives exactly that event's
    RDP).
    """
    if not candidates:
        raise DPVisionError("a private selection needs at least one candidate")
    inner = np.max([rdp_curve(event, orders) for event in candidates], axis=0)
    # dp-accounting (pinned < 0.7) applies this rule inside RdpAccountant.compose and has
    # no public function for a curve that is not one DpEvent's; tests check it against the
    # public RepeatAndSelectDpEvent and against the paper's theorems computed afresh.
    return np.asarray(
        rdp._compute_rdp_repeat_and_select(
            list(orders), inner, float(repetitions.mean), float(repetitions.shape)
        ),
        dtype=float,
    )


def selection_epsilon(
    candidates: Sequence[dp_accounting.DpEvent],
    repetitions: Repetitions,
    *,
    delta: float,
    orders: Sequence[float] = RDP_ORDERS,
) -> float:
    """ε at ``delta`` of :func:`selection_rdp` (RDP to (ε, δ) by dp-accounting's
    conversion)."""
    epsilon, _ = rdp.compute_epsilon(
        list(orders), selection_rdp(candidates, repetitions, orders), delta
    )
    return max(0.0, float(epsilon))


def _tnb_mean(gamma: float, shape: float) -> float:
    """E[K] of TNB(η = shape, γ) (Papernot & Steinke, Section 2)."""
    if gamma >= 1:
        return 1.0
    if shape == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return float(shape * (1 - gamma) / (gamma * (1 - gamma**shape)))
