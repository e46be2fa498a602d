"""Memory: refuse a physical batch that cannot fit before the run starts, and turn the
allocator's failure into advice (``physical_batch_size`` changes speed, never the result).

Both read the memory of the device the run computes on: the host's ``MemAvailable`` on
the CPU, CUDA's free memory on a GPU (:func:`dpvision.devices.available_memory`).
"""

import numpy as np
import torch

from dpvision.devices import available_memory
from dpvision.errors import DPVisionError
from dpvision.training.options import DPSGDOptions


def check_memory(
    options: DPSGDOptions, input_shape: torch.Size, device: torch.device | None = None
) -> None:
    """Refuses a physical batch whose input views alone would not fit in the memory of
    ``device`` (default: the CPU)."""
    device = device or torch.device("cpu")
    available = available_memory(device)
    views = max(options.augmult, 1)
    needed = options.performance.physical_batch_size * views * int(np.prod(input_shape)) * 4
    if available is not None and needed > available:
        where = "" if device.type == "cpu" else f" of {device}"
        raise DPVisionError(
            _memory_advice(options, f"its inputs alone need {needed / 2**30:.1f} GiB{where}")
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
