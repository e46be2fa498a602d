"""Neighbour-stable splits of a training set: the public slice and the validation split.

Which side an example lands on depends only on *that example* and a key: its coin is a
keyed BLAKE2b hash of its bytes (the image's, or the feature row's, and its label) read as
a number in [0, 1), and it is held out when the coin is below the fraction. Adding or
removing one example, wherever in the dataset it is inserted, moves no other row; the
number held out is Binomial(n, fraction), about ``fraction · n``.

* The **public** slice (``public_fraction``) uses a fixed, published key
  (:data:`PUBLIC_SPLIT`): the public rows are declared public, so anyone may recompute them;
  ``dpvision pretrain --public-fraction`` and the private run agree on them without sharing
  anything, and a weight file records the split's definition and the digests of its rows.
* The **test** split of a single ``imagefolder:ROOT/<class>/`` tree (``test_fraction``,
  :func:`tree_split`) uses a key made of a fixed label and the config's public
  ``split_seed`` (never the run's ``seed``: a sweep over seeds keeps one test side), over
  each *file's* bytes and class name: the test images are evaluation data, released exactly
  (``n_test``, the test accuracy), as those of a ``ROOT/test`` folder, so the split may be
  public; the private run's (ε, δ) covers the training side only. An image added to the tree
  lands on one side and moves no other image; exact copies of a file land together. Runs
  that publish results on one tree must share its split: an image that is test data in one
  run and training data in another loses the training side's protection.
* The **validation** split (``validation_fraction``) uses a secret key, a stream of the
  run's :class:`~dpvision.mechanisms.secret.SecretRandomness`: its coins are part of what
  the guarantee rests on (an adversary who could compute them would know which side the
  target is on).

Privacy: the splits release nothing (their sizes are public by convention, as ``n``; a
split that leaves one side empty is refused, a function of those sizes alone). The
public rows are *not protected* (used without noise); the private run's (ε, δ) covers the
private rows. The held-out validation rows are not trained on; what is released about them
is noisy (:mod:`dpvision.runs.validation`) unless the user declares them public.

>>> images = np.arange(200, dtype=np.uint8).reshape(100, 2, 1, 1)
>>> labels = np.zeros(100, dtype=np.int64)
>>> private, public = public_split(images, labels, 0.3)
>>> sorted({*private, *public}) == list(range(100)), 15 < len(public) < 45
(True, True)
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpvision.errors import DPVisionError

__all__ = [
    "PUBLIC_KEY",
    "PUBLIC_SPLIT",
    "SPLIT_SEED",
    "TEST_FRACTION",
    "TEST_SPLIT",
    "changed_tree_option",
    "public_split",
    "row_digests",
    "split_coins",
    "training_rows",
    "tree_split",
    "validation_split",
]

PUBLIC_SPLIT = "blake2b-64 keyed 'dpvision public split v1' over label and row bytes"
"""The public slice's definition, as weight files record it."""
_PUBLIC_KEY = b"dpvision public split v1"
PUBLIC_KEY = _PUBLIC_KEY
"""The public slice's key: fixed and published (anyone may recompute the public rows)."""


def row_digests(rows: np.ndarray, labels: np.ndarray, key: bytes) -> np.ndarray:
    """One keyed 64-bit BLAKE2b digest per example (its label, then its bytes), uint64.

    The digest reads the example alone, never its position or any other row.
    """
    rows, labels = np.asarray(rows), np.asarray(labels, dtype=np.int64)
    if len(rows) != len(labels):
        raise DPVisionError(f"{len(rows)} rows but {len(labels)} labels")
    out = np.empty(len(rows), dtype=np.uint64)
    for i in range(len(rows)):
        digest = hashlib.blake2b(labels[i].tobytes(), key=key, digest_size=8)
        digest.update(np.ascontiguousarray(rows[i]).tobytes())
        out[i] = int.from_bytes(digest.digest(), "little")
    return out


def split_coins(rows: np.ndarray, labels: np.ndarray, key: bytes) -> np.ndarray:
    """Each example's coin in [0, 1): its keyed digest over 2⁶⁴ (float64)."""
    return row_digests(rows, labels, key).astype(np.float64) * 2.0**-64


def _held(coins: np.ndarray, fraction: float, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held) indices: the coins below ``fraction`` are held.

    Privacy: the refusal of an empty side is a function of the two sides' sizes only (the
    message names the fraction and the count, both public by convention), which a run
    publishes anyway (``n_train``, ``n_validation``): it releases nothing beyond them
    (docs/guarantees.md, "Still assumed").
    """
    if not 0 < fraction < 1:
        raise DPVisionError(f"{what} must be in (0, 1), got {fraction}")
    held = coins < fraction
    if held.all() or not held.any():
        raise DPVisionError(
            f"{what} = {fraction:g} of {len(coins)} training examples leaves "
            f"{'none' if not held.any() else 'all'} of them on one side: it must leave at least "
            "one example on each side"
        )
    return np.flatnonzero(~held), np.flatnonzero(held)


def public_split(
    rows: np.ndarray, labels: np.ndarray, fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """(private rows, public rows), sorted: the examples whose public coin is below
    ``fraction`` are public (the key is fixed and published, :data:`PUBLIC_SPLIT`)."""
    return _held(split_coins(rows, labels, _PUBLIC_KEY), fraction, "public_fraction")


def public_digests(rows: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The examples' digests under the public split's key (public, as the key is): what
    a weight file records of the public rows it was trained on."""
    return row_digests(rows, labels, _PUBLIC_KEY)


