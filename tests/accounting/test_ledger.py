"""The privacy ledger: composition equals dp-accounting's, JSON round trip, validation."""

import json

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from dpvision.accounting import RDP_ORDERS, LedgerEntry, PrivacyLedger
from dpvision.errors import DPVisionError


def _composed_run() -> PrivacyLedger:
    ledger = PrivacyLedger()
    ledger.record(noise_multiplier=8.0, released="mean of clipped features", l2_sensitivity=1.0)
    for _ in range(500):
        ledger.record(
            noise_multiplier=1.1,
            sample_rate=0.01,
            released="DP-SGD gradient sum",
            l2_sensitivity=1.0,
        )
    return ledger


def _reference_event() -> dp_accounting.DpEvent:
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.GaussianDpEvent(8.0),
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1)), 500
            ),
        ]
    )


def test_consecutive_identical_releases_are_merged():
    ledger = _composed_run()
    assert [(e.released, e.count, e.sampling) for e in ledger] == [
        ("mean of clipped features", 1, "none"),
        ("DP-SGD gradient sum", 500, "poisson"),
    ]
    assert ledger.total_count == 501


@pytest.mark.parametrize("delta", [1e-5, 1e-6])
def test_composed_ledger_equals_dp_accounting(delta):
    ledger = _composed_run()
    reference_pld = pld.PLDAccountant(value_discretization_interval=1e-4)
    reference_pld.compose(_reference_event())
    assert ledger.epsilon(delta, "pld") == pytest.approx(
        reference_pld.get_epsilon(delta), rel=1e-12
    )
    reference_rdp = rdp.RdpAccountant(list(RDP_ORDERS))
    reference_rdp.compose(_reference_event())
    assert ledger.epsilon(delta, "rdp") == pytest.approx(
        reference_rdp.get_epsilon(delta), rel=1e-12
    )
    assert ledger.epsilon(delta) == ledger.epsilon(delta, "pld")  # default for sampled runs


def test_json_round_trip_preserves_everything():
    ledger = _composed_run()
    text = ledger.to_json()
    restored = PrivacyLedger.from_json(text)
    assert restored == ledger
    assert restored.epsilon(1e-5, "pld") == ledger.epsilon(1e-5, "pld")
    data = json.loads(text)
    assert data["neighboring_relation"] == "add_or_remove_one"
    assert data["entries"][1] == {
        "noise_multiplier": 1.1,
        "sample_rate": 0.01,
        "count": 500,
        "released": "DP-SGD gradient sum",
        "l2_sensitivity": 1.0,
        "mechanism": "gaussian",
        "sampling": "poisson",
    }


def test_extend_appends_a_later_phase():
    phase1, phase2 = PrivacyLedger(), PrivacyLedger()
    phase1.record(noise_multiplier=2.0, sample_rate=0.1, count=96, released="phase II step")
    phase2.record(noise_multiplier=2.0, sample_rate=0.1, count=779, released="phase III step")
    phase1.extend(phase2)
    assert [e.count for e in phase1] == [96, 779]


def test_full_batch_ledger_uses_exact_gaussian_by_default():
    ledger = PrivacyLedger()
    ledger.record(noise_multiplier=5.0, count=3, released="noisy sufficient statistics")
    assert ledger.epsilon(1e-5) == ledger.epsilon(1e-5, "gaussian")


@pytest.mark.parametrize(
    "payload",
    [
        "not json",
        json.dumps({"format": "something-else", "entries": []}),
        json.dumps({"format": "dpvision-ledger/1", "neighboring_relation": "replace_one"}),
        json.dumps(
            {
                "format": "dpvision-ledger/1",
                "neighboring_relation": "add_or_remove_one",
                "entries": [
                    {"noise_multiplier": -1, "sample_rate": 1, "count": 1, "released": "x"}
                ],
            }
        ),
        json.dumps(
            {
                "format": "dpvision-ledger/1",
                "neighboring_relation": "add_or_remove_one",
                "entries": [{"sample_rate": 1, "count": 1}],
            }
        ),
    ],
)
def test_malformed_ledger_is_a_clear_error(payload):
    with pytest.raises(DPVisionError):
        PrivacyLedger.from_json(payload)


def test_entry_validation():
    with pytest.raises(DPVisionError, match="sample_rate"):
        LedgerEntry(noise_multiplier=1.0, sample_rate=0.0, count=1, released="x")
    with pytest.raises(DPVisionError, match="count"):
        LedgerEntry(noise_multiplier=1.0, sample_rate=1.0, count=0, released="x")


def test_non_private_release_makes_epsilon_infinite():
    import math

    ledger = PrivacyLedger()
    ledger.record(noise_multiplier=2.0, released="noisy sum")
    ledger.record_non_private(released="exact Gram matrix (non-private baseline)")
    assert not ledger.is_private
    for accountant in ("pld", "rdp", "classic-rdp", "gaussian"):
        assert math.isinf(ledger.epsilon(1e-5, accountant))
    assert PrivacyLedger.from_json(ledger.to_json()) == ledger
