"""Seed 003's fine-tuning configs (Tables 5, 6, 10 and 11) and the public pre-training runs
they start from: one per published cell, each within its published ε, each running two
steps on small stand-in files and a random-weight checkpoint of its architecture.

Only the run length, batch and augmentation multiplicity are shrunk (``--set``); the model,
σ, what is fine-tuned, EMA and the accountant are the config's own. Table 6's NFNet-F3
needs timm: its configs run in the models environment of CI (marked ``models``).
"""

import importlib.util
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dpvision.accounting import PrivacyLedger
from dpvision.config import resolve
from dpvision.errors import DPVisionError
from dpvision.models.registry import build_network
from dpvision.runs.train import run_training

ROOT = Path(__file__).parent.parent / "configs" / "seed003"
FOLDER = ROOT / "finetune"
sys.path.insert(0, str(ROOT))
import make_finetune_configs as generator  # noqa: E402

RUNS = sorted(p for p in FOLDER.glob("*_eps*.toml") if "nfnet" not in p.stem)
NFNET = sorted(FOLDER.glob("imagenet_nfnet_f3_*.toml"))
PRETRAIN = sorted(FOLDER.glob("*_pretrain.toml"))
HAS_TIMM = importlib.util.find_spec("timm") is not None
# Three configs cover every model, dataset, checkpoint kind and layer choice (WRN-28-10 all
# layers on CIFAR-10, its classifier on CIFAR-100, WRN-40-4 from CIFAR-100) and train two
# steps under `-m slow` (15–70 s each); the other cells differ from these only in σ, steps,
# learning rate and the checkpoint's name, which the tests of every file below check without
# training (their two steps would run the same code).
_FAST = {
    "cifar10_wrn28_10_imagenet32_all_eps1",
    "cifar100_wrn28_10_imagenet32_head_eps8",
    "cifar10_wrn40_4_cifar100_all_eps0p5",
}


def test_the_committed_files_are_the_generators_output():
    for name, text in generator.configs().items():
        assert (FOLDER / name).read_text() == text, name
    assert {p.name for p in FOLDER.glob("*.toml")} == set(generator.configs())


def test_there_is_a_config_per_published_cell():
    names = {p.stem for p in FOLDER.glob("*.toml")}
    for dataset in ("cifar10", "cifar100"):
        for layers in ("head", "all"):
            for epsilon in (1, 2, 4, 8):
                assert f"{dataset}_wrn28_10_imagenet32_{layers}_eps{epsilon}" in names
    for epsilon in (1, 2, 4, 8):
        assert f"cifar10_wrn40_4_imagenet32_all_eps{epsilon}" in names
    for epsilon in ("0p5", "1", "1p5", "2", "4", "6", "8"):
        assert f"cifar10_wrn40_4_cifar100_all_eps{epsilon}" in names
    for epsilon in ("0p1", "0p5", "1", "2", "4", "8"):
        assert f"imagenet_nfnet_f3_jft4b_head_eps{epsilon}" in names
    assert {p.stem for p in PRETRAIN} == {
        "wrn28_10_imagenet32_pretrain",
        "wrn40_4_imagenet32_pretrain",
        "wrn40_4_cifar100_pretrain",
    }


def _table(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())


@pytest.mark.parametrize("path", RUNS + NFNET, ids=lambda p: p.stem)
def test_each_config_stays_within_its_published_epsilon(path):
    table = _table(path)
    reference = table["reference"]
    n = 1_271_167 if "imagenet" in path.stem and "nfnet" in path.stem else 50_000
    ledger = PrivacyLedger()
    ledger.record(
        noise_multiplier=table["noise_multiplier"],
        sample_rate=table["learner"]["batch_size"] / n,
        count=table["learner"]["steps"],
        released="DP-SGD clipped gradient sum",
    )
    assert ledger.epsilon(table["delta"], table["accountant"]) <= reference["epsilon"]
    assert reference["needs"]
    assert table["learner"]["init"].startswith("checkpoints/")
    assert reference["band"][0] < reference["accuracy"] < reference["band"][1]


def _cifar(root: Path, name: str, classes: int, key: bytes) -> None:
    rng = np.random.default_rng(0)
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    files = (
        [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]
        if classes == 10
        else ["train", "test"]
    )
    for file in files:
        n = 10 if file != "test_batch" and classes == 10 else 20
        batch = {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            key: [int(v) for v in rng.integers(0, classes, n)],
        }
        (folder / file).write_bytes(pickle.dumps(batch))


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finetune-configs")
    _cifar(root, "cifar-10-batches-py", 10, b"labels")
    _cifar(root, "cifar-100-python", 100, b"fine_labels")
    rng = np.random.default_rng(1)
    np.savez(
        root / "imagenet32.npz",
        x_train=rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8),
        y_train=rng.integers(0, 1000, 16),
        x_test=rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8),
        y_test=rng.integers(0, 1000, 4),
    )
    files = {"data": root}
    for stem, model in (("wrn28_10", "wrn-28-10"), ("wrn40_4", "wrn-40-4")):
        # A random-weight checkpoint with ImageNet's 1000 classes: the head is replaced.
        path = root / f"{stem}.pt"
        torch.save(build_network(model, (3, 32, 32), 1000, groups=16).state_dict(), path)
        files[stem] = path
    return files


