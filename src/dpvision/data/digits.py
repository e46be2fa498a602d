"""The scikit-learn ``digits`` dataset: 1,797 grayscale 8x8 handwritten digits, no download.

scikit-learn ships the data (UCI optical digits, test part) inside its package. Pixels are
counts 0..16 and are scaled to 0..255 as ``round(v * 255 / 16)``. There is no official split, so
a deterministic stratified one is made here: for each class independently, the examples are
shuffled with ``numpy.random.default_rng(DIGITS_SPLIT_SEED)`` (one generator used for the
classes in increasing order) and ``round(0.2 * n_class)`` of them go to the test set. The result
is 1,438 training and 359 test images; both splits keep the original order of the examples.

The images are treated as private data; this module releases nothing.
"""

from __future__ import annotations

# local imports: start-up time (heavy modules are imported in the functions using them)
import numpy as np

from dpvision.errors import DPVisionError

__all__ = ["DIGITS_SPLIT_SEED", "DIGITS_TEST_FRACTION", "load_digits_arrays", "stratified_split"]

DIGITS_SPLIT_SEED = 0
"""Seed of the stratified train/test split of ``digits``."""
DIGITS_TEST_FRACTION = 0.2
"""Fraction of each class that goes to the ``digits`` test set."""


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Splits indices so that each class contributes ``round(test_fraction * n)`` to test.

    Args:
        labels: Integer labels ``(N,)``.
        test_fraction: Fraction of each class to put in the test split, in ``[0, 1]``.
        seed: Seed of the NumPy generator that shuffles each class.

    Returns:
        ``(train_indices, test_indices)``, each sorted in increasing order.
    """
    rng = np.random.default_rng(seed)
    test_parts = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        n_test = round(test_fraction * len(members))
        test_parts.append(rng.permutation(members)[:n_test])
    test = np.sort(np.concatenate(test_parts)) if test_parts else np.zeros(0, dtype=np.int64)
    train = np.setdiff1d(np.arange(len(labels)), test)
    return train, test


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Loads and splits scikit-learn's ``digits``.

    Returns:
        ``(train_images, train_labels, test_images, test_labels)`` with images ``uint8``
        ``(N, 8, 8, 1)`` and labels ``int64`` ``(N,)``.

    Raises:
        DPVisionError: If scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DPVisionError(
            "the digits dataset needs scikit-learn; install it with: pip install scikit-learn"
        ) from exc
    bunch = load_digits()
    images = np.rint(np.asarray(bunch.images, dtype=np.float64) * (255.0 / 16.0))
    images = np.clip(images, 0, 255).astype(np.uint8)[..., np.newaxis]
    labels = np.asarray(bunch.target, dtype=np.int64)
    train, test = stratified_split(labels, DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED)
    return images[train], labels[train], images[test], labels[test]
