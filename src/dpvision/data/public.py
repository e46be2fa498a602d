"""A public slice of a training set: rows declared public, disjoint from the private rows.

``public_fraction = f`` declares a fixed ``round(f·N)`` rows of a dataset's training set
public (for non-private pre-training, ``dpvision pretrain --objective supervised``) and
leaves the others private (``dpvision train``). Which rows depends only on N and f — one
fixed permutation, the same in every run and for every seed — so a pre-training run and a
private run agree on the split without sharing anything.

Privacy: the split looks at no data. The public rows are *not protected*: they are used
without noise, and the private run's (ε, δ) covers the private rows only (its ``n_train``).
Declare rows public only where that is true of them (in this repository, a benchmark device
that stands in for a separate public dataset).
"""

import numpy as np

from dpvision.data.validation import validation_split
from dpvision.errors import DPVisionError

__all__ = ["public_split", "training_rows"]

_STREAM = 0x707562  # fixed, independent of the run's seed


def public_split(n: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(private rows, public rows), both sorted, ``round(fraction·n)`` public.

    >>> private, public = public_split(10, 0.3)
    >>> len(private), len(public), sorted({*private, *public}) == list(range(10))
    (7, 3, True)
    """
    if not 0 < fraction < 1:
        raise DPVisionError(f"public_fraction must be in (0, 1), got {fraction}")
    count = round(fraction * n)
    if count < 1 or count >= n:
        raise DPVisionError(
            f"public_fraction = {fraction:g} of {n} training examples declares {count} public; "
            "it must leave at least one example on each side"
        )
    order = np.random.default_rng([_STREAM]).permutation(n)
    return np.sort(order[count:]), np.sort(order[:count])


def training_rows(
    n: int, *, public_fraction: float, validation_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(rows trained on, validation rows) of a private run: the public slice is left out,
    then the validation split is held out of the private rows.

    >>> rows, held = training_rows(100, public_fraction=0.1, validation_fraction=0.2, seed=0)
    >>> len(rows), len(held), set(rows) & set(public_split(100, 0.1)[1])
    (72, 18, set())
    """
    rows = np.arange(n) if not public_fraction else public_split(n, public_fraction)[0]
    if not validation_fraction:
        return rows, np.arange(0)
    kept, held = validation_split(len(rows), validation_fraction, seed)
    return rows[kept], rows[held]
