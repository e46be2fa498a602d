"""A private feature learner used as a scikit-learn estimator: DP-LS in a Pipeline.

``DPLeastSquares`` (Mehta et al., Algorithm 3) has ``fit``/``predict``/``score`` and
``get_params``/``set_params``, so ``sklearn.base.clone`` and ``Pipeline`` take it as they
take ``RidgeClassifier``. Here it learns scikit-learn's 8×8 digits from pixels at
(ε, δ) = (3, 1e-5); ε is read back from the privacy ledger of the fit (test accuracy about
0.9; the noise is fresh every run):

    python examples/sklearn_estimator.py

Only steps that look at one example at a time may go before the learner: ``Normalizer``
scales each row to norm 1 on its own. A ``StandardScaler`` fitted on the private data, or
a cross-validated search over it, would release statistics that no ledger records (use
``dpvision tune`` for private hyper-parameter selection).
"""

from sklearn.base import clone
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import Normalizer

from dpvision.learners import DPLeastSquares

EPSILON, DELTA = 3.0, 1e-5


def main() -> None:
    X, y = load_digits(return_X_y=True)
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, test_size=0.2, random_state=0, stratify=y
    )
    learner = DPLeastSquares(
        target_epsilon=EPSILON, target_delta=DELTA, clip_norm=1.0, num_classes=10
    )
    pipeline = make_pipeline(Normalizer(), learner)
    fitted = clone(pipeline).fit(X_train, y_train)  # clone: get_params round-trips
    model = fitted[-1]
    print(f"test accuracy {fitted.score(X_test, y_test):.4f}")
    print(f"ε = {model.epsilon_:.4f} at δ = {DELTA:g}")
    for entry in model.privacy_ledger_.entries:
        print(f"  released {entry.released}: σ = {entry.noise_multiplier:.3f}, {entry.count}×")


if __name__ == "__main__":
    main()
