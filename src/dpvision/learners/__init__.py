"""Feature learners: linear classifiers trained privately on extracted features.

Each is a scikit-learn estimator (``fit``, ``predict``, ``score``) that records what it
released in ``privacy_ledger_``:

* :class:`DPLeastSquares` — DP-LS (``dp-ls``), noisy sufficient statistics, one solve;
* :class:`DPNewton` — DP-Newton (``dp-newton``), noisy gradient and Hessian per step;
* :class:`DPFeatureCovariance` — DP-FC (``dp-fc``), covariance-preconditioned DP gradients;
* :class:`DPSGDLinear` — DP-SGD / momentum / DP-Adam on a linear head (``dp-sgd-linear``).

:func:`dpvision.learners.options.check_learner_options` checks a config's ``[learner]``
values (type and range) before any data is read.
"""

from dpvision.learners.base import DPLinearClassifier
from dpvision.learners.dp_fc import DPFeatureCovariance
from dpvision.learners.dp_ls import DPLeastSquares
from dpvision.learners.dp_newton import DPNewton
from dpvision.learners.dp_sgd_linear import DPSGDLinear

LEARNERS: dict[str, type[DPLinearClassifier]] = {
    "dp-ls": DPLeastSquares,
    "dp-newton": DPNewton,
    "dp-fc": DPFeatureCovariance,
    "dp-sgd-linear": DPSGDLinear,
}

__all__ = [
    "LEARNERS",
    "DPFeatureCovariance",
    "DPLeastSquares",
    "DPLinearClassifier",
    "DPNewton",
    "DPSGDLinear",
]
