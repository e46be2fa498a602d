"""Data-independent reductions of feature maps: spatial average pooling, random projection.

Both are fixed linear maps chosen without looking at the data, so applying them costs no
privacy. The projection matrix depends only on ``(input_dim, output_dim, seed)``:

>>> import numpy as np
>>> m = projection_matrix(6, 3, seed=0)
>>> m.shape, m.dtype, bool(np.array_equal(m, projection_matrix(6, 3, seed=0)))
((6, 3), dtype('float32'), True)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from dpvision.errors import DPVisionError

if TYPE_CHECKING:
    import torch

__all__ = ["average_pool", "pooled_size", "projection_matrix"]


def pooled_size(size: int, pool: int) -> int:
    """Side length after pooling a side of ``size`` with window and stride ``pool``.

    Windows that overhang the border are kept, so no position is dropped.

    >>> pooled_size(7, 2), pooled_size(8, 2), pooled_size(7, 1)
    (4, 4, 7)
    """
    return -(-size // pool)


def average_pool(maps: torch.Tensor, pool: int) -> torch.Tensor:
    """Averages ``(N, K, h, w)`` maps over non-overlapping ``pool × pool`` windows.

    A window that overhangs the right or bottom border averages only the positions it
    covers (``ceil_mode``), so ``7 × 7`` maps pool to ``4 × 4`` with ``pool=2``.

    Args:
        maps: Tensor ``(N, K, h, w)``.
        pool: Window and stride; 1 returns ``maps`` unchanged.

    Returns:
        Tensor ``(N, K, ceil(h/pool), ceil(w/pool))``.

    Privacy:
        A fixed linear map of each example's features: no data statistic, no privacy cost.
    """
    if pool == 1:
        return maps
    import torch.nn.functional as functional

    return functional.avg_pool2d(maps, kernel_size=pool, stride=pool, ceil_mode=True)


def projection_matrix(input_dim: int, output_dim: int, *, seed: int) -> np.ndarray:
    """The Gaussian random projection ``R`` used for ``projection_dim``: features -> ``x @ R``.

    Entries are i.i.d. N(0, 1/output_dim), so ``E‖x R‖² = ‖x‖²`` (Johnson-Lindenstrauss).
    The matrix is drawn in ``float32``, row-major, from ``numpy.random.default_rng(seed)``.

    Args:
        input_dim: Dimension of the flattened features.
        output_dim: Dimension after projection.
        seed: Public seed, fixed before seeing the data.

    Returns:
        ``float32`` array of shape ``(input_dim, output_dim)``.

    Raises:
        DPVisionError: If a dimension is below 1 or the seed is negative.

    Privacy:
        The matrix depends only on the dimensions and the seed, never on the data, so the
        projection costs no privacy.
    """
    if input_dim < 1 or output_dim < 1:
        raise DPVisionError(f"projection dimensions must be >= 1, got {input_dim} -> {output_dim}")
    if seed < 0:
        raise DPVisionError(f"projection_seed must be >= 0, got {seed}")
    rng = np.random.default_rng(seed)
    matrix = np.empty((input_dim, output_dim), dtype=np.float32)
    rng.standard_normal(out=matrix, dtype=np.float32)
    matrix *= np.float32(1.0 / math.sqrt(output_dim))
    return matrix
