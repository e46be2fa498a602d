"""The audited trainings: the stacked many-run DP-SGD is the engine users run, run R times."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from dpvision.accounting import PrivacyLedger
from dpvision.audit import make_audit_data
from dpvision.audit.targets import DPSGDTarget, LearnerTarget, make_target
from dpvision.config import resolve
from dpvision.data import load_dataset
from dpvision.errors import DPVisionError
from dpvision.learners import DPLeastSquares
from dpvision.mechanisms import PoissonSampler
from dpvision.training import DPSGDStep, ParameterEMA
from dpvision.training.optimizers import make_optimizer

SMALL_SGD = [
    "learner.model='mlp-16'",
    "learner.batch_size=16",
    "learner.steps=12",
    "learner.learning_rate=0.5",
    "learner.momentum=0.9",
    "learner.ema_decay=0.9",
    "learner.normalization='none'",
]


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _sgd_target(digits, sets=(), **flags):
    data = make_audit_data(digits, size=30, canary="noise")
    flags = {"method": "dp-sgd", "delta": 1 / 30, **flags}
    return DPSGDTarget(resolve(None, flags, [*SMALL_SGD, *sets]), data)


def test_one_stacked_run_is_the_dpsgd_engine_step_for_step(digits):
    """Same seeds: the stacked trainer draws the batches and the noise DPSGDStep draws."""
    target = _sgd_target(digits, noise_multiplier=1.3)
    stacked = target.train(True, 1, sampler_seed=5, noise_seed=6, augment_seed=7)

    model = target.model
    model.load_state_dict({k: v.clone() for k, v in target.init.items()})
    optimizer = make_optimizer(target.options, model)
    ema = ParameterEMA(model, 0.9)
    step = DPSGDStep.build(
        model=model,
        optimizer=optimizer,
        loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"),
        noise_multiplier=1.3,
        max_grad_norm=1.0,
        sample_rate=16 / 30,
        num_examples=30,
        ledger=PrivacyLedger(),
        generator=torch.Generator().manual_seed(6),
    )
    x, y = target.inputs, target.targets
    for indices in PoissonSampler(num_examples=31, sample_rate=16 / 30, steps=12, seed=5):
        index = torch.as_tensor(indices)
        step([(x[index], y[index])])
        ema.update(model)
    for name, value in ema.shadow.items():
        torch.testing.assert_close(stacked[name][0], value, atol=2e-6, rtol=1e-5)
    assert target.last_ledger == step.context.ledger


def test_stacked_runs_do_not_mix(digits):
    """No noise, full batch: every run follows the single-run trajectory exactly."""
    target = _sgd_target(digits, ["learner.batch_size=30"], noise_multiplier=0)
    single = target.train(False, 1, sampler_seed=0, noise_seed=0, augment_seed=0)
    many = target.train(False, 5, sampler_seed=1, noise_seed=1, augment_seed=1)
    for name, value in single.items():
        torch.testing.assert_close(many[name], value.expand_as(many[name]), atol=1e-6, rtol=1e-5)


def test_stacked_runs_are_independent_and_claim_what_ran(digits):
    target = _sgd_target(digits, epsilon=2.0)
    losses = target.canary_losses(True, 40, seed=3)
    assert losses.shape == (40,)
    assert np.isfinite(losses).all()
    assert len(np.unique(losses)) == 40  # fresh noise and batches in every run
    claim = target.claim
    assert claim.epsilon <= 2.0
    assert claim.steps == 12
    assert math.isclose(claim.sample_rate, 16 / 30)
    assert target.last_ledger is not None
    assert target.last_ledger.to_dict()["entries"] == claim.ledger


def test_augmentation_multiplicity_runs_in_the_stacked_trainer(digits):
    target = _sgd_target(digits, ["learner.augmult=3", "learner.crop_padding=1"], epsilon=4.0)
    losses = target.canary_losses(False, 8, seed=0)
    assert losses.shape == (8,)
    assert np.isfinite(losses).all()


def test_sgd_target_rejects_a_batch_larger_than_the_audit_set(digits):
    with pytest.raises(DPVisionError, match="batch_size"):
        _sgd_target(digits, ["learner.batch_size=64"], epsilon=1.0)


def test_learner_target_uses_the_learner_users_fit(digits):
    data = make_audit_data(digits, size=50, canary="mislabeled")
    config = resolve(None, {"method": "dp-ls", "epsilon": 2.0, "delta": 0.02}, [])
    target = make_target(config, data)
    assert isinstance(target, LearnerTarget)
    direct = DPLeastSquares(target_epsilon=2.0, target_delta=0.02, num_classes=10)
    direct.fit(target.features, data.labels)
    assert target.claim.noise_multiplier == pytest.approx(direct.noise_multiplier_)
    assert target.claim.epsilon <= 2.0
    out = target.canary_losses(False, 20, seed=0)
    inside = target.canary_losses(True, 20, seed=0)
    assert out.shape == inside.shape == (20,)
    assert len(np.unique(out)) == 20
    assert inside.mean() < out.mean()  # the model fitted with z knows its (wrong) label


def test_canaries(digits):
    blank = make_audit_data(digits, size=10, canary="blank", label=3)
    assert blank.canary_image.max() == 0
    assert blank.canary_label == 3
    noise = make_audit_data(digits, size=10, canary="noise", seed=1)
    assert noise.canary_image.std() > 50
    wrong = make_audit_data(digits, size=10, canary="mislabeled")
    assert wrong.canary_label == (digits.test_labels[0] + 1) % 10
    images, labels = wrong.training_set(with_canary=True)
    assert len(images) == len(labels) == 11
    assert labels[-1] == wrong.canary_label
    with pytest.raises(DPVisionError, match="canary"):
        make_audit_data(digits, size=10, canary="rainbow")
    with pytest.raises(DPVisionError, match="exceeds"):
        make_audit_data(digits, size=10**6, canary="blank")


def test_learner_target_runs_d_prime_with_the_claimed_rate(digits, monkeypatch):
    # Before: D′ (with the canary, n + 1 examples) ran DP-SGD-linear at q = B/(n + 1) and
    # T = ceil(E(n + 1)/B), while the claim was computed at B/n and T = ceil(En/B).
    import dpvision.runs.features

    data = make_audit_data(digits, size=50, canary="mislabeled")
    sets = ["learner.batch_size=20", "learner.epochs=2"]
    config = resolve(None, {"method": "dp-sgd-linear", "epsilon": 2.0, "delta": 0.02}, sets)
    target = make_target(config, data)
    (claimed,) = target.claim.ledger
    assert (claimed["sample_rate"], claimed["count"]) == (20 / 50, 5)
    fits = []
    fit = dpvision.runs.features.fit_learner

    def spy(*args, **kwargs):
        result = fit(*args, **kwargs)
        fits.append(result[0].privacy_ledger_.to_dict()["entries"])
        return result

    monkeypatch.setattr(dpvision.runs.features, "fit_learner", spy)
    target.canary_losses(True, 2, seed=0)
    target.canary_losses(False, 2, seed=0)
    assert fits == [target.claim.ledger] * 4
