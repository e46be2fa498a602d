"""Named phases of a DP-SGD step for ``torch.profiler``: where a private step's time goes.

The book-keeping path labels its phases (``dpvision::forward``, ``dpvision::backward``,
``dpvision::norms[Linear]``, ``dpvision::clip_factors``, ``dpvision::clipped_sum[Conv2d]``,
``dpvision::noise``, ``dpvision::optimizer``) with :func:`torch.profiler.record_function`, so a
``torch.profiler.profile`` of any training loop shows them beside the kernels they ran, on
the CPU and on CUDA alike (``benchmarks/bookkeeping_profile.py`` reads them). Outside a
profiler a phase is a no-op (one flag read).

Privacy:
  Releases nothing: a phase's name is fixed by the code and the layer type, never by data.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch.autograd import profiler as _autograd_profiler

__all__ = ["PREFIX", "phase"]

PREFIX = "dpvision::"


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Labels the code inside as ``dpvision::<name>`` for a running ``torch.profiler``."""
    if not _autograd_profiler._is_profiler_enabled:
        yield
        return
    with torch.profiler.record_function(PREFIX + name):
        yield
