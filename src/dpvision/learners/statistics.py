"""Clipped sufficient statistics of a feature matrix, accumulated in chunks.

The feature matrix may be a NumPy array or a memory-mapped one larger than RAM (e.g. a
cached ``.npy`` opened with ``mmap_mode="r"``): rows are read ``chunk_size`` at a time and
only d×d (and m×d×d) accumulators stay in memory.

Every read goes through :func:`read_rows` (:func:`dpvision.data.rows.gather`), which lets
a read-only memory map's pages go right after the copy, so one pass over a map larger than
RAM does not leave the whole file resident.

These functions compute *exact* statistics of private data; they release nothing. The
learners add noise calibrated to the sensitivities stated here before anything leaves.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from dpvision.data.rows import gather
from dpvision.errors import DPVisionError
from dpvision.mechanisms.clipping import clip_rows

DEFAULT_CHUNK_SIZE = 16384


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on torch's default device: the learner's ``device`` while it fits (its
    ``fit`` runs inside ``with torch.device(...)``), else the CPU (then ``tensor`` itself)."""
    return tensor.to(torch.get_default_device())


def read_rows(features: np.ndarray, rows: slice | np.ndarray) -> torch.Tensor:
    """``features[rows]`` copied into a new float64 tensor (on the default device, see
    :func:`on_device`); a read-only memory map's pages are let go
    (:func:`dpvision.data.rows.gather`).

    Privacy:
      Releases nothing: it returns the private rows exactly, for the caller to clip and
      aggregate before any noisy release.
    """
    return on_device(torch.from_numpy(gather(features, rows, np.float64)))


def iter_chunks(
    features: np.ndarray, labels: np.ndarray | None = None, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Yields (float64 features, int64 labels) tensors of at most ``chunk_size`` rows.

    Features are read with :func:`read_rows`, so a read-only memory map's pages are let go
    after each chunk. Releases nothing (the rows are returned exactly).
    """
    for start in range(0, len(features), chunk_size):
        x = read_rows(features, slice(start, start + chunk_size))
        y = (
            None
            if labels is None
            else on_device(
                torch.from_numpy(np.asarray(labels[start : start + chunk_size], dtype=np.int64))
            )
        )
        yield x, y


def check_features(features: np.ndarray, labels: np.ndarray, num_classes: int) -> None:
    """One-line errors for inputs no learner can use."""
    if getattr(features, "ndim", None) != 2:
        raise DPVisionError(
            f"features must be a 2-D array (examples × features), got shape "
            f"{getattr(features, 'shape', None)}"
        )
    if len(features) != len(labels):
        raise DPVisionError(f"{len(features)} feature rows but {len(labels)} labels")
    if len(features) == 0:
        raise DPVisionError("no training examples")
    labels = np.asarray(labels)
    if labels.min() < 0 or labels.max() >= num_classes:
        raise DPVisionError(
            f"labels must be integers in [0, {num_classes}), got {labels.min()}..{labels.max()}"
        )


@dataclass
class GramStatistics:
    """Exact (not yet private) sums over clipped features x̃ᵢ = clip(xᵢ, C).

    Attributes:
      gram: G = Σᵢ x̃ᵢx̃ᵢᵀ, (d, d). Changes by x̃x̃ᵀ, Frobenius norm ≤ C², per example.
      class_sums: bⱼ = Σ_{i: yᵢ=j} x̃ᵢ, (m, d). With one label per example the stack changes
        by ≤ C in L2 norm.
      count: n, the number of examples (treated as public, as in all four papers).
    """

    gram: torch.Tensor
    class_sums: torch.Tensor
    count: int


def gram_statistics(
    features: np.ndarray,
    labels: np.ndarray,
    *,
    num_classes: int,
    clip_norm: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> GramStatistics:
    """Accumulates G and bⱼ over clipped features, in float64, chunk by chunk."""
    d = features.shape[1]
    gram = torch.zeros(d, d, dtype=torch.float64)
    sums = torch.zeros(num_classes, d, dtype=torch.float64)
    for x, y in iter_chunks(features, labels, chunk_size=chunk_size):
        assert y is not None
        x = clip_rows(x, clip_norm, inplace=True)  # x is a fresh copy of the rows
        gram.addmm_(x.T, x)
        sums.index_add_(0, y, x)
    return GramStatistics(gram=gram, class_sums=sums, count=len(features))


class ClassIndex:
    """Row numbers of each class, so one class's rows can be read together.

    Sorting once by label turns the m per-class Gram matrices into m dense matrix products
    (instead of m tiny products per chunk), and lets them be computed a block of classes at
    a time, so only that block's d×d matrices are ever in memory.
    """

    def __init__(self, labels: np.ndarray, num_classes: int) -> None:
        labels = np.asarray(labels)
        self.order = np.argsort(labels, kind="stable")
        self.bounds = np.searchsorted(labels[self.order], np.arange(num_classes + 1))

    def rows(self, label: int) -> np.ndarray:
        return self.order[self.bounds[label] : self.bounds[label + 1]]


def class_grams(
    features: np.ndarray,
    index: ClassIndex,
    classes: range,
    *,
    clip_norm: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aⱼ = Σ_{i: yᵢ=j} x̃ᵢx̃ᵢᵀ for j in ``classes``, exact, (len(classes), d, d) float64.

    With one label per example, adding or removing an example changes the stack of all Aⱼ
    by x̃x̃ᵀ in a single class: Frobenius norm ≤ C².

    ``out``: a float64 tensor of at least ``len(classes)`` d×d matrices to fill (its first
    ``len(classes)`` are overwritten and returned), so a caller going through the classes a
    block at a time can reuse one buffer.
    """
    d = features.shape[1]
    if out is None:
        out = torch.zeros(len(classes), d, d, dtype=torch.float64)
    else:
        out = out[: len(classes)]
        out.zero_()
    for k, label in enumerate(classes):
        rows = index.rows(label)
        for start in range(0, len(rows), chunk_size):
            part = np.sort(rows[start : start + chunk_size])  # sorted reads from a memory map
            x = clip_rows(read_rows(features, part), clip_norm, inplace=True)
            out[k].addmm_(x.T, x)
    return out
