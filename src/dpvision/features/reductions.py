"""Data-independent reductions of feature maps: spatial average pooling, random projection.

Both are fixed linear maps chosen without looking at the data, so applying them costs no
privacy. The projection matrix depends only on ``(input_dim, output_dim, seed)``:

>>> import numpy as np
>>> m = projection_matrix(6, 3, seed=0)
>>> m.shape, m.dtype, bool(np.array_equal(m, projection_matrix(6, 3, seed=0)))
((6, 3), dtype('float32'), True)
"""

from __future__ import annotations

# local imports: start-up time (heavy modules are imported in the functions using them)
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


def rescale_to_norm(features: torch.Tensor, norm: float) -> torch.Tensor:
    """Rescales each row of ``(N, D)`` features to L2 norm ``norm``; zero rows stay zero.

    Rows with a non-finite entry become zero too, so every row has norm ``norm`` (up to
    float32 rounding) or 0.

    Privacy:
        A fixed per-example map: free. Followed by ``preprocessing.kind = "center"`` with
        ``preprocessing.clip_norm = norm``, the private centering clips nothing and its sum
        has L2 sensitivity ``norm`` (``norm / N`` for the mean), as in DP-RandP App. G.
    """
    import torch

    wide = features.to(torch.float64)
    finite = torch.isfinite(wide).all(dim=1, keepdim=True)
    wide = torch.where(finite, wide, torch.zeros_like(wide))
    lengths = torch.linalg.vector_norm(wide, dim=1, keepdim=True)
    scale = torch.where(lengths > 0, norm / lengths.clamp_min(1e-300), torch.zeros_like(lengths))
    return (wide * scale).to(features.dtype)
