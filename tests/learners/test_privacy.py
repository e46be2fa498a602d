"""Privacy of the feature learners: sensitivities, ledgers against their theorems, targets."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from dpvision.accounting import PrivacyLedger, gaussian_epsilon, zcdp_epsilon
from dpvision.errors import DPVisionError
from dpvision.features.normalization import PrivateCentering, PrivateNormalizer
from dpvision.learners import DPFeatureCovariance, DPLeastSquares, DPNewton, DPSGDLinear
from dpvision.mechanisms import observing_releases

MODULES = {
    DPLeastSquares: "dpvision.learners.dp_ls",
    DPNewton: "dpvision.learners.dp_newton",
    DPFeatureCovariance: "dpvision.learners.dp_fc",
    DPSGDLinear: "dpvision.learners.dp_sgd_linear",
}


def _spy_releases(monkeypatch, module):
    """Replaces the module's release_gaussian by a noise-free recorder."""
    calls = []

    def spy(value, *, l2_sensitivity, ledger, released, **kwargs):
        calls.append((released, value.clone(), l2_sensitivity))
        ledger.record(
            noise_multiplier=kwargs["noise_multiplier"],
            released=released,
            sample_rate=kwargs.get("sample_rate", 1.0),
        )
        return value

    monkeypatch.setattr(f"{module}.release_gaussian", spy)
    return calls


def _observed_releases(fit):
    """Every release ``fit()`` makes, as (name, exact value, stated sensitivity), seen by the
    release observer every release path calls before its noise."""
    calls = []

    def observer(release):
        calls.append((release.released, release.value, release.l2_sensitivity))
        return release.value

    with observing_releases(observer):
        fit()
    return calls


# Releases made before any parameter depends on the data (so D and D' share the weights).
FIRST_RELEASES = {DPLeastSquares: 2, DPNewton: 2, DPFeatureCovariance: 2, DPSGDLinear: 1}


@pytest.mark.parametrize("learner", list(MODULES))
@pytest.mark.parametrize("position", ["first", "last"])
def test_one_enormous_example_moves_each_release_by_at_most_its_sensitivity(
    learner, position, blobs, monkeypatch
):
    x, y, _, _ = blobs
    huge = np.full((1, x.shape[1]), 1e6)
    if position == "first":
        x2, y2 = np.vstack([huge, x]), np.concatenate([[2], y])
    else:
        x2, y2 = np.vstack([x, huge]), np.concatenate([y, [2]])
    kwargs = {"noise_multiplier": 1.0, "clip_norm": 0.7, "random_state": 0, "num_classes": 3}
    if learner is DPFeatureCovariance:
        kwargs["covariance_clip_norm"] = 1.3
    calls_d = _observed_releases(lambda: learner(**kwargs).fit(x, y))
    calls_d2 = _observed_releases(lambda: learner(**kwargs).fit(x2, y2))
    count = FIRST_RELEASES[learner]
    assert len(calls_d) >= count
    for (name, a, sensitivity), (_, b, _) in zip(calls_d[:count], calls_d2[:count], strict=True):
        change = float(torch.linalg.vector_norm((a - b).reshape(-1)))
        assert change <= sensitivity * (1 + 1e-9), (name, change, sensitivity)
        # At w = 0 the Newton gradient moves by ‖p − y‖·C = √(m/4)·C, half its bound.
        assert change >= 0.4 * sensitivity, f"{name}: the huge example should show"


@pytest.mark.parametrize("position", [0, -1])
def test_class_gram_stack_moves_by_at_most_c_squared(position, blobs):
    from dpvision.learners.statistics import ClassIndex, class_grams

    x, y, _, _ = blobs
    huge = np.full((1, x.shape[1]), 1e6)
    x2 = np.insert(x, position if position == 0 else len(x), huge, axis=0)
    y2 = np.insert(y, position if position == 0 else len(y), 1)
    clip = 0.7

    def stack(features, labels):
        return class_grams(features, ClassIndex(labels, 3), range(3), clip_norm=clip, chunk_size=17)

    change = float(torch.linalg.vector_norm((stack(x, y) - stack(x2, y2)).reshape(-1)))
    assert 0.99 * clip**2 <= change <= clip**2 * (1 + 1e-9)


@pytest.mark.parametrize("estimator", ["normalizer", "centering"])
def test_private_preprocessing_sensitivity(estimator, monkeypatch, blobs):
    x, _, _, _ = blobs
    x2 = np.vstack([x, np.full((1, x.shape[1]), 1e6)])
    calls = _spy_releases(monkeypatch, "dpvision.features.normalization")

    def make():
        if estimator == "normalizer":
            return PrivateNormalizer(
                channels=3, noise_multiplier=8.0, mean_clip=0.5, square_clip=2.0
            )
        return PrivateCentering(clip_norm=0.5, noise_multiplier=8.0)

    make().fit(x, ledger=PrivacyLedger())
    first = list(calls)
    calls.clear()
    make().fit(x2, ledger=PrivacyLedger())
    for (name, a, sensitivity), (_, b, _) in zip(first, calls, strict=True):
        change = float(torch.linalg.vector_norm(a - b))
        assert 0.5 * sensitivity <= change <= sensitivity * (1 + 1e-9), name


