"""A scikit-learn search or cross-validation over a dpvision estimator on private data: each
fit's ε covers that fit alone, so the estimators warn and point to ``dpvision tune``."""

import warnings

import numpy as np
import pytest
from sklearn.model_selection import GridSearchCV, cross_val_score

from dpvision.errors import PrivacyWarning
from dpvision.learners import DPLeastSquares


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(120, 5)), np.arange(120) % 3


def _model() -> DPLeastSquares:
    return DPLeastSquares(target_epsilon=1.0, target_delta=1e-5, clip_norm=1.0, num_classes=3)


def test_grid_search_and_cross_validation_warn_and_name_tune():
    x, y = _data()
    with pytest.warns(PrivacyWarning, match=r"dpvision tune") as caught:
        GridSearchCV(_model(), {"clip_norm": [0.5, 1.0]}, cv=2).fit(x, y)
    assert "each fit's epsilon_ covers that fit alone" in str(caught[0].message)
    with pytest.warns(PrivacyWarning, match="model selection"):
        cross_val_score(_model(), x, y, cv=2)


def test_a_plain_fit_does_not_warn():
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyWarning)
        _model().fit(x, y)
