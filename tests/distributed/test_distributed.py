"""Scale-out on torch.distributed: ``torchrun --nproc_per_node 2`` (gloo) against one process.

Two processes must give the model and the ledger of one process with the same seed (up to
the order of float additions), and the noise of a logical step must be drawn once: its
variance is checked, and the check is shown to reject noise added per worker.
"""

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from distributed_worker import (
    CLIP_NORM,
    NOISE_MULTIPLIER,
    fit_learners,
    noise_of_steps,
)

from dpvision.cli import main
from dpvision.config import resolve
from dpvision.data.inputs import TrainingData
from dpvision.distributed import Workers, torchrun_command
from dpvision.runs.train import run_training
from dpvision.training.batching import micro_batches
from dpvision.training.options import DPSGDOptions

WORKER = Path(__file__).with_name("distributed_worker.py")


def _torchrun(*args: str, processes: int = 2, timeout: float = 300) -> None:
    command = torchrun_command(processes, *args)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def _ranks(out: Path, case: str, processes: int = 2) -> list[Any]:
    loaded = [torch.load(out / f"{case}-rank{r}.pt", weights_only=False) for r in range(processes)]
    assert all(item["world_size"] == processes for item in loaded)
    return [item["result"] for item in loaded]


# --- the share of each rank ------------------------------------------------------------


def test_one_example_moves_a_two_process_release_by_at_most_its_sensitivity(
    tmp_path: Path,
) -> None:
    """check_sensitivity under torchrun: each rank clips its share, the sums are reduced."""
    _torchrun(str(WORKER), "sensitivity", str(tmp_path))
    per_rank = _ranks(tmp_path, "sensitivity")
    assert per_rank[0] == per_rank[1]  # every rank saw the same releases
    for name, (ratio, refusal) in per_rank[0].items():
        assert refusal is None, name
        assert 0.99 < ratio <= 1 + 1e-6, f"{name}: moved {ratio} x its sensitivity"


def test_shares_partition_the_logical_batch() -> None:
    batch = np.flatnonzero(np.random.default_rng(0).random(1000) < 0.3)
    for world in (1, 2, 3, 7):
        shares = [Workers(rank, world).split(batch) for rank in range(world)]
        assert np.array_equal(np.concatenate(shares), batch)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_views_do_not_depend_on_the_number_of_processes_or_the_physical_batch() -> None:
    """Each example gets the same augmented views whoever clips it."""
    images = torch.randn(50, 1, 8, 8)
    data = TrainingData("toy", images, torch.arange(50) % 3, images[:1], torch.zeros(1), 3, None)  # type: ignore[arg-type]
    indices = np.array([1, 4, 5, 9, 10, 22, 31, 32, 40, 48, 49])

    def views(workers: Workers, physical: int) -> torch.Tensor:
        options = DPSGDOptions.from_dict(
            {"augmult": 3, "crop_padding": 2, "physical_batch_size": physical}
        )
        generator = torch.Generator().manual_seed(5)
        return torch.cat([x for x, _ in micro_batches(data, indices, options, generator, workers)])

    single = views(Workers(), 4)
    assert single.shape == (len(indices), 3, 1, 8, 8)
    assert torch.equal(views(Workers(), 100), single)
    split = torch.cat([views(Workers(rank, 2), 3) for rank in range(2)])
    assert torch.equal(split, single)


# --- the noise is drawn once per logical step --------------------------------------------


def _check_noise_drawn_once(per_rank: list[torch.Tensor]) -> None:
    """Every rank applied the same noise, with variance (σC)², not (σC)²·workers."""
    for other in per_rank[1:]:
        assert torch.equal(other, per_rank[0]), "the ranks applied different noise"
    noise = per_rank[0].double()
    ratio = float(noise.var()) / (NOISE_MULTIPLIER * CLIP_NORM) ** 2
    # 40 steps × 1025 coordinates: the ratio's standard error is about 0.007.
    assert 0.95 < ratio < 1.05, f"noise variance is {ratio:.3f} × (σC)²"


@pytest.fixture(scope="module")
def noise_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("noise")
    _torchrun(str(WORKER), "noise", str(out))
    _torchrun(str(WORKER), "noise-per-worker", str(out))
    return out


def test_two_processes_draw_the_noise_of_a_step_once(noise_runs: Path) -> None:
    per_rank = _ranks(noise_runs, "noise")
    _check_noise_drawn_once(per_rank)
    # The same draws as one process with the same seed.
    assert torch.allclose(per_rank[0], noise_of_steps(40, Workers()), rtol=0, atol=1e-6)


def test_the_noise_check_rejects_noise_added_per_worker(noise_runs: Path) -> None:
    per_rank = _ranks(noise_runs, "noise-per-worker")
    with pytest.raises(AssertionError, match="noise variance is 2"):
        _check_noise_drawn_once(per_rank)


# --- feature learners ------------------------------------------------------------------


