"""Where a run computes: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (issue 21, first part).

:func:`parse_device` checks the spelling of a device choice without touching CUDA (for
config validation); :func:`resolve_device` turns it into a :class:`torch.device`, with a
one-line error when the device is not there. ``auto`` picks the current CUDA device when
torch sees one, else the CPU. The commands do not take a device yet; this module is the
single place they will resolve it.

Privacy: choosing a device releases nothing.

>>> parse_device("cuda:1"), parse_device("auto")
('cuda:1', 'auto')
>>> resolve_device("cpu")
device(type='cpu')
"""

import re

import torch

from dpvision.errors import DPVisionError

__all__ = ["DEVICE_CHOICES", "parse_device", "resolve_device"]

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_SPELLING = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def parse_device(spec: str) -> str:
    """``spec`` normalised (stripped, lower case) if it names a device choice.

    Raises:
      DPVisionError: one line listing the choices.
    """
    if not isinstance(spec, str):
        raise DPVisionError(f"device must be a string ({DEVICE_CHOICES}), got {spec!r}")
    text = spec.strip().lower()
    if not _SPELLING.match(text):
        raise DPVisionError(f"unknown device {spec!r}; choose {DEVICE_CHOICES}")
    return text


def resolve_device(spec: str) -> torch.device:
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
