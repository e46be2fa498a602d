"""ε of repeated Poisson-sampled Gaussian steps in milliseconds: cached composition.

A training loop asks for ε after every step (progress bars, Opacus' ``get_epsilon``), and
every answer composes the same few steps k times. dp-accounting's accountants rebuild a step's
privacy loss distribution (PLD) and RDP curve from scratch on each call (≈ 1 s on a CPU core),
then self-compose the PLD by FFT and scan it for ε in Python. Here, per (σ, q):

* the step's RDP curve is computed once (:func:`step_rdp`); k steps are k times it, summed
  over the record's runs in order, as dp-accounting's RDP accountant sums them;
* the step's PLD is built once per discretisation, by dp-accounting (:func:`step_pld`), and
  the Fourier transform of each of its two loss distributions is kept, so k steps cost one
  elementwise power and one inverse FFT: the arithmetic of dp-accounting's ``self_compose``
  (its tail bounds, transform length and truncation), so the composed distribution is
  dp-accounting's up to round-off;
* ε is read from the composed distribution by a vectorised form of dp-accounting's scan.

A record of several runs (σ or q changed) composes the runs' PLDs with dp-accounting's own
``compose``, as its accountant does. Anything else (full batch, Laplace, selections) is left
to the accountants of :mod:`.accountants`.

Privacy:
  Public accounting only: (σ, q, k, δ) in, ε out; touches no data.
"""

import functools
import math
from dataclasses import dataclass

import dp_accounting
import numpy as np
from dp_accounting.pld import pld_pmf, privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import fft, special

TAIL_MASS_TRUNCATION = 1e-15
"""What dp-accounting's ``self_compose`` and ``compose`` may truncate (their default)."""

Run = tuple[float, float, int]
"""(noise multiplier σ, sampling rate q, steps): consecutive steps with the same σ and q."""


def poisson_gaussian_runs(event: dp_accounting.DpEvent) -> tuple[Run, ...] | None:
    """``event`` as runs of Poisson-sampled Gaussian steps (0 < q < 1, σ > 0), in order; or
    ``None`` when it holds anything else (left to dp-accounting's accountants)."""
    if isinstance(event, dp_accounting.ComposedDpEvent):
        runs: list[Run] = []
        for inner in event.events:
            found = poisson_gaussian_runs(inner)
            if found is None:
                return None
            runs += found
        return tuple(runs)
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        found = poisson_gaussian_runs(event.event)
        return None if found is None else tuple((s, q, n * event.count) for s, q, n in found)
    if isinstance(event, dp_accounting.PoissonSampledDpEvent) and isinstance(
        event.event, dp_accounting.GaussianDpEvent
    ):
        sigma, rate = float(event.event.noise_multiplier), float(event.sampling_probability)
        if sigma > 0 and 0 < rate < 1:
            return ((sigma, rate, 1),)
    return None


@functools.lru_cache(maxsize=64)
def step_rdp(sigma: float, rate: float, orders: tuple[float, ...]) -> np.ndarray:
    """The RDP curve of one Poisson-sampled Gaussian step at ``orders`` (dp-accounting's)."""
    accountant = rdp_privacy_accountant.RdpAccountant(list(orders))
    step = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(step)
    curve = np.asarray(accountant.rdp, dtype=float)
    curve.flags.writeable = False
    return curve


def runs_rdp(runs: tuple[Run, ...], orders: tuple[float, ...]) -> np.ndarray:
    """The RDP curve of ``runs``: each run's step curve times its steps, summed in order."""
    total = np.zeros(len(orders))
    for sigma, rate, count in runs:
        total = total + count * step_rdp(sigma, rate, orders)
    return total


@functools.lru_cache(maxsize=4)  # a step's PLD and transforms: a few MB each
def step_pld(sigma: float, rate: float, interval: float) -> "_StepPld":
    """One step's PLD (dp-accounting's, pessimistic, add/remove-one), with its transforms."""
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma,
        value_discretization_interval=interval,
        sampling_prob=rate,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )
    return _StepPld(pld)