def test_feature_learners_on_two_processes_match_one(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 5, 1001)
    features = rng.normal(size=(1001, 12)) * 0.3
    features[np.arange(1001), labels] += 1.0
    np.save(tmp_path / "x.npy", features.astype(np.float32))
    np.save(tmp_path / "y.npy", labels)
    _torchrun(
        str(WORKER), "learners", str(tmp_path), str(tmp_path / "x.npy"), str(tmp_path / "y.npy")
    )
    expected = fit_learners(np.load(tmp_path / "x.npy", mmap_mode="r"), labels)
    per_rank = _ranks(tmp_path, "learners")
    for name, reference in expected.items():
        for rank, result in enumerate(per_rank):
            got = result[name]
            assert got["ledger"] == reference["ledger"], (name, rank)
            assert torch.allclose(got["coef"], reference["coef"], rtol=1e-9, atol=1e-9), (
                name,
                rank,
            )
            assert torch.equal(got["intercept"], reference["intercept"]) or torch.allclose(
                got["intercept"], reference["intercept"], rtol=1e-9, atol=1e-9
            ), (name, rank)


# --- dpvision train under torchrun ------------------------------------------------------


def _write_bars(path: Path) -> Path:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 330)
    images = (rng.random((330, 16, 16, 1)) * 60).astype(np.uint8)
    for c in range(3):  # a bright bar whose row depends on the class
        images[labels == c, 2 + 4 * c : 5 + 4 * c, 2:14, 0] += 180
    np.savez(
        path, x_train=images[:240], y_train=labels[:240], x_test=images[240:], y_test=labels[240:]
    )
    return path


DPSGD_SETS = {
    "batch_size": 40,
    "physical_batch_size": 8,
    "steps": 10,
    "learning_rate": 0.5,
    "augmult": 2,
    "crop_padding": 2,
    "ema_decay": 0.9,
    "model": "mlp-32",
}


SECRET = 4242  # replays the runs compared below (never published)


def _train_args(data: Path, method: str, sets: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    flags = {"dataset": f"npz:{data}", "num_classes": 10, "method": method, "noise_multiplier": 1.0}
    flags["secret_seed"] = SECRET  # one process and torchrun replay the same secret
    return flags, [f"learner.{k}={json.dumps(v)}" for k, v in sets.items()]


def _cli(flags: dict[str, Any], sets: list[str]) -> list[str]:
    args = ["train", "--dataset", flags["dataset"], "--method", flags["method"]]
    args += ["--noise-multiplier", str(flags["noise_multiplier"]), "--quiet"]
    args += ["--set", f"num_classes={flags['num_classes']}"]
    args += ["--secret-seed", str(flags["secret_seed"])]
    for item in sets:
        args += ["--set", item]
    return args


def test_dpsgd_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    data = _write_bars(tmp_path / "bars.npz")
    flags, sets = _train_args(data, "dp-sgd", DPSGD_SETS)
    reference = tmp_path / "one.ckpt"
    expected = run_training(resolve(None, flags, sets), quiet=True, checkpoint=reference)
    out, ckpt = tmp_path / "two.json", tmp_path / "two.ckpt"
    _torchrun("-m", "dpvision", *_cli(flags, sets), "--checkpoint", str(ckpt), "--json", str(out))
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert result["privacy_ledger"] == expected["privacy_ledger"]
    assert result["epsilon"] == expected["epsilon"]
    assert abs(result["test_accuracy"] - expected["test_accuracy"]) <= 1 / 90
    one, two = (torch.load(p, weights_only=False) for p in (reference, ckpt))
    assert one["ledger"] == two["ledger"]
    for name, value in one["model"].items():
        assert torch.allclose(value, two["model"][name], rtol=1e-4, atol=1e-5), name
    for name, value in one["ema"]["shadow"].items():
        assert torch.allclose(value, two["ema"]["shadow"][name], rtol=1e-4, atol=1e-5), name
    assert one["sampler"] == two["sampler"]


def test_dp_ls_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    data = _write_bars(tmp_path / "bars.npz")
    flags, sets = _train_args(data, "dp-ls", {"clip_norm": 1.0})
    flags["features"] = "pixels"
    expected = run_training(resolve(None, flags, sets), quiet=True)
    out = tmp_path / "two.json"
    _torchrun("-m", "dpvision", *_cli(flags, sets), "--json", str(out))
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert result["privacy_ledger"] == expected["privacy_ledger"]
    assert result["test_accuracy"] == expected["test_accuracy"]


def test_other_commands_refuse_to_run_under_torchrun(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (
        main(
            [
                "privacy",
                "epsilon",
                "--noise-multiplier",
                "1",
                "--sample-rate",
                "0.01",
                "--steps",
                "10",
                "--delta",
                "1e-5",
            ]
        )
        == 2
    )
    assert "only `dpvision train` runs under torchrun" in capsys.readouterr().err