RUN_PARAMS = [pytest.param(p, id=p.stem) for p in RUNS if p.stem in _FAST]


@pytest.mark.parametrize("path", RUN_PARAMS)
def test_config_runs_two_steps_from_a_random_weight_checkpoint(
    path, stand_ins, tmp_path, monkeypatch
):
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))
    published = resolve(path, sets=[f"learner.init={stand_ins['wrn40_4']}"])
    stem = "wrn28_10" if "wrn28_10" in path.stem else "wrn40_4"
    config = resolve(
        path,
        {"data_dir": str(stand_ins["data"])},
        [
            f"learner.init={stand_ins[stem]}",
            "learner.steps=2",
            "learner.batch_size=8",
            "learner.physical_batch_size=4",
            "learner.augmult=2",
            "learner.eval_batch_size=16",
        ],
    )
    result = run_training(config, quiet=True)
    assert result["steps"] == 2
    assert result["model"] == published.learner["model"]
    assert result["finetune"] == published.learner["finetune"]
    assert result["init"]["head_replaced"] is True  # 1000 classes in the checkpoint
    assert result["privacy_ledger"][-1]["noise_multiplier"] == published.noise_multiplier
    if published.learner["finetune"] == "head":
        assert result["num_trained_parameters"] < result["num_parameters"] / 100


def test_configs_refuse_a_missing_checkpoint_before_any_work():
    with pytest.raises(DPVisionError, match=r"checkpoints/wrn28_10_imagenet32\.pt not found"):
        resolve(RUNS[0])


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, id=p.stem) for p in PRETRAIN if "cifar100" in p.stem],  # as above
)
def test_pretraining_configs_run_two_steps(path, stand_ins, tmp_path, monkeypatch, capsys):
    from dpvision.cli import main

    monkeypatch.chdir(stand_ins["data"].parent)
    data = stand_ins["data"]
    if "imagenet32" in path.stem:
        (data.parent / "data").mkdir(exist_ok=True)
        (data.parent / "data" / "imagenet32.npz").write_bytes(
            (data / "imagenet32.npz").read_bytes()
        )
    sets = ["--set", "steps=2", "--set", "batch_size=4"]
    if "cifar100" in path.stem:
        sets += ["--set", f"data_dir={data}"]
    code = main(["pretrain", "--config", str(path), "--out", str(tmp_path / "enc.pt"), *sets])
    assert code == 0, capsys.readouterr().err
    from dpvision.models.encoder import read_encoder

    info, _ = read_encoder(tmp_path / "enc.pt")
    assert info.metadata["objective"] == "supervised"
    assert info.metadata["steps"] == 2


@pytest.mark.skipif(HAS_TIMM, reason="checks the message shown when timm is missing")
def test_nfnet_configs_say_how_to_install_timm():
    with pytest.raises(DPVisionError, match=r"dpvision\[models\]"):
        resolve(NFNET[0])


@pytest.mark.models
@pytest.mark.skipif(not HAS_TIMM, reason="needs the models extra")
@pytest.mark.parametrize("path", NFNET, ids=lambda p: p.stem)
def test_nfnet_configs_run_two_steps_from_a_random_weight_checkpoint(path, nfnet_files, tmp_path):
    published = resolve(path, sets=[f"learner.init={nfnet_files['weights']}"])
    config = resolve(
        path,
        {"dataset": f"npy:{nfnet_files['data']}"},
        [
            f"learner.init={nfnet_files['weights']}",
            "learner.steps=2",
            "learner.batch_size=4",
            "learner.physical_batch_size=4",
            "learner.eval_batch_size=8",
        ],
    )
    result = run_training(config, quiet=True)
    assert result["steps"] == 2
    assert result["model"] == "timm:dm_nfnet_f3"
    assert result["finetune"] == "head"
    assert result["num_trained_parameters"] == 3072 * 1000 + 1000
    assert result["privacy_ledger"][-1]["noise_multiplier"] == published.noise_multiplier


@pytest.fixture(scope="module")
def nfnet_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("nfnet")
    model = build_network("timm:dm_nfnet_f3", (3, 32, 32), 1000)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, root / "w.safetensors")
    del model
    data = root / "imagenet"
    data.mkdir()
    rng = np.random.default_rng(0)
    np.save(data / "x_train.npy", rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8))
    np.save(data / "y_train.npy", rng.integers(0, 1000, 12))
    np.save(data / "x_test.npy", rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8))
    np.save(data / "y_test.npy", rng.integers(0, 1000, 4))
    return {"weights": root / "w.safetensors", "data": data}