@pytest.mark.parametrize(
    ("learner", "kwargs", "releases"),
    [
        (DPLeastSquares, {}, 3),
        (DPNewton, {"iterations": 3}, 6),
        (DPFeatureCovariance, {"epochs": 4}, 5),
        (DPSGDLinear, {"epochs": 3}, 3),
    ],
)
def test_full_batch_ledger_reproduces_the_theorem(learner, kwargs, releases, blobs):
    x, y, _, _ = blobs
    sigma = 5.0
    model = learner(noise_multiplier=sigma, random_state=0, num_classes=3, **kwargs).fit(x, y)
    ledger = model.privacy_ledger_
    assert ledger.total_count == releases
    assert all(e.noise_multiplier == sigma and e.sample_rate == 1.0 for e in ledger)
    mu = math.sqrt(releases) / sigma
    assert model.epsilon_ == pytest.approx(gaussian_epsilon(mu=mu, delta=1e-5), rel=1e-12)
    rho = releases / (2 * sigma**2)  # the paper's zCDP figure
    assert zcdp_epsilon(ledger.dp_event(), delta=1e-5) == pytest.approx(
        rho + 2 * math.sqrt(rho * math.log(1e5))
    )


def test_dp_sgd_linear_ledger_records_every_poisson_step(blobs):
    x, y, _, _ = blobs
    model = DPSGDLinear(
        noise_multiplier=1.5, batch_size=30, epochs=2, random_state=0, num_classes=3
    ).fit(x, y)
    (entry,) = model.privacy_ledger_.entries
    assert (entry.count, entry.sample_rate) == (20, 30 / 300)  # T = ceil(2 / 0.1)


@pytest.mark.parametrize(
    ("learner", "kwargs"),
    [
        (DPLeastSquares, {}),
        (DPNewton, {"iterations": 2}),
        (DPFeatureCovariance, {"epochs": 3}),
        (DPSGDLinear, {"batch_size": 50, "epochs": 2}),
    ],
)
@pytest.mark.parametrize("target", [0.3, 2.0])
def test_reported_epsilon_never_exceeds_the_target(learner, kwargs, target, blobs):
    x, y, _, _ = blobs
    model = learner(target_epsilon=target, random_state=0, num_classes=3, **kwargs).fit(x, y)
    assert 0.99 * target <= model.epsilon_ <= target


def test_prior_ledger_counts_against_the_target(blobs):
    x, y, _, _ = blobs
    prior = PrivacyLedger()
    PrivateCentering(clip_norm=1.0, noise_multiplier=8.0).fit(x, ledger=prior)
    alone = DPLeastSquares(target_epsilon=1.0, num_classes=3).fit(x, y)
    after = DPLeastSquares(target_epsilon=1.0, num_classes=3).fit(x, y, prior_ledger=prior)
    assert after.noise_multiplier_ > alone.noise_multiplier_
    assert 0.99 <= after.epsilon_ <= 1.0
    assert after.privacy_ledger_.entries[0].released == "feature mean for centering"


def test_exactly_one_of_target_and_noise():
    x, y = np.zeros((4, 2)), np.array([0, 1, 0, 1])
    with pytest.raises(DPVisionError, match="exactly one"):
        DPLeastSquares(num_classes=3).fit(x, y)
    with pytest.raises(DPVisionError, match="exactly one"):
        DPLeastSquares(target_epsilon=1.0, noise_multiplier=1.0, num_classes=3).fit(x, y)


def test_noise_scale_of_a_full_fit_matches_sigma(blobs, monkeypatch):
    # End to end: the noise DP-LS adds to b_j over many seeds has std σC (KS, both ways).
    import dpvision.learners.dp_ls as dp_ls

    x, y, _, _ = blobs
    original = dp_ls.release_gaussian
    draws = []

    def capture(value, **kwargs):
        out = original(value, **kwargs)
        if kwargs["released"] == "DP-LS b_j":
            draws.append((out - value).reshape(-1).numpy())
        return out

    monkeypatch.setattr(dp_ls, "release_gaussian", capture)
    for seed in range(60):
        DPLeastSquares(noise_multiplier=2.0, clip_norm=0.5, random_state=seed, num_classes=3).fit(
            x, y
        )
    noise = np.concatenate(draws)  # σC = 2.0 · 0.5 = 1.0
    assert stats.kstest(noise, stats.norm(scale=1.0).cdf).pvalue > 1e-3
    assert stats.kstest(noise, stats.norm(scale=0.67).cdf).pvalue < 1e-6
    assert stats.kstest(noise, stats.norm(scale=1.5).cdf).pvalue < 1e-6


def test_a_fit_that_records_other_releases_than_calibrated_is_refused(monkeypatch):
    """The ledger is filled by what ran and σ by what `_releases` claimed; they must agree."""
    x, y = np.random.default_rng(0).normal(size=(60, 4)), np.arange(60) % 3
    claimed = DPLeastSquares._releases

    def one_more(self, n, d, m):
        count, rate = claimed(self, n, d, m)
        return count + 1, rate

    monkeypatch.setattr(DPLeastSquares, "_releases", one_more)
    learner = DPLeastSquares(target_epsilon=1.0, num_classes=3, random_state=0)
    with pytest.raises(DPVisionError, match=r"was calibrated for .* but recorded"):
        learner.fit(x, y)
