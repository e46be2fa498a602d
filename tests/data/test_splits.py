"""The public slice and the validation split (:mod:`dpvision.data.splits`): each example's
side is its own keyed hash, so a neighbouring dataset (one example added anywhere, or
removed) moves no other example; the share held out is Binomial(n, f); the validation split
is a function of its key. The split it replaced — a seeded permutation of ``range(n)`` —
reshuffles when n changes, which is the bug of issue 35."""

from collections.abc import Callable

import numpy as np
import pytest
from scipy import stats

from dpvision.data.splits import (
    public_split,
    split_coins,
    training_rows,
    validation_split,
)
from dpvision.errors import DPVisionError

N, FRACTION = 1000, 0.1
KEY, OTHER_KEY = b"k" * 32, b"j" * 32

Split = Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]


def _examples(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 8, 8, 1), dtype=np.uint8), rng.integers(0, 10, n)


def _public(images: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    return dict(zip(("private", "public"), public_split(images, labels, FRACTION), strict=True))


def _validation(images: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    train, held = validation_split(images, labels, FRACTION, KEY)
    return {"train": train, "validation": held}


def _run_rows(images: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    rows = training_rows(images, labels, public_fraction=FRACTION, validation_fraction=0.2, key=KEY)
    return {"train": rows.train, "validation": rows.validation, "public": rows.public}


def _neighbours(n: int) -> dict[str, np.ndarray]:
    """Each neighbour as the identities of its rows in order: 0..n-1 are the dataset's
    examples, n the one added."""
    ids = np.arange(n)
    return {
        "appended": np.append(ids, n),
        "inserted first": np.insert(ids, 0, n),
        "inserted in the middle": np.insert(ids, n // 2, n),
        "first removed": np.delete(ids, 0),
        "middle removed": np.delete(ids, n // 2),
        "last removed": np.delete(ids, n - 1),
    }


def _sides(split: Split, images: np.ndarray, labels: np.ndarray, ids: np.ndarray) -> dict:
    """Each side of the split as a set of example identities."""
    return {side: set(ids[rows]) for side, rows in split(images, labels).items()}


@pytest.mark.parametrize("split", [_public, _validation, _run_rows])
@pytest.mark.parametrize("neighbour", list(_neighbours(N)))
def test_a_neighbouring_dataset_moves_no_other_example(split: Split, neighbour: str) -> None:
    images, labels = _examples(N)
    extra_image, extra_label = _examples(1, seed=1)
    everyone = (np.concatenate([images, extra_image]), np.concatenate([labels, extra_label]))
    ids = _neighbours(N)[neighbour]
    before = _sides(split, images, labels, np.arange(N))
    after = _sides(split, everyone[0][ids], everyone[1][ids], ids)
    shared = set(range(N)) & set(ids)
    assert len(shared) >= N - 1
    for side in before:
        assert before[side] & shared == after[side] - {N}, side
    assert min(len(v) for v in before.values() if len(v) < N // 2) > 50  # not vacuous


def test_an_example_keeps_its_side_whatever_its_position() -> None:
    images, labels = _examples(N)
    order = np.random.default_rng(2).permutation(N)
    for split in (_public, _validation):
        before = _sides(split, images, labels, np.arange(N))
        assert before == _sides(split, images[order], labels[order], order)


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.5])
def test_the_share_held_out_is_binomial(fraction: float) -> None:
    n = 20_000
    images, labels = _examples(n, seed=3)
    band = 4 * np.sqrt(n * fraction * (1 - fraction))
    public = len(public_split(images, labels, fraction)[1])
    held = len(validation_split(images, labels, fraction, KEY)[1])
    for count in (public, held):
        assert abs(count - fraction * n) < band, (count, fraction * n, band)


def test_the_coins_are_uniform() -> None:
    images, labels = _examples(20_000, seed=4)
    coins = split_coins(images, labels, KEY)
    assert stats.kstest(coins, "uniform").pvalue > 1e-3
    assert stats.kstest(coins**1.1, "uniform").pvalue < 1e-3  # the test can see a skew


def test_the_validation_split_is_a_function_of_its_key() -> None:
    images, labels = _examples(N)
    held = validation_split(images, labels, FRACTION, KEY)[1]
    assert np.array_equal(held, validation_split(images, labels, FRACTION, KEY)[1])
    other = validation_split(images, labels, FRACTION, OTHER_KEY)[1]
    assert len(set(held) & set(other)) < len(held) // 2  # about f² n in common, not all
    public = public_split(images, labels, FRACTION)[1]
    assert len(set(held) & set(public)) < len(held) // 2  # the public key is another key


def test_the_label_is_part_of_the_example() -> None:
    images, labels = _examples(N)
    coins = split_coins(images, labels, KEY)
    assert not np.any(coins == split_coins(images, labels + 1, KEY))


def test_a_split_that_leaves_a_side_empty_is_refused() -> None:
    images, labels = _examples(3)
    with pytest.raises(DPVisionError, match="at least one example on each side"):
        validation_split(images, labels, 0.001, KEY)
    with pytest.raises(DPVisionError, match=r"public_fraction must be in \(0, 1\)"):
        public_split(images, labels, 1.0)


def _old_split(n: int, fraction: float, seed: int = 0) -> set[int]:
    """The validation split before issue 35: a seeded permutation of range(n)."""
    order = np.random.default_rng([seed, 0x76616C]).permutation(n)
    return set(order[: round(fraction * n)].tolist())


def test_the_old_permutation_split_reshuffled_when_one_example_was_added() -> None:
    """What the keyed split fixes: one more row, and the old split moved most of its rows
    (the public slice was the same construction: 4 026 of 6 000 rows at 60 000 -> 60 100)."""
    before, after = _old_split(N, FRACTION), _old_split(N + 1, FRACTION) - {N}
    assert len(before ^ after) > 100
