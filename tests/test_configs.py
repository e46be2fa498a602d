"""Every TOML under ``configs/`` loads and runs a few steps on small files in the real
formats (CIFAR-10 python pickles, MNIST/Fashion-MNIST IDX), written here: the DP-SGD configs
of seeds 003 and 004, and DP-RandP's (seed 002, Tables 13 and 22), which must also meet their
ε.

Only the run length and batch (and Phase I's length) are shrunk (``--set``); model, σ, the
phase split, clipping, augmentation, EMA, preprocessing and accountant are the config's own.
"""

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from dpvision.accounting import PrivacyLedger
from dpvision.config import resolve
from dpvision.runs.train import run_training
from dpvision.training.pretrain import pretrain
from dpvision.training.pretrain_options import PretrainOptions

# Seed 000's configs (precomputed ViT features) have their own tests: test_configs_seed000.py;
# so have seed 003's fine-tuning configs (they need a checkpoint): test_configs_finetune.py.
_IMAGE_CONFIGS = sorted(
    path
    for path in (Path(__file__).parent.parent / "configs").rglob("*.toml")
    if "seed000" not in path.parts and "finetune" not in path.parts
)
_NOT_SEED002 = [path for path in _IMAGE_CONFIGS if path.parent.name != "seed002"]
# The DP-SGD configs (seeds 003 and 004); DP-RandP's (seed 002) are further down.
CONFIGS = [path for path in _NOT_SEED002 if resolve(path).method == "dp-sgd"]
# The feature-learner configs (seed 004's ScatterNet+linear).
FEATURE_CONFIGS = [path for path in _NOT_SEED002 if resolve(path).method != "dp-sgd"]
# One config of each WRN depth runs a few steps (under ``-m slow``: tests/conftest.py); the
# other ε columns differ from them only in σ, steps and learning rate, which test_config_loads
# checks for every file without training (their steps would run the same code).
_FAST_WRN = {"cifar10_wrn16_4_eps1", "cifar10_wrn40_4_eps8"}
RUNS = [
    pytest.param(path, id=path.stem)
    for path in CONFIGS
    if "wrn" not in path.stem or path.stem in _FAST_WRN
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
    linear = {path.stem for path in FEATURE_CONFIGS}
    for dataset in ("mnist", "fashion_mnist", "cifar10"):
        assert f"{dataset}_scatternet_linear" in linear


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


@pytest.mark.parametrize("path", FEATURE_CONFIGS, ids=[p.stem for p in FEATURE_CONFIGS])
def test_feature_learner_config_runs_briefly(
    path: Path, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))
    published = resolve(path)
    config = resolve(
        path, {"data_dir": str(data_dir)}, ["learner.batch_size=8", "learner.epochs=1"]
    )
    result = run_training(config, quiet=True)
    assert result["method"] == published.method
    assert 0 < result["epsilon"] <= published.epsilon


def test_every_published_config_states_its_reference() -> None:
    """Each config says where its number is from, the number (where one was published),
    the band a rerun should land in, and what it needs to run."""
    runs = [path for path in _IMAGE_CONFIGS if "pretrain" not in path.stem]  # Phase I: no result
    assert len(runs) == 36
    with_numbers = 0
    for path in runs:
        reference = resolve(path).reference
        assert reference["source"], path
        assert reference["needs"], path
        if "accuracy" in reference:
            with_numbers += 1
            low, high = reference["band"]
            assert low <= reference["accuracy"] <= high, path
    assert with_numbers == 33  # Table 22's ε = 4, 6, 8 give hyper-parameters, no accuracy


# --- DP-RandP (seed 002) -------------------------------------------------------------------

SEED002 = Path(__file__).parent.parent / "configs" / "seed002"
TABLE_13 = {1: 875, 2: 1125, 3: 1593, 4: 1687, 6: 1843, 8: 2468}
TABLE_22 = (0.1, 0.2, 0.5, 1, 2, 3, 4, 6, 8)


def _name(epsilon: float) -> str:
    return f"{epsilon:g}".replace(".", "p")


FULL = [SEED002 / f"cifar10_wrn16_4_eps{e}.toml" for e in TABLE_13]
PROBES = [SEED002 / f"cifar10_linear_probe_eps{_name(e)}.toml" for e in TABLE_22]


def test_there_is_a_dp_randp_config_per_published_row() -> None:
    assert all(path.exists() for path in [*FULL, *PROBES])
    assert (SEED002 / "cifar10_pretrain_wrn16_4.toml").exists()


@pytest.mark.parametrize("epsilon", list(TABLE_13))
def test_table_13_configs_meet_their_epsilon(epsilon: int) -> None:
    config = resolve(SEED002 / f"cifar10_wrn16_4_eps{epsilon}.toml")
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
    config = resolve(SEED002 / f"cifar10_linear_probe_eps{_name(epsilon)}.toml")
    assert config.method == "dp-sgd-linear"
    assert config.features.startswith("encoder:")
    ledger = PrivacyLedger()
    assert config.noise_multiplier is not None
    ledger.record(noise_multiplier=config.noise_multiplier, count=100, released="gradient")
    assert ledger.epsilon(1e-5, config.accountant) <= epsilon


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WRN-16-4 encoder from two steps of the configs' own Phase I options."""
    from dpvision.config import load_toml

    table = load_toml(SEED002 / "cifar10_pretrain_wrn16_4.toml")["pretrain"]
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
    path = SEED002 / "cifar10_wrn16_4_eps1.toml"
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
    path = SEED002 / f"cifar10_linear_probe_eps{_name(epsilon)}.toml"
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
