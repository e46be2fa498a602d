"""The CUDA devices of ``tests/gpu``: a real GPU, or a fake one that computes on the CPU.

A test that takes the ``cuda`` fixture (``conftest.py``) runs twice:

* ``[gpu]``, marked ``gpu``: on the real ``cuda:0``; skipped where torch sees no CUDA device.
  ``pytest -m gpu tests/gpu`` runs these on a GPU machine.
* ``[fake-cuda]``, in the default suite: on :func:`fake_cuda`, so that the *logic* around a
  CUDA run (resolving ``--device cuda``, naming the device, checkpoints and their refusals,
  ledgers, the memory check) is tested on every machine, CI included, and a slip in it is
  caught without a GPU.

The fake is honest about what it is: torch reports one CUDA device (``torch.cuda.*`` answers
what dpvision asks), dpvision's device resolution really runs and resolves ``cuda`` to
``cuda:0``, and every name dpvision records says so (the config's ``device``, the result's
``device``: ``cuda:0 (fake CUDA ...)``); but the tensors, the generators and the kernels are
the CPU's, so a checkpoint records its noise generator on ``cpu``, and nothing numerical
about CUDA is tested by it. Code that bypasses dpvision's resolution and puts a tensor on
``cuda`` itself fails under the fake where there is no GPU ("Torch not compiled with CUDA
enabled") instead of passing. Tests of the kernels themselves (rounding, TF32, bf16,
``torch.compile``, NCCL) use the ``gpu`` marker alone and have no fake variant.
"""

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dpvision import devices
from dpvision.devices import Placement, parse_precision

FAKE_NAME = "fake CUDA device, computing on the CPU"
CPU = torch.device("cpu")
TESTS = str(Path(__file__).resolve().parents[1]) + "/"  # tests/
CUDA_0 = torch.device("cuda", 0)  # a name: no tensor is made there by the fake


@dataclasses.dataclass(frozen=True)
class FakeCudaPlacement(Placement):
    """A placement on the CPU that is named after the CUDA device the choice resolved to."""

    named: torch.device = CUDA_0

    def describe(self) -> str:
        return f"{self.named} ({torch.cuda.get_device_name(self.named)})"


_REAL_RESOLVE = devices.resolve_device
_REAL_PLACEMENT = devices.placement


def _fake_resolve(spec: str | torch.device) -> torch.device:
    """The real resolution (over the faked ``torch.cuda``); a CUDA device computes on the CPU."""
    chosen = _REAL_RESOLVE(spec)
    return CPU if chosen.type == "cuda" else chosen


def _fake_placement(device: str = "auto", precision: str = "fp32") -> Placement:
    chosen = _REAL_RESOLVE(device)
    if chosen.type != "cuda":
        return _REAL_PLACEMENT(device, precision)
    return FakeCudaPlacement(CPU, parse_precision(precision), named=chosen)


def _rebind(old: Callable[..., Any], new: Callable[..., Any]) -> None:
    """Every name bound to ``old`` (``from dpvision.devices import ...``) in dpvision's
    modules and the tests' own (this one's aside), bound to ``new`` instead."""
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None) or ""
        ours = name.split(".")[0] == "dpvision" or where.startswith(TESTS)
        if ours and module is not sys.modules[__name__]:
            for attribute, value in list(vars(module).items()):
                if value is old:
                    setattr(module, attribute, new)


def _host_memory() -> tuple[int, int]:
    fields = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return fields["MemAvailable"], fields["MemTotal"]


@contextlib.contextmanager
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One fake CUDA device, ``cuda:0``, that computes on the CPU, while the block runs
    (see the module docstring); ``monkeypatch`` undoes the ``torch.cuda`` answers."""

    def one_device(device: Any = None) -> None:
        if isinstance(device, int):
            device = torch.device("cuda", device)
        if device is not None and torch.device(device) not in (CUDA_0, torch.device("cuda")):
            raise AssertionError(f"the fake has one device, cuda:0, not {device}")

    def name(device: Any = None) -> str:
        one_device(device)
        return FAKE_NAME

    def memory(device: Any = None) -> tuple[int, int]:
        one_device(device)
        return _host_memory()

    def properties(device: Any = None) -> SimpleNamespace:
        one_device(device)
        return SimpleNamespace(name=FAKE_NAME, total_memory=_host_memory()[1])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", one_device)
    monkeypatch.setattr(torch.cuda, "get_device_name", name)
    monkeypatch.setattr(torch.cuda, "mem_get_info", memory)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    _rebind(_REAL_RESOLVE, _fake_resolve)
    _rebind(_REAL_PLACEMENT, _fake_placement)
    try:
        yield
    finally:  # modules imported meanwhile bound the fakes too: all get the real ones back
        _rebind(_fake_resolve, _REAL_RESOLVE)
        _rebind(_fake_placement, _REAL_PLACEMENT)


@dataclasses.dataclass(frozen=True)
class Cuda:
    """The device a test runs on, and the DP-SGD run it trains there.

    Attributes:
      fake: whether it is the fake device (then ``compute`` is the CPU).
      compute: where the tensors really are: ``cuda:0``, or the CPU under the fake.
      dpsgd: ``dpvision train`` arguments of a short DP-SGD run (WRN-10-1 on a GPU; a tiny
        MLP under the fake, where only the logic is tested). Its secret seed is fixed: two
        runs of the same arguments draw the same batches and noise (the seed is mixed with
        the whole config, so not two runs that differ in any setting but the device).
    """

    fake: bool
    compute: torch.device
    dpsgd: tuple[str, ...]


SECRET = ("--secret-seed", "20261126")  # replays the runs compared (never published)


def _learner(**options: object) -> tuple[str, ...]:
    return tuple(item for k, v in options.items() for item in ("--set", f"learner.{k}={v}"))


ON_GPU = Cuda(
    fake=False,
    compute=CUDA_0,
    dpsgd=(
        "--method",
        "dp-sgd",
        *SECRET,
        *_learner(
            model="'wrn-10-1'",
            steps=6,
            batch_size=128,
            augmult=2,
            ema_decay=0.9,
            physical_batch_size=32,
        ),
    ),
)
ON_FAKE = Cuda(
    fake=True,
    compute=CPU,
    dpsgd=(
        "--method",
        "dp-sgd",
        *SECRET,
        "--set",
        "accountant='rdp'",  # calibrates σ in a fraction of PLD's time
        *_learner(
            model="'mlp-16'",
            steps=6,
            batch_size=64,
            augmult=2,
            ema_decay=0.9,
            physical_batch_size=16,
        ),
    ),
)
