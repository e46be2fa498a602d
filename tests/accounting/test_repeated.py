"""The cached accounting of repeated steps (:mod:`dpvision.accounting.repeated`) gives the ε
dp-accounting's own accountants give, within 1e-6 relative, and fast on repeated calls."""

import math
import threading
import time

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from dp_accounting.pld import pld_pmf

from dpvision.accounting import PrivacyLedger, compute_epsilon, poisson_gaussian_event
from dpvision.accounting.accountants import (
    CLASSIC_RDP_ORDERS,
    RDP_ORDERS,
    Accountant,
    _pld_interval,
    prepare_steps,
)
from dpvision.accounting.repeated import (
    _DensePmf,
    poisson_gaussian_runs,
    runs_epsilon,
    scan_epsilon,
    step_pld,
)


def _reference(event: dp_accounting.DpEvent, delta: float, accountant: str) -> float:
    """ε as dpvision computed it before the cache: dp-accounting's accountants afresh."""
    rdp_accountant = rdp.RdpAccountant(list(RDP_ORDERS))
    rdp_accountant.compose(event)
    if accountant == "rdp":
        return float(rdp_accountant.get_epsilon(delta))
    if accountant == "classic-rdp":
        classic = rdp.RdpAccountant(list(CLASSIC_RDP_ORDERS))
        classic.compose(event)
        return min(
            r + math.log(1 / delta) / (a - 1)
            for a, r in zip(CLASSIC_RDP_ORDERS, classic.rdp, strict=True)
        )
    interval = _pld_interval(float(rdp_accountant.get_epsilon(delta)))
    accountant_ = pld.PLDAccountant(value_discretization_interval=interval)
    accountant_.compose(event)
    return float(accountant_.get_epsilon(delta))


CASES = [  # σ, q, steps, δ: DP-SGD's range, small ε (finer discretisation) and one step
    (1.0, 256 / 60000, 3000, 1e-5),
    (0.6, 0.02, 500, 1e-5),
    (4.0, 1024 / 50000, 10000, 1e-6),
    (13.0, 0.001, 1000, 1e-5),
    (1.1, 0.01, 1, 1e-5),
    (2.0, 0.5, 40, 1e-3),
    (0.8, 0.05, 10000, 1e-12),  # a transform longer than dp-accounting's moved ε 0.4 % here
    (1.0, 0.01, 1000, 1e-12),  # ... and 0.2 % here, below the exact value (the review's)
    (50.0, 1e-5, 6, 1e-12),  # a step of tiny ε: a sparse distribution, left to dp-accounting
]


@pytest.mark.parametrize("accountant", ["pld", "rdp", "classic-rdp"])
@pytest.mark.parametrize(("sigma", "rate", "steps", "delta"), CASES)
def test_same_epsilon_as_dp_accounting(accountant, sigma, rate, steps, delta):
    event = poisson_gaussian_event(noise_multiplier=sigma, sample_rate=rate, steps=steps)
    assert poisson_gaussian_runs(event) == ((sigma, rate, steps),)
    got = compute_epsilon(event, delta=delta, accountant=accountant)
    assert got == pytest.approx(_reference(event, delta, accountant), rel=1e-6)


def test_epsilon_does_not_depend_on_what_was_asked_before():
    """The cached transform is reused only at dp-accounting's own length: a count asked
    after a larger one gives what it gives asked first (the review saw 2e-5 apart)."""
    event = poisson_gaussian_event(noise_multiplier=1.0, sample_rate=0.01, steps=1000)
    step_pld.cache_clear()
    runs_epsilon.cache_clear()
    cold = compute_epsilon(event, delta=1e-10)
    runs_epsilon.cache_clear()
    for steps in (4000, 3000):
        larger = poisson_gaussian_event(noise_multiplier=1.0, sample_rate=0.01, steps=steps)
        compute_epsilon(larger, delta=1e-10)
        runs_epsilon.cache_clear()
        assert compute_epsilon(event, delta=1e-10) == cold


def test_several_runs_compose_as_the_pld_accountant():
    ledger = PrivacyLedger()  # a DP-RandP record: Phase II then Phase III, then more II
    ledger.record(noise_multiplier=2.0, sample_rate=0.02, count=50, released="head")
    ledger.record(noise_multiplier=1.2, sample_rate=0.04, count=300, released="whole model")
    ledger.record(noise_multiplier=2.0, sample_rate=0.02, count=10, released="head")
    ledger.record(noise_multiplier=2.0, sample_rate=0.02, count=5, released="head, again")
    event = ledger.dp_event()
    assert len(poisson_gaussian_runs(event)) == 4  # entries of one (σ, q) stay apart
    for delta in (1e-5, 1e-10):
        expected = _reference(event, delta, "pld")
        assert ledger.epsilon(delta) == pytest.approx(expected, rel=1e-6)


