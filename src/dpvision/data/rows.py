"""Rows of a large feature matrix, read without piling up its pages, and row views that are
not read yet (:class:`Rows`).

A feature matrix may be a NumPy array or a memory-mapped one larger than RAM (a cached
``.npy`` opened with ``mmap_mode="r"``). Reading a memory map is not free in memory: every
page of the file that a read touches stays mapped into the process (file-backed resident
memory, counted by RSS and ``ru_maxrss``) until it is unmapped, so one pass over a 4 GB map
leaves the process 4 GB resident even though each chunk was copied out and dropped. The
kernel would reclaim those pages under pressure, but RSS limits (cgroups, schedulers,
``ulimit``) count them. :func:`gather`, which every reader of features goes through,
therefore copies the rows out and then unmaps the pages it just read
(``madvise(MADV_DONTNEED)``; they stay in the page cache, so reading them again costs a
page fault, not a disk read). That is only done for a read-only map (``np.load(...,
mmap_mode="r")`` or ``np.memmap(..., mode="r")``), where nothing can be lost; copy-on-write
and writeable maps and in-memory arrays are read as is. Scattered rows (a class's rows, a
sampled batch) are released every few 2 MiB blocks of the file, because the kernel maps a
whole large folio (up to 2 MiB) for one touched row.

Privacy: these functions read private rows exactly and release nothing.
"""

import mmap
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

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


def gather(
    features: np.ndarray, rows: slice | np.ndarray, dtype: np.dtype | type = np.float64
) -> np.ndarray:
    """``features[rows]`` copied into a new array of ``dtype``; a memory map's pages are let go.

    Args:
      features: (n, ...) array, in memory or memory-mapped.
      rows: a slice, or an array of row numbers (sorted is fastest on a memory map; a
        boolean mask is taken as ``np.flatnonzero(mask)``).
      dtype: of the copy (float64: exact for float32 and float64 features).

    When ``features`` is a read-only memory map, the pages each read touched are unmapped
    from the process right after the copy (at most about :data:`RELEASE_BYTES` stay mapped
    at once, whatever the number of rows), so the process's resident memory does not grow
    with the part of the file read so far. Other arrays are read as ``np.array(...)`` does.

    Privacy:
      Releases nothing: it returns the private rows exactly (or rounded to ``dtype``).
    """
    mapping = _read_only_map(features)
    if mapping is None:
        block = features[rows]  # a view for a slice, a new array for row numbers
        if np.may_share_memory(block, features):
            return np.array(block, dtype=dtype)
        return block.astype(dtype, copy=False)
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
    out = np.empty((count, *features.shape[1:]), dtype=dtype)
    done = 0
    for part in parts:
        block = features[part]  # a view of the map for a slice, a copy for row numbers
        out[done : done + len(block)] = block
        done += len(block)
        if not isinstance(part, slice):
            block = features[int(part.min()) : int(part.max()) + 1]  # the pages it touched
        _release(mapping, origin, block)
    return out


@dataclass(frozen=True)
class Rows:
    """Rows of one or more arrays, one after the other, not read yet: what a run trains or
    tests on before its preprocessing reads them once (no copy of the subset is made).

    ``parts``: (array, row numbers or ``None`` for all of its rows); the arrays share
    their trailing shape.
    """

    parts: tuple[tuple[np.ndarray, np.ndarray | None], ...]

    @classmethod
    def of(cls, array: np.ndarray, rows: np.ndarray | None = None) -> "Rows":
        """``array``'s rows ``rows`` (integer indices; ``None``: all of them)."""
        if rows is None:
            return cls(((array, None),))
        indices = np.asarray(rows)
        if indices.ndim != 1 or not (indices.size == 0 or np.issubdtype(indices.dtype, np.integer)):
            # a boolean mask would be cut into chunks and read as positions within each
            raise TypeError(
                f"Rows.of takes integer row indices, not {indices.dtype} {indices.shape}"
            )
        return cls(((array, indices),))

    def __add__(self, other: "Rows") -> "Rows":
        return Rows(self.parts + other.parts)

    def __len__(self) -> int:
        return sum(len(a) if r is None else len(r) for a, r in self.parts)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.parts[0][0].shape[1:])

    def chunks(self, rows_per_chunk: int, dtype: np.dtype | type) -> Iterator[np.ndarray]:
        """The rows in order, ``rows_per_chunk`` at a time, read with :func:`gather`."""
        for array, rows in self.parts:
            count = len(array) if rows is None else len(rows)
            for start in range(0, count, rows_per_chunk):
                stop = min(count, start + rows_per_chunk)
                yield gather(array, slice(start, stop) if rows is None else rows[start:stop], dtype)


def row_chunks(
    features: "np.ndarray | Rows", rows_per_chunk: int, dtype: np.dtype | type
) -> Iterator[np.ndarray]:
    """``features`` (an array or :class:`Rows`) ``rows_per_chunk`` rows at a time, as
    ``dtype`` copies (:func:`gather`: a read-only map's pages are let go)."""
    source = features if isinstance(features, Rows) else Rows.of(features)
    yield from source.chunks(max(1, rows_per_chunk), dtype)


def rows_per_chunk(features: "np.ndarray | Rows", chunk_bytes: int, itemsize: int = 8) -> int:
    """How many rows of ``features`` fit in ``chunk_bytes`` as ``itemsize``-byte numbers."""
    width = int(np.prod(features.shape[1:], dtype=np.int64)) * itemsize
    return max(1, chunk_bytes // max(1, width))
