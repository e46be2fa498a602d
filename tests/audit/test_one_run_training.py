"""One-run audit of a user's own PrivacyEngine loop (the loop, the Dirac canaries and the
planted bugs of ``benchmarks/audit_one_run.py``): honest stays under its claim, 0.3 of the
noise, no noise and no clipping are caught."""

import importlib.util
from pathlib import Path

import pytest

from dpvision.audit import audit_training

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "audit_one_run.py"
SPEC = importlib.util.spec_from_file_location("audit_one_run", PATH)
assert SPEC is not None
assert SPEC.loader is not None
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)
EPSILON = 2.0


def test_an_honest_user_loop_stays_under_its_claim():
    report = bench.audit("honest", EPSILON, seed=0)
    assert report["canaries"] == bench.CANARIES
    assert report["guesses"] == 2 * bench.GUESSES
    assert 0 <= report["epsilon_lower_bound"] <= EPSILON
    assert not report["violation"]


@pytest.mark.parametrize("condition", ["0.3 of the noise", "no noise", "no clipping"])
def test_a_planted_bug_in_a_user_loop_is_caught(condition):
    report = bench.audit(condition, EPSILON, seed=0)
    assert report["claimed_epsilon"] == EPSILON  # the loop still claims ε = 2 ...
    assert report["epsilon_lower_bound"] > EPSILON  # ... and is refuted
    assert report["violation"]


def test_the_bugs_are_planted_only_inside_the_block():
    with bench.planted("no noise"):
        pass
    test_an_honest_user_loop_stays_under_its_claim()


def test_one_audit_is_one_training_run():
    base, canaries = bench.dirac_data(0)
    runs = []

    def train(dataset):
        model = bench.user_loop(dataset, EPSILON)
        runs.append(model)
        return model

    audit_training(
        train, base=base, canaries=canaries, epsilon=EPSILON, delta=bench.DELTA,
        guess_in=10, guess_out=10,
    )  # fmt: skip
    assert len(runs) == 1
