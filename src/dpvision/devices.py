"""Where and in what precision a run computes: ``--device`` and ``--precision``.

:func:`parse_device` checks the spelling of a device choice (``auto``, ``cpu``, ``cuda``,
``cuda:N``) without touching CUDA, for config validation; :func:`resolve_device` turns it
into a :class:`torch.device`, with a one-line error when the device is not there. ``auto``
picks the current CUDA device when torch sees one (under ``torchrun``, the rank's
``LOCAL_RANK`` device), else the CPU. :class:`Placement` carries the resolved device and
the precision to every part of a run: the autocast context, device generators, the free
memory.

Precision (:data:`PRECISIONS`): ``fp32`` (the default) or ``bf16``. ``bf16`` runs the
forward and backward passes under :func:`torch.autocast`; every privacy-relevant number —
per-example norms, clip factors, clipped sums, noise, optimizer state — stays in float32
(:mod:`dpvision.per_example` upcasts what the layers recorded before it computes them).
``fp16`` is refused: it needs loss scaling, and a dynamic loss scale is chosen from
overflows of the private batch's gradients.

Privacy: choosing a device or a precision releases nothing.

>>> parse_device("cuda:1"), parse_device("auto"), parse_precision("bfloat16")
('cuda:1', 'auto', 'bf16')
>>> resolve_device("cpu")
device(type='cpu')
"""

import contextlib
import dataclasses
import re
from collections.abc import Iterator

import torch

from dpvision.errors import DPVisionError

__all__ = [
    "DEVICE_CHOICES",
    "PRECISIONS",
    "Placement",
    "available_memory",
    "parse_device",
    "parse_precision",
    "placement",
    "resolve_device",
]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
_PRECISION_ALIASES = {"float32": "fp32", "32": "fp32", "bfloat16": "bf16", "bf16-mixed": "bf16"}

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_SPELLING = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def parse_device(spec: str | torch.device) -> str:
    """``spec`` normalised (stripped, lower case) if it names a device choice.

    Raises:
      DPVisionError: one line listing the choices.
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        raise DPVisionError(f"device must be a string ({DEVICE_CHOICES}), got {spec!r}")
    text = spec.strip().lower()
    if not _SPELLING.match(text):
        raise DPVisionError(f"unknown device {spec!r}; choose {DEVICE_CHOICES}")
    return text


def resolve_device(spec: str | torch.device) -> torch.device:
    """The :class:`torch.device` that ``spec`` stands for on this machine.

    Raises:
      DPVisionError: a bad spelling, CUDA asked for where torch has none, or a CUDA index
        beyond the devices present (one line, naming what is there).
    """
    text = parse_device(spec)
    has_cuda = torch.cuda.is_available()
    if text == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device()) if has_cuda else torch.device("cpu")
        )
    if text == "cpu":
        return torch.device("cpu")
    if not has_cuda:
        raise DPVisionError(
            f"device {text}: this torch ({torch.__version__}) sees no CUDA device; use cpu or auto"
        )
    index = torch.cuda.current_device() if text == "cuda" else int(text.split(":")[1])
    count = torch.cuda.device_count()
    if index >= count:
        raise DPVisionError(
            f"device {text}: there {'is' if count == 1 else 'are'} {count} CUDA "
            f"device{'' if count == 1 else 's'} (cuda:0 to cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def parse_precision(spec: str) -> str:
    """``spec`` as one of :data:`PRECISIONS` (``float32``/``bfloat16`` are accepted too).

    Raises:
      DPVisionError: one line; ``fp16`` says why it is not offered.
    """
    if not isinstance(spec, str):
        raise DPVisionError(f"precision must be a string (fp32 or bf16), got {spec!r}")
    text = spec.strip().lower()
    text = _PRECISION_ALIASES.get(text, text)
    if text in ("fp16", "float16", "16", "16-mixed", "half"):
        raise DPVisionError(
            "precision fp16 needs loss scaling, and a dynamic loss scale is set by overflows "
            "of the private batch's gradients; use bf16 (same speed on GPUs since Ampere) or fp32"
        )
    if text not in PRECISIONS:
        raise DPVisionError(f"unknown precision {spec!r}; choose fp32 or bf16")
    return text


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``: CUDA's free memory, or the host's
    ``MemAvailable``; None when it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclasses.dataclass(frozen=True)
class Placement:
    """A resolved device and precision, as every part of a run uses them.

    Attributes:
      device: where models, data batches, per-example clipping, noise and evaluation live.
      precision: ``fp32`` or ``bf16`` (see the module docstring).
    """

    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast dtype of forward and backward passes; None for fp32."""
        return PRECISIONS[self.precision]

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Forward and backward passes in the low precision (nothing with fp32)."""
        dtype = self.compute_dtype
        if dtype is None:
            yield
            return
        with torch.autocast(self.device.type, dtype=dtype):
            yield

    def generator(self, seed: int) -> torch.Generator:
        """A generator on the device, seeded: its state is checkpointed with the run."""
        return torch.Generator(device=self.device).manual_seed(int(seed))

    def describe(self) -> str:
        """``cpu`` or ``cuda:0 (NVIDIA H100 80GB HBM3)``: the device, named."""
        text = str(self.device)
        if self.device.type == "cuda":
            text += f" ({torch.cuda.get_device_name(self.device)})"
        return text


def placement(device: str = "auto", precision: str = "fp32") -> Placement:
    """The :class:`Placement` of a ``device`` and ``precision`` choice on this machine.

    Raises:
      DPVisionError: either choice misspelt, or the device absent (one line each).
    """
    chosen = resolve_device(device)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)  # kernels and NCCL default to the chosen GPU
    return Placement(chosen, parse_precision(precision))