@dataclass
class _DensePmf:
    """One of a step PLD's loss distributions, with what composing it k times reuses."""

    probs: np.ndarray
    lower_loss: int
    infinity_mass: float
    discretization: float
    log_spectrum: tuple[int, np.ndarray] | None = None  # (length, log of the real FFT)

    @functools.cached_property
    def tail_moments(self) -> tuple[np.ndarray, np.ndarray]:
        """The orders dp-accounting bounds a composition's tails at (Chernoff), and the log
        moment generating function of the loss index at each (computed once per step)."""
        orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / len(self.probs)
        index = np.arange(len(self.probs))
        log_mgfs = [special.logsumexp(index * order, b=self.probs) for order in orders]
        return orders, np.array(log_mgfs)

    def self_compose(self, count: int) -> "_DensePmf":
        """The distribution of ``count`` steps: dp-accounting's ``self_compose`` (tail
        truncation :data:`TAIL_MASS_TRUNCATION`) with this step's transform kept."""
        lower, upper = 0, (len(self.probs) - 1) * count
        for order, log_mgf in zip(*self.tail_moments, strict=True):
            bound = (count * log_mgf + math.log(2 / TAIL_MASS_TRUNCATION)) / order
            if not math.isfinite(bound):
                continue
            if order > 0:
                upper = min(upper, math.ceil(bound))
            else:
                lower = max(lower, math.floor(bound))
        length = upper - lower + 1
        needed = max(length, len(self.probs))
        # dp-accounting's transform length: the next fast length at or above what it needs
        # (the cycle decides which truncated tail mass wraps around, so another length
        # moved ε by 0.4 % at δ = 1e-12); consecutive counts mostly share it.
        fast = fft.next_fast_len(needed)
        spectrum = self.log_spectrum  # one read: another thread may replace it meanwhile
        if spectrum is None or spectrum[0] != fast:
            with np.errstate(divide="ignore"):  # a zero of the transform stays zero
                spectrum = (fast, np.log(fft.rfft(self.probs, fast)))
            self.log_spectrum = spectrum
        fast, log_spectrum = spectrum
        # The transform to the power count, as exp(count · log): what numpy's power does
        # for count ≥ 100; the real transform is the complex one's first half (real probs).
        composed = fft.irfft(np.exp(count * log_spectrum), fast)
        infinity = TAIL_MASS_TRUNCATION - math.expm1(count * math.log1p(-self.infinity_mass))
        return _DensePmf(
            np.roll(composed, -lower)[:length],
            self.lower_loss * count + lower,
            infinity,
            self.discretization,
        )

    def epsilon(self, delta: float) -> float:
        """The smallest ε ≥ 0 whose hockey-stick divergence is at most ``delta``:
        dp-accounting's scan from the largest loss down, vectorised."""
        try:
            return scan_epsilon(
                self.probs, self.lower_loss, self.infinity_mass, self.discretization, delta
            )
        except FloatingPointError:  # exp(-loss) overflows before the scan stops: its own
            dense = pld_pmf.DensePLDPmf(
                self.discretization, self.lower_loss, self.probs, self.infinity_mass, True
            )
            return float(dense.get_epsilon_for_delta(delta))


def scan_epsilon(
    probs: np.ndarray,
    lower_loss: int,
    infinity_mass: float,
    interval: float,
    delta: float,
    chunk: int = 4096,
) -> float:
    """ε at ``delta`` of a dense pessimistic loss distribution (loss of ``probs[i]`` is
    ``(lower_loss + i) · interval``): dp-accounting's ``_get_epsilon_for_delta`` (accumulate
    the upper and lower masses from the largest loss down; stop where ε reaches the next
    loss), as cumulative sums in the same order, ``chunk`` losses first, then twice as many
    each time (the stop is usually near the top)."""
    if infinity_mass > delta:
        return math.inf
    flipped, top = probs[::-1], (lower_loss + len(probs) - 1) * interval
    mass_upper, mass_lower = infinity_mass, 0.0
    start = 0
    while start < len(probs):
        p = flipped[start : start + chunk]
        losses = top - interval * np.arange(start, start + len(p))
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            upper = np.cumsum(np.concatenate(([mass_upper], p)))  # upper[i]: before loss i
            lower = np.cumsum(np.concatenate(([mass_lower], np.exp(-losses) * p)))
            stop = (upper[:-1] > delta) & (lower[:-1] > 0)
            stop &= np.log((upper[:-1] - delta) / np.where(stop, lower[:-1], 1.0)) >= losses
            underflow = (upper[1:] >= delta) & (lower[1:] == 0)
        first = int(np.argmax(stop)) if stop.any() else len(p)
        if underflow[:first].any():  # a loss so large that exp(-loss) is 0
            return max(0.0, float(losses[int(np.argmax(underflow))]))
        mass_upper, mass_lower = float(upper[first]), float(lower[first])
        if first < len(p):
            break
        start, chunk = start + len(p), 2 * chunk
    if not math.isfinite(mass_lower):
        raise FloatingPointError("the loss distribution overflows exp(-loss)")
    if mass_upper <= mass_lower + delta:
        return 0.0
    return math.log((mass_upper - delta) / mass_lower)


