"""Every TOML under ``configs/`` loads and runs a few DP-SGD steps on small files in the real
formats (CIFAR-10 python pickles, MNIST/Fashion-MNIST IDX), written here.

Only the run length and batch are shrunk (``--set``); model, σ, clipping, augmentation, EMA,
preprocessing and accountant are the config's own.
"""

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from dpvision.config import resolve
from dpvision.pipeline import run_training

# The DP-SGD configs (seeds 003 and 004); DP-RandP's (seed 002) are in test_configs_seed002.py.
CONFIGS = sorted(
    path
    for path in (Path(__file__).parent.parent / "configs").rglob("*.toml")
    if path.parent.name != "seed002"
)
# The default run trains one config of each WRN depth; the other ε columns differ from them
# only in σ, steps and learning rate, and run under ``-m slow``.
_FAST_WRN = {"cifar10_wrn16_4_eps1", "cifar10_wrn40_4_eps8"}
RUNS = [
    pytest.param(path, id=path.stem, marks=[pytest.mark.slow])
    if "wrn" in path.stem and path.stem not in _FAST_WRN
    else pytest.param(path, id=path.stem)
    for path in CONFIGS
]
N_TRAIN, N_TEST = 40, 10


def _idx(path: Path, array: np.ndarray, magic: int) -> None:
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes(), mtime=0))


def _write_data(root: Path) -> None:
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        n = N_TRAIN // 5 if name != "test_batch" else N_TEST
        batch = {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, n)],
        }
        (folder / name).write_bytes(pickle.dumps(batch))
    for split, n in (("train", N_TRAIN), ("t10k", N_TEST)):
        _idx(root / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)), 0x803)
        _idx(root / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10, 0x801)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("configs-data")
    _write_data(root)
    return root


def test_there_is_a_config_per_published_row() -> None:
    names = {path.stem for path in CONFIGS}
    for model in ("wrn16_4", "wrn40_4"):
        for epsilon in (1, 2, 3, 4, 6, 8):
            assert f"cifar10_{model}_eps{epsilon}" in names
    for dataset in ("mnist", "fashion_mnist", "cifar10"):
        assert {f"{dataset}_cnn", f"{dataset}_scatternet_cnn"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads(path: Path) -> None:
    config = resolve(path)
    assert config.method == "dp-sgd"
    assert config.noise_multiplier is not None
    assert config.noise_multiplier > 0


@pytest.mark.parametrize("path", RUNS)
def test_config_loads_and_runs_a_few_steps(
    path: Path, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))
    published = resolve(path)
    assert published.method == "dp-sgd"
    augmult = min(int(published.learner.get("augmult", 0)), 2)
    config = resolve(
        path,
        {"data_dir": str(data_dir)},
        [
            "learner.steps=2",
            "learner.batch_size=8",
            "learner.physical_batch_size=4",
            f"learner.augmult={augmult}",
            "learner.eval_batch_size=16",
        ],
    )
    result = run_training(config, quiet=True)
    assert result["steps"] == 2
    assert result["model"] == published.learner["model"]
    entries = result["privacy_ledger"]
    assert entries[-1]["noise_multiplier"] == published.noise_multiplier
    assert entries[-1]["count"] == 2
    assert 0 < result["epsilon"] < float("inf")