def test_other_events_are_left_to_the_accountants():
    assert poisson_gaussian_runs(dp_accounting.GaussianDpEvent(2.0)) is None
    mixed = dp_accounting.ComposedDpEvent(
        [poisson_gaussian_event(noise_multiplier=1.0, sample_rate=0.01, steps=5),
         dp_accounting.LaplaceDpEvent(1.0)]
    )  # fmt: skip
    assert poisson_gaussian_runs(mixed) is None
    assert poisson_gaussian_runs(dp_accounting.NonPrivateDpEvent()) is None
    zero_rate = dp_accounting.PoissonSampledDpEvent(0.0, dp_accounting.GaussianDpEvent(1.0))
    assert poisson_gaussian_runs(zero_rate) is None


def test_scan_matches_dp_accounting_on_the_composed_distribution():
    step = step_pld(1.0, 0.01, 1e-4)
    composed = step.pld.self_compose(700)
    for pmf in (composed._pmf_remove, composed._pmf_add):
        dense = pmf.to_dense_pmf()
        for delta in (1e-3, 1e-5, 1e-9):
            ours = scan_epsilon(
                dense._probs, dense._lower_loss, dense._infinity_mass,
                dense._discretization, delta,
            )  # fmt: skip
            assert ours == pytest.approx(pmf.get_epsilon_for_delta(delta), rel=1e-9, abs=1e-12)
    assert scan_epsilon(dense._probs, dense._lower_loss, 0.5, 1e-4, 1e-5) == math.inf


def test_a_call_per_step_costs_a_fraction_of_accounting_afresh():
    """A progress bar's pattern: ε after each of 100 steps of one (σ, q). The first call
    builds the step's PLD; the rest reuse it. Timed against one call of dp-accounting's
    accountants afresh (what every call cost before) in the same test, so that a loaded
    machine slows both."""
    ledger = PrivacyLedger()
    ledger.record(noise_multiplier=1.07, sample_rate=0.0171, count=900, released="DP-SGD")
    ledger.epsilon(1e-5)  # builds the step
    started = time.perf_counter()
    for _ in range(100):
        ledger.record(noise_multiplier=1.07, sample_rate=0.0171, count=1, released="DP-SGD")
        ledger.epsilon(1e-5)
    per_call = (time.perf_counter() - started) / 100
    started = time.perf_counter()
    _reference(ledger.dp_event(), 1e-5, "pld")
    afresh = time.perf_counter() - started
    assert per_call < afresh / 5, f"{1000 * per_call:.0f} ms a call, {1000 * afresh:.0f} afresh"


def test_an_overflowing_scan_is_left_to_dp_accounting():
    """Losses so negative that exp(-loss) overflows: the vectorised scan says so, and the
    distribution is scanned by dp-accounting's own code (which behaves as it always did)."""
    probs = np.array([0.5, 0.5])
    with pytest.raises(FloatingPointError):
        scan_epsilon(probs, -1_000_000, 0.0, 1e-3, 1e-5)
    dense = pld_pmf.DensePLDPmf(1e-3, -1_000_000, probs, 0.0, True)
    try:
        expected: object = dense.get_epsilon_for_delta(1e-5)
    except OverflowError as error:
        expected = type(error)
    try:
        got: object = _DensePmf(probs, -1_000_000, 0.0, 1e-3).epsilon(1e-5)
    except OverflowError as error:
        got = type(error)
    assert got == expected


def test_make_private_prepares_the_step_in_the_background_without_changing_epsilon():
    """``prepare_steps`` (called by ``PrivacyEngine.make_private``) builds the step's PLD in
    a thread; ε afterwards is the ε computed from nothing."""
    sigma, rate = 1.37, 0.0123
    event = poisson_gaussian_event(noise_multiplier=sigma, sample_rate=rate, steps=400)
    step_pld.cache_clear()
    runs_epsilon.cache_clear()
    cold = compute_epsilon(event, delta=1e-5)
    step_pld.cache_clear()
    runs_epsilon.cache_clear()
    prepare_steps(sigma, rate, Accountant.PLD)
    worker = next(t for t in threading.enumerate() if t.name == "dpvision-accounting")
    worker.join(timeout=60)
    assert step_pld.cache_info().currsize == 1
    assert compute_epsilon(event, delta=1e-5) == cold
    assert step_pld.cache_info().misses == 1  # the prepared step was used, not built again
    prepare_steps(0.0, rate, Accountant.PLD)  # nothing to prepare: no thread, no error
