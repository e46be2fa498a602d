"""DP-RandP's CIFAR-10 configs (seed 002, Tables 13 and 22) load, meet their ε, and run a few
steps on small CIFAR-10 python-pickle files written here.

Only the run length, the batch and Phase I's length are shrunk (``--set``); the model, σ, the
phase split, learning rates, clipping, augmentation and EMA are the config's own.
"""

import pickle
from pathlib import Path

import numpy as np
import pytest

from dpvision.accounting import PrivacyLedger
from dpvision.config import resolve
from dpvision.pipeline import run_training
from dpvision.training.pretrain import PretrainOptions, pretrain

FOLDER = Path(__file__).parent.parent / "configs" / "seed002"
TABLE_13 = {1: 875, 2: 1125, 3: 1593, 4: 1687, 6: 1843, 8: 2468}
TABLE_22 = (0.1, 0.2, 0.5, 1, 2, 3, 4, 6, 8)
N_TRAIN, N_TEST = 40, 10


def _name(epsilon: float) -> str:
    return f"{epsilon:g}".replace(".", "p")


FULL = [FOLDER / f"cifar10_wrn16_4_eps{e}.toml" for e in TABLE_13]
PROBES = [FOLDER / f"cifar10_linear_probe_eps{_name(e)}.toml" for e in TABLE_22]


def test_there_is_a_config_per_published_row() -> None:
    assert all(path.exists() for path in [*FULL, *PROBES])
    assert (FOLDER / "cifar10_pretrain_wrn16_4.toml").exists()


@pytest.mark.parametrize("epsilon", list(TABLE_13))
def test_table_13_configs_meet_their_epsilon(epsilon: int) -> None:
    config = resolve(FOLDER / f"cifar10_wrn16_4_eps{epsilon}.toml")
    assert config.method == "dp-randp"
    learner = config.learner
    assert learner["steps"] == TABLE_13[epsilon]
    assert learner["phase2_steps"] == 96
    assert learner["batch_size"] == 4096
    assert learner["augmult"] == 16
    ledger = PrivacyLedger()
    assert config.noise_multiplier is not None
    ledger.record(
        noise_multiplier=config.noise_multiplier,
        sample_rate=4096 / 50_000,
        count=learner["steps"],
        released="DP-SGD clipped gradient sum",
    )
    assert ledger.epsilon(1e-5, config.accountant) <= epsilon


@pytest.mark.parametrize("epsilon", TABLE_22)
def test_table_22_configs_meet_their_epsilon(epsilon: float) -> None:
    config = resolve(FOLDER / f"cifar10_linear_probe_eps{_name(epsilon)}.toml")
    assert config.method == "dp-sgd-linear"
    assert config.features.startswith("encoder:")
    ledger = PrivacyLedger()
    assert config.noise_multiplier is not None
    ledger.record(noise_multiplier=config.noise_multiplier, count=100, released="gradient")
    assert ledger.epsilon(1e-5, config.accountant) <= epsilon


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cifar")
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        n = N_TRAIN // 5 if name != "test_batch" else N_TEST
        batch = {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, n)],
        }
        (folder / name).write_bytes(pickle.dumps(batch))
    return root


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WRN-16-4 encoder from two steps of the configs' own Phase I options."""
    from dpvision.config import load_toml

    table = load_toml(FOLDER / "cifar10_pretrain_wrn16_4.toml")["pretrain"]
    options = PretrainOptions.from_dict(
        {**table, "steps": 2, "num_images": 16, "batch_size": 8, "projection_hidden": 64}
    )
    path = tmp_path_factory.mktemp("encoder") / "enc.pt"
    pretrain(options, path, quiet=True)
    return path


SMALL = [
    "learner.steps=3",
    "learner.phase2_steps=1",
    "learner.batch_size=8",
    "learner.physical_batch_size=4",
    "learner.augmult=2",
    "learner.eval_batch_size=16",
]


def test_table_13_config_runs_all_three_phases(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))
    path = FOLDER / "cifar10_wrn16_4_eps1.toml"
    sets = [
        *SMALL,
        "pretrain.steps=2",
        "pretrain.num_images=16",
        "pretrain.batch_size=8",
        "pretrain.projection_hidden=64",
    ]
    result = run_training(resolve(path, {"data_dir": str(data_dir)}, sets), quiet=True)
    assert result["method"] == "dp-randp"
    assert result["model"] == "wrn-16-4"
    assert result["pretrain"]["trained_on"] == "synthetic:oriented-filters"
    assert (result["phase2_steps"], result["phase3_steps"]) == (1, 2)
    (entry,) = result["privacy_ledger"]
    assert entry["noise_multiplier"] == 9.3
    assert entry["count"] == 3
    assert 0 < result["epsilon"] < float("inf")


@pytest.mark.parametrize("path", FULL[1:], ids=[p.stem for p in FULL[1:]])
@pytest.mark.slow
def test_other_table_13_configs_run_from_an_encoder(
    path: Path, data_dir: Path, encoder: Path
) -> None:
    sets = [*SMALL, f"learner.encoder='{encoder}'"]
    result = run_training(resolve(path, {"data_dir": str(data_dir)}, sets), quiet=True)
    assert result["privacy_ledger"][0]["count"] == 3
    assert result["pretrain"] is None  # Phase I skipped: the encoder was given


@pytest.mark.parametrize("epsilon", [1, 8])
def test_table_22_config_probes_an_encoder(
    epsilon: float, data_dir: Path, encoder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))
    path = FOLDER / f"cifar10_linear_probe_eps{_name(epsilon)}.toml"
    published = resolve(path)
    features = published.features.replace(
        "path=cifar10_wrn16_4_oriented_filters.pt", f"path={encoder}"
    )
    config = resolve(path, {"data_dir": str(data_dir), "features": features}, ["learner.epochs=3"])
    result = run_training(config, quiet=True)
    assert result["method"] == "dp-sgd-linear"
    assert result["num_features"] == 3904
    assert result["privacy_ledger"][0]["noise_multiplier"] == published.noise_multiplier
    assert 0 < result["epsilon"] <= epsilon
