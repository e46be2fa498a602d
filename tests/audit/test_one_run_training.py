"""One-run audit of users' own PrivacyEngine loops (the loops, the Dirac canaries and the
planted bugs of ``benchmarks/audit_one_run.py``): honest loops stay under their claim; 0.3
of the noise, no noise, no clipping and the engine bugs of the privacy-fixes issue are
caught, except one that no per-canary audit can see (and the sensitivity checker does)."""

import pytest
import torch
from planted_bugs import bench

from dpvision.audit import audit_training
from dpvision.testing import check_sensitivity, privacy_engine_release

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


# --- the PrivacyEngine bugs of the privacy-fixes issue, re-planted --------------------------


@pytest.mark.parametrize(
    "condition", ["per-row clipping", "pending chunk released", "noise per chunk, no √"]
)
def test_a_planted_engine_bug_is_caught_in_the_loop_that_shows_it(condition):
    report = bench.audit(condition, EPSILON, seed=0)
    assert report["claimed_epsilon"] == EPSILON
    assert report["epsilon_lower_bound"] > EPSILON
    assert report["violation"]


@pytest.mark.parametrize("loop", ["folds 4 positions", "two passes a step"])
def test_the_honest_engine_refuses_the_loops_of_bugs_1_and_2(loop):
    assert "refused" in bench.audit("honest", EPSILON, seed=0, loop=loop)


@pytest.mark.parametrize("loop", ["chunks of 100", "50 epochs, leaves after chunk 1"])
def test_honest_chunked_loops_stay_under_their_claim(loop):
    report = bench.audit("honest", EPSILON, seed=0, loop=loop)
    assert 0 <= report["epsilon_lower_bound"] <= EPSILON
    assert not report["violation"]


def test_passes_clipped_together_is_a_real_bug_that_one_run_does_not_see():
    # The planted bug moves the release by 1.49 C here (the neighbouring-dataset checker sees it),
    # but each canary's own coordinate still moves by at most C: what changes is how the
    # *other* rows pair up, which no per-canary score can attribute. The one-run audit's
    # bound stays under the claim; the checker and the engine's refusal are the guard.
    def two_passes(model, optimizer, loader):
        for x, y in loader:
            half = len(x) // 2
            optimizer.zero_grad()
            for part in (slice(0, half), slice(half, 2 * half)):
                torch.nn.functional.cross_entropy(model(x[part]), y[part]).backward()
            optimizer.step()

    torch.manual_seed(0)  # the model and data (the global stream is the previous test's)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()
    data = (torch.randn(8, 4, dtype=torch.float64), torch.arange(8) % 3)
    run = privacy_engine_release(model, two_passes, max_grad_norm=1.0)
    with bench.planted("passes clipped together"):
        report = check_sensitivity(run, data, positions=[0, 3], scale=30.0)
    assert report.refusal is None
    assert report.max_ratio > 1.2, report.summary()  # 1.49 C measured
    audit = bench.audit("passes clipped together", EPSILON, seed=0)
    assert audit["epsilon_lower_bound"] <= EPSILON