def validation_split(
    rows: np.ndarray, labels: np.ndarray, fraction: float, key: bytes
) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, validation rows), sorted: the examples whose coin under the secret
    ``key`` is below ``fraction`` are held out."""
    return _held(split_coins(rows, labels, key), fraction, "validation_fraction")


@dataclass(frozen=True)
class Rows:
    """The rows of a private run: trained on, held out for validation, declared public."""

    train: np.ndarray
    validation: np.ndarray
    public: np.ndarray


def training_rows(
    rows: np.ndarray,
    labels: np.ndarray,
    *,
    public_fraction: float,
    validation_fraction: float,
    key: bytes,
    also_public: np.ndarray | None = None,
) -> Rows:
    """The rows of a private run: the public slice left out, then the validation split
    (secret ``key``) held out of the private rows. ``also_public``: more rows to leave out
    as public (copies of the public examples a weight file was trained on).

    >>> images = np.arange(1000, dtype=np.uint8).reshape(500, 2, 1, 1) % 251
    >>> labels = np.arange(500) % 3
    >>> split = training_rows(images, labels, public_fraction=0.1, validation_fraction=0.2,
    ...                       key=b"k" * 32)
    >>> len(split.train) + len(split.validation) + len(split.public)
    500
    >>> set(split.train) & set(split.public), set(split.validation) & set(split.public)
    (set(), set())
    """
    n = len(labels)
    everything, none = np.arange(n), np.arange(0)
    private, public = (
        (everything, none) if not public_fraction else public_split(rows, labels, public_fraction)
    )
    if also_public is not None and len(also_public):
        private = np.setdiff1d(private, also_public)
        public = np.union1d(public, also_public)
    if not validation_fraction:
        return Rows(private, none, public)
    coins = split_coins(rows, labels, key)[private]  # each row's own coin, read in place
    kept, held = _held(coins, validation_fraction, "validation_fraction")
    return Rows(private[kept], private[held], public)


TEST_FRACTION = 0.2
"""The default share of a single image tree held out as its test split (80/20, as the
``digits`` split; scikit-learn's ``train_test_split`` holds out 0.25)."""
SPLIT_SEED = 0
"""The default ``split_seed``: the key of a single tree's test split, fixed and public, apart
from the run's ``seed`` (a sweep over seeds keeps one test side)."""


def changed_tree_option(test_fraction: float, split_seed: int) -> str | None:
    """The first of ``test_fraction`` and ``split_seed`` not at its default, or ``None``:
    the options that only a single image tree's split takes.

    >>> changed_tree_option(TEST_FRACTION, 3), changed_tree_option(TEST_FRACTION, SPLIT_SEED)
    ('split_seed', None)
    """
    if test_fraction != TEST_FRACTION:
        return "test_fraction"
    return "split_seed" if split_seed != SPLIT_SEED else None


TEST_SPLIT = "blake2b-64 keyed 'dpvision test split v1' and split_seed, over class name, file bytes"
"""The definition of a single tree's test split (before ``split_seed`` existed its key was
the run's ``seed``: ``split_seed = s`` gives the split those runs of ``seed = s`` had)."""


def tree_split(
    paths: Sequence[Path], class_names: Sequence[str], fraction: float, split_seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(training files, test files), indices sorted: the files whose coin is below
    ``fraction`` are test files. A file's coin is its 64-bit BLAKE2b digest, keyed by a fixed
    label and ``split_seed``, over its class name and its bytes, over 2⁶⁴: it reads that file
    alone.

    Privacy: the split depends on each file and the public ``split_seed`` only (adding or
    removing a file moves no other); the test side is released exactly, as a ``test/``
    folder's. The refusal of an empty side is a function of the two sides' sizes, which a
    run publishes anyway (``n_train``, ``n_test``).

    Raises:
      DPVisionError: ``fraction`` is not in (0, 1), a file cannot be read, or one side is
        empty.
    """
    if isinstance(fraction, bool) or not 0 < fraction < 1:
        raise DPVisionError(f"test_fraction must be in (0, 1), got {fraction}")
    if len(paths) != len(class_names):
        raise DPVisionError(f"{len(paths)} files but {len(class_names)} class names")
    key = b"dpvision test split v1:" + int(split_seed).to_bytes(8, "little")
    coins = np.empty(len(paths), dtype=np.float64)
    for i, (path, name) in enumerate(zip(paths, class_names, strict=True)):
        digest = hashlib.blake2b(name.encode() + b"\0", key=key, digest_size=8)
        try:
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
        except OSError as error:
            raise DPVisionError(f"{path}: cannot read the file ({error.strerror})") from None
        coins[i] = int.from_bytes(digest.digest(), "little") * 2.0**-64
    held = coins < fraction
    if held.all() or not held.any():
        raise DPVisionError(
            f"test_fraction = {fraction:g} leaves no image in the "
            f"{'training' if held.all() else 'test'} split of this tree: add images, or give "
            "train/ and test/ folders"
        )
    return np.flatnonzero(~held), np.flatnonzero(held)
