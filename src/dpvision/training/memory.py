"""Memory: refuse a physical batch that cannot fit before the run starts, and turn the
allocator's failure into advice (``physical_batch_size`` changes speed, never the result)."""

import numpy as np
import torch

from dpvision.errors import DPVisionError
from dpvision.training.options import DPSGDOptions


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(options: DPSGDOptions, input_shape: torch.Size) -> None:
    """Refuses a physical batch whose input views alone would not fit in memory."""
    available = _available_memory()
    views = max(options.augmult, 1)
    needed = options.performance.physical_batch_size * views * int(np.prod(input_shape)) * 4
    if available is not None and needed > available:
        raise DPVisionError(
            _memory_advice(options, f"its inputs alone need {needed / 2**30:.1f} GiB")
        )


def _memory_advice(options: DPSGDOptions, what: str) -> str:
    physical = options.performance.physical_batch_size
    smaller = max(physical // 4, 1)
    return (
        f"learner.physical_batch_size = {physical} (× {max(options.augmult, 1)} "
        f"views) does not fit in memory ({what}); lower it, e.g. --set "
        f"learner.physical_batch_size={smaller} (it changes speed, not the privacy or the result)"
    )


def memory_error(error: RuntimeError, options: DPSGDOptions) -> BaseException:
    text = str(error)
    if (
        isinstance(error, torch.OutOfMemoryError)
        or "out of memory" in text
        or "can't allocate" in text
    ):
        return DPVisionError(_memory_advice(options, "the allocator ran out"))
    return error
