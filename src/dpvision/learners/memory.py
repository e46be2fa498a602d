"""Memory and time of a second-order learner's d×d (or m·d×d) matrices, checked before they
are allocated.

DP-LS, DP-Newton and DP-FC hold float64 d×d matrices (the Gram matrix, its noise, the
factorisation of each class's system): 8·d² bytes each, which at ScatterNet's 15 552
dimensions of a 32×32 RGB image is 1.9 GB a matrix, and solve them in time ∝ d³. Each
learner states its own :class:`Footprint` (how many such matrices are alive at its peak and
how much work its statistics, noise and solves are); :func:`check_footprint` compares it
with the memory free on the device, refuses in one line naming the alternatives when it
does not fit, and warns (once per shape) when the fit will take long.

The work is counted in the floating-point operations of a matrix product, and the time is
that work at the rate of a matrix product measured once on the device (a 1024×1024 float64
product, a few milliseconds): an eigendecomposition is counted as :data:`EIGH_WORK`·d³ of
them, which is what ``torch.linalg.eigh`` took on a 2-core CPU at d = 2048 (its tridiagonal
reduction is bound by memory bandwidth, so it is slower per flop than a product).

Privacy: the estimates depend on d, m and n only (the shape of the data, public: n is the
count every sample rate divides by and every result reports), never on a value.
"""

import dataclasses
import functools
import math
import os
import time
from pathlib import Path

import torch

from dpvision.errors import DPVisionError
from dpvision.log import logger

__all__ = [
    "CHOLESKY_WORK",
    "EIGH_WORK",
    "NESTED_SECONDS",
    "PROGRESS_SECONDS",
    "WARN_SECONDS",
    "Footprint",
    "available_bytes",
    "check_footprint",
    "estimate_seconds",
    "fits",
    "gigabytes",
    "largest_dimension",
]

EIGH_WORK = 25.0
"""A d×d symmetric eigendecomposition, in units of d³ matrix-product flops (conservative)."""
CHOLESKY_WORK = 1.0
"""A d×d Cholesky factorisation (d³/3 flops at about a third of a product's rate)."""
NORMAL_WORK = 50.0
"""One Gaussian draw, in matrix-product flops (a draw costs about as much as 50 of them)."""
WARN_SECONDS = 60.0
"""A fit estimated to take longer than this is warned about (once per shape)."""
PROGRESS_SECONDS = 5.0
"""A fit estimated to take longer than this shows its progress."""
NESTED_SECONDS = 30.0
"""... and inside another phase's progress (an audit's runs), longer than this."""

_warned: set[tuple[str, int, int]] = set()


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What a second-order fit allocates and computes.

    Attributes:
      learner: its name (``DP-LS``).
      d: the number of features.
      m: the number of classes.
      n: the number of training rows.
      matrices: float64 d×d matrices alive at the peak.
      extra_bytes: other memory at the peak (the chunk of rows read, vectors).
      work: the statistics, noise and solves, in matrix-product flops.
      solves: what the solves are, for the messages (``3 eigendecompositions``).
    """

    learner: str
    d: int
    m: int
    n: int
    matrices: float
    extra_bytes: float
    work: float
    solves: str

    @property
    def bytes(self) -> float:
        """Peak memory, in bytes."""
        return 8.0 * self.d * self.d * self.matrices + self.extra_bytes


def _meminfo_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), else free physical pages (POSIX)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    """What the process's cgroup (v2) still allows: ``memory.max`` − ``memory.current``."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        folder = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text())
    except (OSError, ValueError, IndexError):
        return None


def available_bytes(device: str | torch.device = "cpu") -> int | None:
    """Memory free for new tensors on ``device``: on a CUDA device what
    ``torch.cuda.mem_get_info`` reports free; on the CPU the smaller of the kernel's
    ``MemAvailable`` and what the cgroup limit leaves; None where it cannot tell."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    found = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    return min(found) if found else None


@functools.cache
def _product_rate(device: str) -> float:
    """Matrix-product flops per second on ``device`` (float64, best of three 1024×1024)."""
    size = 1024
    a = torch.ones(size, size, dtype=torch.float64, device=device)
    best = math.inf
    for _ in range(3):
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        start = time.perf_counter()
        a @ a
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9)


def estimate_seconds(footprint: Footprint, device: str | torch.device = "cpu") -> float:
    """The fit's time at the measured matrix-product rate of ``device``."""
    return footprint.work / _product_rate(str(torch.device(device)))


def largest_dimension(footprint: Footprint, free: float) -> int:
    """The largest d whose footprint (same learner, m and n) fits in ``free`` bytes."""
    per_d2 = 8.0 * footprint.matrices
    extra_per_d = footprint.extra_bytes / max(footprint.d, 1)
    # 8·k·d² + e·d ≤ free
    d = (-extra_per_d + math.sqrt(extra_per_d**2 + 4 * per_d2 * max(free, 0.0))) / (2 * per_d2)
    return max(0, int(d))


def gigabytes(count: float) -> str:
    """``5.8 GB`` or ``310 MB`` (decimal units, as ``free -h --si`` writes them)."""
    return f"{count / 1e9:.1f} GB" if count >= 1e9 else f"{count / 1e6:.0f} MB"


def fits(footprint: Footprint | None, device: str | torch.device = "cpu") -> bool:
    """Whether ``footprint`` fits in the memory free on ``device`` (True when unknown)."""
    free = available_bytes(device)
    return footprint is None or free is None or footprint.bytes <= free


def check_footprint(footprint: Footprint | None, device: str | torch.device = "cpu") -> float:
    """Refuses a fit whose matrices do not fit in the free memory of ``device``; warns once
    per shape when it will take more than :data:`WARN_SECONDS`. Returns the estimated
    seconds (0 without a footprint).

    Raises:
      DPVisionError: one line with the memory needed and free and what to do instead
        (fewer features, or ``dp-sgd-linear``, whose memory is linear in d).
    """
    if footprint is None:
        return 0.0
    f = footprint
    free = available_bytes(device)
    shape = f"{f.matrices:g} float64 {f.d}×{f.d} matrices"
    if free is not None and f.bytes > free and f.matrices:
        fits = largest_dimension(f, free)
        raise DPVisionError(
            f"{f.learner} on {f.d} features needs about {gigabytes(f.bytes)} ({shape} at its "
            f"peak), {gigabytes(free)} are free on {torch.device(device)}: reduce the "
            f"features to at most {fits} dimensions (feature options pool=N or "
            f'projection_dim=K, e.g. features = "scatternet:pool=2"), or use '
            f'method = "dp-sgd-linear" (memory linear in d)'
        )
    seconds = estimate_seconds(f, device)
    key = (f.learner, f.d, f.m)
    if seconds > WARN_SECONDS and key not in _warned:
        _warned.add(key)
        if f.matrices:
            logger.warning(
                f"{f.learner} on {f.d} features will take about {_minutes(seconds)} and "
                f"{gigabytes(f.bytes)} ({f.solves} of {f.d}×{f.d} matrices): fewer features "
                f'(feature options pool=N or projection_dim=K) or method = "dp-sgd-linear" '
                "is much faster"
            )
        else:
            logger.warning(
                f"{f.learner} on {f.d} features will take about {_minutes(seconds)} "
                f"({f.solves}): fewer features (feature options pool=N or projection_dim=K) "
                "or fewer steps is faster"
            )
    return seconds


def _minutes(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
