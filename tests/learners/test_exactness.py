"""With the noise off, each learner computes the textbook solution it privatises."""

import math

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression, Ridge

from dpvision.learners import DPFeatureCovariance, DPLeastSquares, DPNewton, DPSGDLinear


def test_dp_ls_without_noise_equals_the_closed_form_ridge_solution(blobs):
    x, y, _, _ = blobs
    alpha, ridge = 0.5, 3.0
    model = DPLeastSquares(
        target_epsilon=math.inf,
        clip_norm=1e6,
        alpha=alpha,
        ridge=ridge,
        chunk_size=64,
        num_classes=3,
    ).fit(x, y)
    # Class j minimises Σᵢ (yᵢⱼ + α)(tᵢ − xᵢᵀθ)² + λ‖θ‖², tᵢ = yᵢⱼ/(yᵢⱼ + α): a weighted ridge.
    for j in range(3):
        target = (y == j).astype(float)
        reference = Ridge(alpha=ridge * 1e12, fit_intercept=False, solver="cholesky")
        reference.fit(x, target / (target + alpha), sample_weight=target + alpha)
        np.testing.assert_allclose(model.coef_[j], reference.coef_, rtol=1e-7, atol=1e-10)
    assert math.isinf(model.epsilon_)


def test_dp_ls_ridge_is_in_units_of_clip_norm_squared(blobs):
    x, y, _, _ = blobs
    a = DPLeastSquares(target_epsilon=math.inf, clip_norm=100.0, ridge=1e-4, num_classes=3).fit(
        x, y
    )
    reference = Ridge(alpha=1.0, fit_intercept=False, solver="cholesky")
    target = (y == 0).astype(float)
    reference.fit(x, target / (target + 1.0), sample_weight=target + 1.0)
    np.testing.assert_allclose(a.coef_[0], reference.coef_, rtol=1e-7)


def test_dp_newton_without_noise_converges_to_regularised_logistic_regression(blobs):
    x, y, _, _ = blobs
    ridge = 0.05
    model = DPNewton(
        target_epsilon=math.inf,
        clip_norm=1e6,
        iterations=12,
        ridge=ridge / 1e12,
        chunk_size=100,
        num_classes=3,
    ).fit(x, y)
    n = len(x)
    for j in range(3):
        # mean one-vs-all logistic loss + (λ/2)‖w‖²  ⇔  sklearn with C = 1/(nλ)
        reference = LogisticRegression(
            C=1 / (n * ridge), fit_intercept=False, tol=1e-12, max_iter=10000
        ).fit(x, (y == j).astype(int))
        np.testing.assert_allclose(model.coef_[j], reference.coef_[0], rtol=1e-5, atol=1e-7)


def test_dp_sgd_linear_without_noise_learns(blobs):
    x, y, xt, yt = blobs
    model = DPSGDLinear(
        target_epsilon=math.inf,
        clip_norm=1e6,
        epochs=50,
        learning_rate=0.5,
        optimizer="sgd",
        num_classes=3,
    ).fit(x, y)
    assert model.score(xt, yt) > 0.95


def test_dp_fc_step_is_the_preconditioned_gradient_step(blobs):
    x, y, _, _ = blobs
    n, d, m, lr, ridge = len(x), x.shape[1], 3, 0.7, 0.01
    # ridge is in units of C_G²: 1e-14 · (1e6)² = 0.01, with no clipping at C = 1e6.
    model = DPFeatureCovariance(
        target_epsilon=math.inf,
        num_classes=3,
        covariance_clip_norm=1e6,
        clip_norm=1e6,
        epochs=1,
        learning_rate=lr,
        ridge=ridge / 1e12,
    ).fit(x, y)
    errors = 1 / (1 + np.exp(10.0)) - np.eye(m)[y]  # sigmoid(−10) − y, loss summed over classes
    grad = errors.T @ x / n
    covariance = x.T @ x / n + ridge * np.eye(d)
    np.testing.assert_allclose(model.coef_, -lr * np.linalg.solve(covariance, grad.T).T, rtol=1e-9)


def test_dp_fc_without_noise_learns(blobs):
    x, y, xt, yt = blobs
    model = DPFeatureCovariance(
        target_epsilon=math.inf,
        num_classes=3,
        covariance_clip_norm=10.0,
        clip_norm=10.0,
        epochs=50,
        learning_rate=20.0,
        ridge=1e-3,
    ).fit(x, y)
    assert model.score(xt, yt) > 0.95


@pytest.mark.parametrize("learner", [DPLeastSquares, DPNewton, DPFeatureCovariance, DPSGDLinear])
def test_streaming_from_a_memory_map_gives_the_same_model(learner, blobs, tmp_path):
    x, y, _, _ = blobs
    path = tmp_path / "features.npy"
    np.save(path, x)
    mapped = np.load(path, mmap_mode="r")
    kwargs = {"noise_multiplier": 2.0, "random_state": 3, "chunk_size": 37, "num_classes": 3}
    in_memory = learner(**kwargs).fit(x, y)
    streamed = learner(**kwargs).fit(mapped, y)
    np.testing.assert_allclose(in_memory.coef_, streamed.coef_, rtol=1e-9, atol=1e-12)
