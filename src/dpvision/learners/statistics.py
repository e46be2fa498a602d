"""Clipped sufficient statistics of a feature matrix, accumulated in chunks.

The feature matrix may be a NumPy array or a memory-mapped one larger than RAM (e.g. a
cached ``.npy`` opened with ``mmap_mode="r"``): rows are read ``chunk_size`` at a time and
only d×d (and m×d×d) accumulators stay in memory.

Reading a memory map is not free in memory, though: every page of the file that a read
touches stays mapped into the process (file-backed resident memory, counted by RSS and
``ru_maxrss``) until it is unmapped, so one pass over a 4 GB map leaves the process 4 GB
resident even though each chunk was copied out and dropped. The kernel would reclaim those
pages under pressure, but RSS limits (cgroups, schedulers, ``ulimit``) count them.
:func:`read_rows`, which every reader here goes through, therefore copies the rows out and
then unmaps the pages it just read (``madvise(MADV_DONTNEED)``; they stay in the page cache,
so reading them again costs a page fault, not a disk read). That is only done for a
read-only map (``np.load(..., mmap_mode="r")`` or ``np.memmap(..., mode="r")``), where
nothing can be lost; copy-on-write and writeable maps and in-memory arrays are read as is.
Scattered rows (a class's rows, a sampled batch) are released every few 2 MiB blocks of the
file, because the kernel maps a whole large folio (up to 2 MiB) for one touched row.

These functions compute *exact* statistics of private data; they release nothing. The
learners add noise calibrated to the sensitivities stated here before anything leaves.
"""

import mmap
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from dpvision.errors import DPVisionError
from dpvision.mechanisms.clipping import clip_rows

DEFAULT_CHUNK_SIZE = 16384

RELEASE_BYTES = 2**26
"""File-backed bytes one read of a read-only memory map may keep mapped before releasing."""

_FOLIO_BYTES = 2**21  # the most the kernel maps for one touched row (a 2 MiB large folio)


def _read_only_map(features: np.ndarray) -> mmap.mmap | None:
    """The read-only ``mmap.mmap`` under ``features`` (found along ``.base``), else None."""
    if not hasattr(mmap, "MADV_DONTNEED") or getattr(features, "flags", None) is None:
        return None
    if features.flags.writeable:  # a writeable or copy-on-write map: never drop its pages
        return None
    base = features.base
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if base is None:
        return None
    try:
        with memoryview(base) as view:
            if not view.readonly:  # a writeable map seen through a read-only view
                return None
    except ValueError:  # a closed map
        return None
    return base


def _byte_bounds(array: np.ndarray) -> tuple[int, int]:
    """[low, high) addresses of the bytes ``array`` spans (any strides)."""
    low = high = array.__array_interface__["data"][0]
    for size, stride in zip(array.shape, array.strides, strict=True):
        if stride < 0:
            low += (size - 1) * stride
        else:
            high += (size - 1) * stride
    return low, high + array.itemsize


def _release(mapping: mmap.mmap, origin: int, span: np.ndarray) -> None:
    """Unmaps (``MADV_DONTNEED``) the pages of ``mapping`` under the view ``span``.

    The range is widened to whole 2 MiB blocks: touching one byte can map the whole large
    folio around it, which reaches past the rows read.
    """
    if span.size == 0:
        return
    low, high = _byte_bounds(span)
    first = max(0, (low - origin) // _FOLIO_BYTES * _FOLIO_BYTES)
    last = min(len(mapping), -(-(high - origin) // _FOLIO_BYTES) * _FOLIO_BYTES)
    if last > first:
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)


def _index_groups(features: np.ndarray, rows: np.ndarray, origin: int) -> list[np.ndarray]:
    """Splits ``rows`` into parts whose rows lie in at most RELEASE_BYTES / 2 MiB blocks.

    A touched row can map its whole 2 MiB block, so a part keeps at most about
    RELEASE_BYTES mapped, however scattered its rows.
    """
    offsets = rows.astype(np.int64) * features.strides[0]
    offsets += features.__array_interface__["data"][0] - origin
    blocks = offsets // _FOLIO_BYTES
    new_block = np.ones(len(rows), dtype=np.int64)
    new_block[1:] = blocks[1:] != blocks[:-1]
    group = (np.cumsum(new_block) - 1) // max(1, RELEASE_BYTES // _FOLIO_BYTES)
    return np.split(rows, np.flatnonzero(np.diff(group)) + 1)


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on torch's default device: the learner's ``device`` while it fits (its
    ``fit`` runs inside ``with torch.device(...)``), else the CPU (then ``tensor`` itself)."""
    return tensor.to(torch.get_default_device())


def read_rows(features: np.ndarray, rows: slice | np.ndarray) -> torch.Tensor:
    """``features[rows]`` copied into a new float64 tensor (on the default device, see
    :func:`on_device`); a memory map's pages are let go.

    Args:
      features: (n, d) array, in memory or memory-mapped.
      rows: a slice, or an array of row numbers (sorted is fastest on a memory map; a
        boolean mask is taken as ``np.flatnonzero(mask)``).

    When ``features`` is a read-only memory map, the pages each read touched are unmapped
    from the process right after the copy (at most about :data:`RELEASE_BYTES` stay mapped
    at once, whatever the number of rows), so the process's resident memory does not grow
    with the part of the file read so far. Other arrays are read as ``np.array(...)`` does.

    Privacy:
      Releases nothing: it returns the private rows exactly, for the caller to clip and
      aggregate before any noisy release.
    """
    mapping = _read_only_map(features)
    if mapping is None:
        return on_device(torch.from_numpy(np.array(features[rows], dtype=np.float64)))
    origin = np.frombuffer(mapping, dtype=np.uint8).ctypes.data  # the map's first byte
    n = len(features)
    parts: list[slice] | list[np.ndarray]
    if isinstance(rows, slice) and rows.indices(n)[2] == 1:
        start, stop, _ = rows.indices(n)
        per_part = max(1, RELEASE_BYTES // max(1, abs(features.strides[0])))
        parts = [slice(a, min(a + per_part, stop)) for a in range(start, stop, per_part)]
        count = max(0, stop - start)
    else:
        index = np.arange(n)[rows] if isinstance(rows, slice) else np.asarray(rows)
        if index.dtype == np.bool_:
            index = np.flatnonzero(index)
        index = np.where(index < 0, index + n, index)  # negative row numbers, as in NumPy
        count = len(index)
        parts = _index_groups(features, index, origin) if count else []
    out = np.empty((count, *features.shape[1:]), dtype=np.float64)
    done = 0
    for part in parts:
        block = features[part]  # a view of the map for a slice, a copy for row numbers
        out[done : done + len(block)] = block
        done += len(block)
        if not isinstance(part, slice):
            block = features[int(part.min()) : int(part.max()) + 1]  # the pages it touched
        _release(mapping, origin, block)
    return on_device(torch.from_numpy(out))


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
