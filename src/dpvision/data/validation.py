"""A validation split carved from the training data: seeded, fixed before training starts.

Hyper-parameters are tuned on it and ``eval_every`` evaluates on it, so the test set is
touched once, at the end.

Privacy: which rows are held out depends only on the number of training examples and the
seed, never on their contents. The held-out rows are not trained on, so the run's (ε, δ)
covers the remaining training examples; the validation accuracies are exact statistics of
the held-out examples, as the test accuracy is of the test set. Hold out only data you are
willing to treat like test data.
"""

import numpy as np

from dpvision.errors import DPVisionError

__all__ = ["validation_split"]

# Mixed into the run's seed, so the split is independent of every other use of the seed.
_STREAM = 0x76616C


def validation_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, validation rows), both sorted, ``round(fraction·n)`` held out.

    >>> train, validation = validation_split(10, 0.2, seed=0)
    >>> len(train), len(validation), sorted({*train, *validation}) == list(range(10))
    (8, 2, True)
    """
    if not 0 < fraction < 1:
        raise DPVisionError(f"validation_fraction must be in [0, 1), got {fraction}")
    held = round(fraction * n)
    if held < 1 or held >= n:
        raise DPVisionError(
            f"validation_fraction = {fraction:g} of {n} training examples holds out {held}; "
            "it must leave at least one example on each side"
        )
    order = np.random.default_rng([seed, _STREAM]).permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])
