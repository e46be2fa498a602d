"""Privacy accounting: DpEvents, accountants, calibration and the privacy ledger.

This subpackage depends only on NumPy, SciPy and dp-accounting; it never imports torch.

Typical use::

    from dpvision.accounting import (calibrate_noise_multiplier, compute_epsilon,
                                     poisson_gaussian_event)

    sigma = calibrate_noise_multiplier(target_epsilon=3.0, target_delta=1e-5,
                                       sample_rate=0.02, steps=5000)
    event = poisson_gaussian_event(noise_multiplier=sigma, sample_rate=0.02, steps=5000)
    compute_epsilon(event, delta=1e-5, accountant="pld")   # <= 3.0
"""

from dpvision.accounting.accountants import (
    CLASSIC_RDP_ORDERS,
    RDP_ORDERS,
    Accountant,
    compute_delta,
    compute_epsilon,
    default_accountant,
    parse_accountant,
)
from dpvision.accounting.calibration import (
    MAX_NOISE_MULTIPLIER,
    calibrate_noise_multiplier,
    calibrate_steps,
)
from dpvision.accounting.events import compose_events, gaussian_event, poisson_gaussian_event
from dpvision.accounting.gaussian import gaussian_delta, gaussian_epsilon, gdp_mu, zcdp_epsilon
from dpvision.accounting.ledger import LedgerEntry, PrivacyLedger
from dpvision.accounting.selection import Repetitions, repeat_and_select_event

__all__ = [
    "CLASSIC_RDP_ORDERS",
    "MAX_NOISE_MULTIPLIER",
    "RDP_ORDERS",
    "Accountant",
    "LedgerEntry",
    "PrivacyLedger",
    "Repetitions",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "compose_events",
    "compute_delta",
    "compute_epsilon",
    "default_accountant",
    "gaussian_delta",
    "gaussian_epsilon",
    "gaussian_event",
    "gdp_mu",
    "parse_accountant",
    "poisson_gaussian_event",
    "repeat_and_select_event",
    "zcdp_epsilon",
]
