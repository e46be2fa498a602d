"""``tests/gpu``: the ``cuda`` fixture (the real GPU, or the fake one of
:mod:`cuda_devices`), and ``gpu`` tests skipped where torch sees no CUDA device."""

from collections.abc import Iterator

import pytest
import torch
from cuda_devices import ON_FAKE, ON_GPU, Cuda, fake_cuda


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture(
    params=[
        pytest.param(ON_GPU, marks=pytest.mark.gpu, id="gpu"),
        pytest.param(ON_FAKE, id="fake-cuda"),
    ]
)
def cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cuda]:
    """The real GPU (marked ``gpu``) or the fake CUDA device (the default suite)."""
    if not request.param.fake:
        yield request.param
        return
    with fake_cuda(monkeypatch):
        yield request.param
