"""Device choices: spelling, ``auto`` on a machine without CUDA, one-line errors."""

import pytest
import torch

from dpvision.devices import parse_device, resolve_device
from dpvision.errors import DPVisionError


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:0", " CUDA:3 "])
def test_choices_are_parsed_without_touching_cuda(spec):
    assert parse_device(spec) == spec.strip().lower()


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "mps", "", "cpu:0"])
def test_unknown_devices_are_one_line_errors(spec):
    with pytest.raises(DPVisionError, match="choose auto, cpu, cuda or cuda:N") as error:
        parse_device(spec)
    assert "\n" not in str(error.value)


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DPVisionError, match="sees no CUDA device; use cpu or auto"):
        resolve_device("cuda")


def test_cuda_indices_are_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DPVisionError, match=r"there are 2 CUDA devices \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")