class _StepPld:
    """A step's PLD from dp-accounting and its two loss distributions, ready to compose."""

    def __init__(self, pld: privacy_loss_distribution.PrivacyLossDistribution) -> None:
        self.pld = pld
        pmfs = (pld._pmf_remove, pld._pmf_add)
        # A step of tiny ε is a sparse distribution, which dp-accounting composes otherwise:
        # such a step is left to dp-accounting (it is small, so fast there too).
        self.dense = all(isinstance(pmf, pld_pmf.DensePLDPmf) for pmf in pmfs)
        self.pmfs = tuple(_dense(pmf) for pmf in pmfs) if self.dense else ()

    def prepare(self) -> None:
        """Computes what every composition of the step reads (its tails' moments)."""
        for pmf in self.pmfs:
            _ = pmf.tail_moments

    def epsilon(self, count: int, delta: float) -> float:
        """ε at ``delta`` of ``count`` such steps (the larger of the remove and add sides),
        composed into the identity as dp-accounting's accountant does (its ``compose``
        truncates the tails once more, the right one into the infinite loss)."""
        return max(_into_identity(pmf.self_compose(count)).epsilon(delta) for pmf in self.pmfs)


def _into_identity(pmf: _DensePmf) -> _DensePmf:
    """``pmf`` composed with the identity, as ``DensePLDPmf.compose`` does it: the same
    probabilities, tails truncated by :data:`TAIL_MASS_TRUNCATION` (pessimistically)."""
    offset, probs, right_tail = pld_pmf._truncate_tails(pmf.probs, TAIL_MASS_TRUNCATION, True)
    return _DensePmf(
        np.asarray(probs, dtype=float),
        pmf.lower_loss + int(offset),
        pmf.infinity_mass + float(right_tail),
        pmf.discretization,
    )


def _dense(pmf: pld_pmf.PLDPmf) -> _DensePmf:
    """The arrays of a dp-accounting loss distribution (it has no public accessor for them;
    pyproject pins dp-accounting below 0.7, and tests/accounting/test_repeated.py checks
    every ε against dp-accounting's own)."""
    dense = pmf.to_dense_pmf()
    return _DensePmf(
        np.asarray(dense._probs, dtype=float),
        int(dense._lower_loss),
        float(dense._infinity_mass),
        float(dense._discretization),
    )


@functools.lru_cache(maxsize=256)  # a progress bar and a log line ask for the same ε
def runs_epsilon(runs: tuple[Run, ...], delta: float, interval: float) -> float:
    """ε at ``delta`` of ``runs`` by PLD at discretisation ``interval``, as dp-accounting's
    PLD accountant computes it: one run from the cached step and its transforms; several
    composed by dp-accounting's ``compose``, then scanned."""
    if len(runs) == 1:
        sigma, rate, count = runs[0]
        step = step_pld(sigma, rate, interval)
        if step.dense:
            return step.epsilon(count, delta)
    # Each run composed separately, in order (as the ledger's entries are), by dp-accounting.
    total = privacy_loss_distribution.identity(interval)
    for sigma, rate, count in runs:
        total = total.compose(step_pld(sigma, rate, interval).pld.self_compose(count))
    return max(_dense(pmf).epsilon(delta) for pmf in (total._pmf_remove, total._pmf_add))
