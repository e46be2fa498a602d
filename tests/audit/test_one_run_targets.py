"""``dpvision audit --one-run`` on dpvision's own training paths: the white-box canaries move
each release by at most its sensitivity, honest runs stay under their claim, planted bugs
(patched in only inside ``benchmarks/audit_one_run.py``'s ``planted()``) are caught."""

import json
import math

import numpy as np
import pytest
import torch
from planted_bugs import bench

from dpvision.audit.harness import audit_config
from dpvision.audit.one_run_harness import OneRunSettings, one_run_config, run_one_run_audit
from dpvision.audit.one_run_targets import CANARY_SIGNAL, make_one_run_target
from dpvision.audit.targets import GradientCanaries
from dpvision.cli import main
from dpvision.mechanisms import clipping
from dpvision.mechanisms.clip_policy import FlatClip


def _target(method, epsilon, canaries=200, **settings):
    settings = OneRunSettings(canaries=canaries, guesses=min(20, canaries // 2), **settings)
    config = one_run_config(None, {"method": method, "epsilon": epsilon}, [], settings)
    dataset = config.load_dataset()
    target = make_one_run_target(
        config,
        dataset,
        size=settings.dataset_size,
        canaries=canaries,
        canary=settings.canary,
        seed=settings.seed,
    )
    return target


@pytest.mark.parametrize("method", ["dp-ls", "dp-fc", "dp-newton", "dp-sgd-linear"])
def test_a_dirac_canary_moves_each_release_by_at_most_its_sensitivity(method):
    # Noise off: a left-out canary's score is exactly 0, a drawn-in one's is what it added
    # to each release over that release's sensitivity — at most 1 a release.
    target = _target(method, math.inf)
    included = np.random.default_rng(0).random(target.canaries) < 0.5
    scores = target.scores(included, seed=0)
    releases = sum(entry.get("count", 1) for entry in target.claim.ledger)
    assert np.all(scores[~included] == 0)
    assert np.all(scores[included] > 0)
    assert np.all(scores[included] <= releases * (1 + 1e-9))
    if method == "dp-ls":  # b̃, G̃ and Ã each moved by exactly their sensitivity
        np.testing.assert_allclose(scores[included], 3.0, rtol=1e-9)


def test_every_feature_learner_release_has_a_canary_signal():
    names = {entry["released"] for m in ("dp-ls", "dp-fc", "dp-newton", "dp-sgd-linear")
             for entry in _target(m, 1.0, canaries=10).claim.ledger}  # fmt: skip
    assert names <= set(CANARY_SIGNAL)


def test_a_gradient_canary_is_clipped_like_every_example(monkeypatch):
    canaries = GradientCanaries(np.array([0, 3, 5]), np.array([True, False, True]))
    sums = {"w": torch.zeros(1, 2, 2), "b": torch.zeros(1, 3)}
    canaries.add_to(sums, sample_rate=1.0, policy=FlatClip(0.5))
    assert sums["w"].reshape(-1).tolist() == [0.5, 0, 0, 0]
    assert sums["b"].reshape(-1).tolist() == [0, 0.5, 0]  # coordinate 5 is b[1]
    monkeypatch.setattr(clipping, "clip_factors", bench._no_clipping)
    canaries.add_to(sums, sample_rate=1.0, policy=FlatClip(0.5))
    assert sums["w"].reshape(-1)[0] == pytest.approx(0.5 + 5.0)  # 10·C when not clipped


@pytest.mark.parametrize("method", ["dp-ls", "dp-sgd"])
def test_honest_targets_stay_under_their_claim(method):
    report = bench.audit_target(method, "honest", 1.0, seed=0)
    assert report["claimed_epsilon"] <= 1.0
    assert 0 <= report["epsilon_lower_bound"] <= report["claimed_epsilon"]
    assert not report["violation"]


@pytest.mark.parametrize(
    ("method", "condition"),
    [
        ("dp-ls", "0.3 of the noise"),
        ("dp-sgd", "0.3 of the noise"),
        ("dp-ls", "no clipping"),
        ("dp-sgd", "no clipping"),
    ],
)
def test_planted_bugs_in_dpvision_targets_are_caught(method, condition):
    report = bench.audit_target(method, condition, 1.0, seed=0)
    assert report["claimed_epsilon"] <= 1.0
    assert report["epsilon_lower_bound"] > report["claimed_epsilon"]
    assert report["violation"]


@pytest.mark.parametrize("method", ["dp-ls", "dp-sgd"])
def test_black_box_mislabeled_canaries_run_and_stay_under_the_claim(method):
    settings = OneRunSettings(canaries=200, guesses=20, canary="mislabeled")
    config = one_run_config(None, {"method": method, "epsilon": 2.0}, [], settings)
    report = run_one_run_audit(config, settings)
    assert report["canary"] == "mislabeled"
    assert report["guesses"] == 40
    assert len(report["scores_included"]) + len(report["scores_excluded"]) == 200
    assert report["epsilon_lower_bound"] <= report["claimed_epsilon"]


def test_the_one_run_config_keeps_what_the_user_sets():
    settings = OneRunSettings()
    mine = one_run_config(None, {"method": "dp-sgd"}, ["learner.batch_size=64"], settings)
    assert mine.dpsgd.batch_size == 64
    full = one_run_config(None, {"method": "dp-sgd"}, [], settings)
    assert full.dpsgd.batch_size == settings.dataset_size + settings.canaries
    plain = audit_config(None, {"method": "dp-sgd"}, [])[0]
    assert plain.dpsgd.model == full.dpsgd.model  # the audit's small model either way


def test_cli_one_run_prints_json_and_writes_a_histogram(tmp_path, capsys):
    png = tmp_path / "scores.png"
    code = main(
        [
            "audit", "--one-run", "--method", "dp-ls", "--epsilon", "2", "--canaries", "300",
            "--guesses", "30", "--histogram", str(png), "--json", "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    for key in (
        "epsilon_lower_bound", "claimed_epsilon", "canaries", "guesses", "correct",
        "confidence", "score", "privacy_ledger", "wall_seconds",
    ):  # fmt: skip
        assert key in report
    assert report["audit"] == "one-run"
    assert report["canaries"] == 300
    assert report["guesses"] == 60
    assert report["delta"] == pytest.approx(1e-5)
    assert report["confidence"] == pytest.approx(0.95)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_one_run_summary(tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(
        [
            "audit", "--one-run", "--method", "dp-sgd", "--epsilon", "1", "--canaries", "200",
            "--guesses", "20", "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "one-run audit of dp-sgd" in printed
    assert "no violation found" in printed
    assert json.loads(out.read_text())["method"] == "dp-sgd"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--one-run", "--runs", "10"], "--runs applies to the two-phase audit only"),
        (["--one-run", "--sweep", "learner.clip_norm=1"], "--sweep applies"),
        (["--guesses", "10"], "--guesses applies to --one-run only"),
        (["--one-run", "--canaries", "100", "--guesses", "60"], "need at least 120"),
        (["--one-run", "--canary", "blank"], "unknown one-run canary"),
        (["--one-run", "--canaries", "0"], "canaries"),
        (["--one-run", "--method", "dp-sgd", "--canaries", "5000"], "parameters"),
        (["--one-run", "--canary", "mislabeled", "--canaries", "2000"], "fewer than"),
        (["--one-run", "--set", "preprocessing.kind='group-norm'"], "preprocessing"),
    ],
)
def test_cli_one_run_bad_input_is_one_line(argv, message, capsys):
    try:
        code = main(["audit", "--quiet", *argv])
    except SystemExit as exit:  # paths are checked when the arguments are parsed
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1


def test_honest_dp_sgd_over_seeds_exceeds_its_claim_no_more_often_than_allowed():
    # At 95 % confidence a valid bound may exceed the claim in 5 % of audits; over 20 seeds
    # P[Binomial(20, 0.05) >= 4] = 1.6 %, so 4 or more would be evidence of a bug.
    exceeded = [
        bench.audit_target("dp-sgd", "honest", 2.0, seed=seed)["violation"] for seed in range(20)
    ]
    assert sum(exceeded) <= 3
