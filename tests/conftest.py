"""The whole suite runs in a scratch home: nothing is read from or written to the user's
``~/.cache/dpvision`` (datasets, the feature cache) or anywhere else under ``$HOME``.

Set at import, before any test module is collected, so subprocesses the tests start inherit
it too. ``DPVISION_DATA`` is kept: it is where CI's copy of Fashion-MNIST lives.

Every test also gets torch's thread count back as it found it: a benchmark row run in-process
sets it, and a later test that compares an in-process run with a subprocess (two threads)
would otherwise compare two different orders of float additions.
"""

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

REAL_HOME = Path.home()
SCRATCH_HOME = Path(tempfile.mkdtemp(prefix="dpvision-tests-home-"))
os.environ["DPVISION_TESTS_REAL_HOME"] = str(REAL_HOME)  # for tests/test_isolation.py
os.environ["HOME"] = str(SCRATCH_HOME)
os.environ["DPVISION_CACHE"] = str(SCRATCH_HOME / ".cache" / "dpvision" / "features")
os.environ.setdefault("MPLCONFIGDIR", str(SCRATCH_HOME / ".config" / "matplotlib"))


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Phase I encoder for 8x8 gray images like digits' (synthetic data: public)."""
    from dpvision.training.pretrain import pretrain
    from dpvision.training.pretrain_options import PretrainOptions

    path = tmp_path_factory.mktemp("encoder") / "enc.pt"
    options = {"model": "mlp-16", "synthetic": "dead-leaves-mixed", "size": 8, "channels": 1}
    options |= {"num_images": 64, "batch_size": 32, "steps": 3}
    pretrain(PretrainOptions.from_dict(options), path, quiet=True)
    return path
