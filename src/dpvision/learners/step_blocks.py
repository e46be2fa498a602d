"""The rows of a DP-SGD-linear step, read a block at a time into reused buffers, and their
scores, computed so that a row's scores do not depend on where it sits in the batch.

Why that matters: a step releases Σᵢ clip(gᵢ) with gᵢ = eᵢ[xᵢ; 1]ᵀ; clipping rescales eᵢ
to norm C, so where eᵢ is tiny (softmax within rounding of 1) a last-bit change of a score
can turn its direction, and one example inserted before a row (which moves that row by one
place) could move the row's term by up to C. Matrix libraries round a row by its place (its
alignment, the kernel that takes the last rows of a product, the threads' split of the
rows): privacy reviews moved the release by 6.2 C with float32 scores and by 48 C with
MKL's edge kernel at m ≥ 12. :class:`StepBlocks` therefore scores fixed-shape float64
blocks, checks once that a row gets the same bits in every slot, and falls back to one
one-row product a row where it does not (``tests/learners/test_step_blocks.py``).

Privacy: reads private rows exactly and releases nothing.
"""

import numpy as np
import torch

from dpvision.data.rows import gather, row_chunks, rows_per_chunk
from dpvision.learners.statistics import DEFAULT_CHUNK_SIZE, on_device

__all__ = ["BLOCK_BYTES", "StepBlocks", "row_sq_norms", "stored_dtype"]

BLOCK_BYTES = 2**24
"""Bytes of float64 rows a step works on at a time: a block is read, scored, clipped and
summed while it is in cache, so no batch-sized copy of the rows is made."""


def row_sq_norms(features: np.ndarray, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """‖xᵢ‖² of every row of the stored values, in float64, one chunk at a time
    (non-finite rows give inf/nan). Every row's sum is taken the same way wherever the
    chunks fall (chunks of at least two rows), so a row's value does not depend on the
    other rows."""
    out = torch.empty(len(features), dtype=torch.float64)
    done = 0
    per_chunk = max(2, min(chunk_size, rows_per_chunk(features, BLOCK_BYTES * 4)))
    for chunk in row_chunks(features, per_chunk, np.float64):
        count = len(chunk)
        if count == 1:  # NumPy sums a lone row in another order: give it a zero row's company
            chunk = np.concatenate([chunk, np.zeros_like(chunk)])
        out[done : done + count] = torch.from_numpy(np.einsum("ij,ij->i", chunk, chunk)[:count])
        done += count
    return out


def stored_dtype(features: np.ndarray) -> np.dtype:
    """The dtype a step reads ``features`` in: float32 for float32 (or narrower float)
    features, float64 otherwise; either holds the stored values exactly."""
    dtype = np.dtype(features.dtype)
    return np.dtype(np.float32 if dtype.kind == "f" and dtype.itemsize <= 4 else np.float64)


class StepBlocks:
    """The buffers a step's blocks of rows are read into, made once per fit and reused by
    every block of every step (no batch-sized copy, no allocation per block), and the
    scoring of a block.

    ``rows``: the stored rows of a block (as read, on the CPU); ``exact``: the same rows in
    float64 on the fit's device, where the step's arithmetic is done. ``exact`` always has
    ``size`` rows (a multiple of 64 where ``chunk_size`` allows), at a row stride padded to
    64 bytes, and a block is scored as one product of all of it (:meth:`scores`), so each
    row is scored by the same kernel at the same alignment wherever it sits and however
    many rows the block holds. Whether the matrix library really does so is checked when
    the buffers are made, on a public random row copied into every slot (:meth:`uniform`):
    the library picks its kernels by shape, CPU and threads (MKL scores the last ``size``
    mod 4 rows with another kernel when m ≥ 12, a privacy review found). Where the check
    fails, rows are scored one at a time, each by the same one-row product.
    """

    def __init__(self, features: np.ndarray, chunk_size: int, num_classes: int) -> None:
        self.np_dtype = stored_dtype(features)
        size = max(1, min(chunk_size, rows_per_chunk(features, BLOCK_BYTES)))
        self.size = size if size < 64 else size // 64 * 64
        width = int(np.prod(features.shape[1:], dtype=np.int64))
        self.rows = np.empty((self.size, width), dtype=self.np_dtype)
        padded = -(-width // 8) * 8  # 8 float64 = 64 bytes
        self.exact = on_device(torch.zeros((self.size, padded), dtype=torch.float64))[:, :width]
        self.by_block = self.uniform(num_classes)

    def uniform(self, num_classes: int) -> bool:
        """Whether one product of the whole buffer gives every slot the same bits for the
        same row: a public random row (and head) in every slot, its scores compared.
        Depends on the shapes, the library and the machine, never on the data."""
        probe = torch.Generator().manual_seed(0)
        row = torch.randn(self.exact.shape[1], generator=probe, dtype=torch.float64)
        head = torch.randn(num_classes, self.exact.shape[1], generator=probe, dtype=torch.float64)
        bias = torch.randn(num_classes, generator=probe, dtype=torch.float64)
        self.exact.copy_(on_device(row).expand_as(self.exact))
        scores = self.scores(on_device(head), on_device(bias), by_block=True)
        same = bool((scores == scores[:1]).all())
        self.exact.zero_()
        return same

    def scores(
        self, weight: torch.Tensor, bias: torch.Tensor, *, by_block: bool | None = None
    ) -> torch.Tensor:
        """The scores (size, m) of every row of the buffer: one product of the whole buffer,
        or (where :meth:`uniform` failed) one one-row product a row. Rows past the block's
        count are left from earlier blocks; taking them too keeps every elementwise pass
        over the scores the same length (ATen computes a tensor's last elements by another
        exp, so a row's eᵢ would otherwise depend on whether it ends the batch)."""
        if by_block if by_block is not None else self.by_block:
            return torch.addmm(bias, self.exact, weight.T)
        return torch.stack([torch.addmv(bias, weight, row) for row in self.exact])

    def read(self, features: np.ndarray, index: np.ndarray) -> torch.Tensor:
        """Rows ``index`` (at most ``size``) of ``features``, exactly, in float64 on the
        fit's device: the first ``len(index)`` rows of the returned block of ``size`` rows
        (a view of ``exact``, valid until the next read; the rows after them are left from
        earlier blocks)."""
        count = len(index)
        if features.dtype == self.np_dtype and features.flags.writeable:  # in memory
            np.take(features, index, axis=0, out=self.rows[:count], mode="clip")
        else:  # a memory map (its pages let go), or another dtype
            self.rows[:count] = gather(features, index, self.np_dtype)
        self.exact[:count].copy_(on_device(torch.from_numpy(self.rows[:count])))
        return self.exact
