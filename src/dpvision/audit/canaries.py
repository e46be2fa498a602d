"""Audit datasets: a small D taken from a real dataset, and the canary z of D' = D ∪ {z}.

De et al. (App. A.2, Table 8) tried three kinds of canary; a blank image was consistently
the most distinguishable for them:

* ``blank``: an all-zero image (black), labelled ``label`` (default 0);
* ``noise``: an image of uniform random pixels (fixed by the audit's seed), labelled ``label``;
* ``mislabeled``: the first test image, with its label moved to the next class.

The audit data are the *first* ``size`` training examples of the dataset (deterministic), so
every audit run trains on exactly the same D. Nothing here is private: the audit plays the
adversary, who knows D and z.
"""

from dataclasses import dataclass

import numpy as np

from dpvision.data.core import ImageDataset
from dpvision.errors import DPVisionError
from dpvision.seeds import public_rng

CANARIES = ("blank", "noise", "mislabeled")


@dataclass(frozen=True)
class AuditData:
    """The audit's D (``images``, ``labels``) and its canary (``canary_image``, ``canary_label``).

    Attributes:
      name: the dataset the images come from.
      images: uint8 (n, H, W, C), the first n training images.
      labels: int64 (n,).
      canary: which kind of canary (one of :data:`CANARIES`).
      canary_image: uint8 (H, W, C).
      canary_label: the canary's label.
      num_classes: the dataset's number of classes.
    """

    name: str
    images: np.ndarray
    labels: np.ndarray
    canary: str
    canary_image: np.ndarray
    canary_label: int
    num_classes: int

    @property
    def size(self) -> int:
        """|D|."""
        return len(self.labels)

    def training_set(self, with_canary: bool) -> tuple[np.ndarray, np.ndarray]:
        """D (``with_canary=False``) or D' = D ∪ {z}, z appended last."""
        if not with_canary:
            return self.images, self.labels
        images = np.concatenate([self.images, self.canary_image[None]])
        labels = np.append(self.labels, self.canary_label).astype(np.int64)
        return images, labels


def make_audit_data(
    dataset: ImageDataset, *, size: int, canary: str, label: int = 0, seed: int = 0
) -> AuditData:
    """D = the first ``size`` training examples of ``dataset``, and the canary ``canary``.

    Args:
      dataset: where the images come from.
      size: |D| (De et al. used 100 and 60,000).
      canary: ``blank``, ``noise`` or ``mislabeled``.
      label: the label of a ``blank`` or ``noise`` canary.
      seed: the seed of the ``noise`` canary's pixels.
    """
    if canary not in CANARIES:
        raise DPVisionError(f"unknown canary {canary!r}; choose one of {', '.join(CANARIES)}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
        raise DPVisionError(f"the audit dataset size must be a whole number >= 2, got {size!r}")
    if size > dataset.num_train:
        raise DPVisionError(
            f"the audit dataset size {size} exceeds the {dataset.num_train} training examples "
            f"of {dataset.name}"
        )
    if not 0 <= label < dataset.num_classes:
        raise DPVisionError(f"canary label {label} is not a class of {dataset.name}")
    shape = dataset.train_images.shape[1:]
    if canary == "blank":
        image, target = np.zeros(shape, dtype=np.uint8), label
    elif canary == "noise":
        rng = public_rng(seed, "audit noise canary")
        image, target = rng.integers(0, 256, shape, dtype=np.uint8), label
    else:
        if dataset.num_test < 1:
            raise DPVisionError(f"{dataset.name} has no test image to mislabel")
        image = np.array(dataset.test_images[0], dtype=np.uint8)
        target = (int(dataset.test_labels[0]) + 1) % dataset.num_classes
    return AuditData(
        name=dataset.name,
        images=np.asarray(dataset.train_images[:size]),
        labels=np.asarray(dataset.train_labels[:size], dtype=np.int64),
        canary=canary,
        canary_image=image,
        canary_label=int(target),
        num_classes=dataset.num_classes,
    )
