"""benchmarks/dpsgd_speed.py: the quick run works, and its rows time the same computation.

The smoke tests run the real command line (``--quick``, tiny models, 2 steps) into a
temporary folder. The agreement test runs one step of every private row in float64 with the
noise off and checks that they make the same update: a benchmark whose rows computed
different things would compare nothing.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from tests.benchmarks.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dpsgd_speed.py"
HAS_OPACUS = importlib.util.find_spec("opacus") is not None


def _run(tmp_path: Path, *options: str) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "dpsgd_speed_quick.json").read_text())
    assert result["quick"] is True
    assert "QUICK SMOKE RUN" in (tmp_path / "dpsgd_speed_quick.md").read_text()
    return result


def test_quick_run_writes_every_row_with_positive_times(tmp_path):
    result = _run(tmp_path, "--only", "cnn", "--no-isolation")
    (setup,) = result["setups"]
    assert setup["name"] == "cnn"
    rows = {r["row"]: r for r in setup["rows"]}
    assert set(rows) == {
        "non-private",
        "dpvision-bookkeeping",
        "dpvision-vmap",
        "opacus-hooks",
        "opacus-ghost",
    }
    for name in ("non-private", "dpvision-vmap"):
        assert rows[name]["status"] == "ok", rows[name]
    assert rows["non-private"]["time_ratio"] == 1.0
    # Book-keeping is "ok" once it exists; until then "not available" with the reason.
    assert rows["dpvision-bookkeeping"]["status"] in {"ok", "not available"}
    for name in ("opacus-hooks", "opacus-ghost"):
        if HAS_OPACUS:
            assert rows[name]["status"] == "ok", rows[name]
        else:
            assert rows[name]["status"] == "not available"
            assert "opacus not installed" in rows[name]["reason"]
    for row in rows.values():
        if row["status"] == "ok":
            assert len(row["seconds"]) == result["parameters"]["steps"] == 2
            assert all(s > 0 for s in row["seconds"])
            assert row["median_s"] > 0
            assert row["peak_memory_mb"] > 0
            assert row["time_ratio"] > 0
    assert (result["machine"]["opacus"] == "not installed") == (not HAS_OPACUS)


def test_isolated_rows_report_their_own_child_peak_memory(tmp_path):
    result = _run(tmp_path, "--only", "cnn", "--rows", "non-private")
    (row,) = result["setups"][0]["rows"]
    assert row["status"] == "ok", row
    assert "child" in row["memory_kind"]
    assert row["peak_memory_mb"] >= row["memory_before_steps_mb"] > 0


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("dpsgd_speed", "dpsgd_speed_under_test")


def _update(bench: ModuleType, setup, row: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = bench.build_model(setup.model).double()
    inputs, targets = bench.make_batch(setup, seed=1, device="cpu", dtype=torch.float64)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    step, _ = bench.make_step(row, setup, model, inputs, targets, lr=1.0, noise_multiplier=0.0)
    step()
    return {k: p.detach() - before[k] for k, p in model.named_parameters()}


# Opacus's hooks warn that no input requires a gradient, which is expected here.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("views", [1, 2])
def test_private_rows_make_the_same_update_with_the_noise_off(bench, views):
    # WRN-10-1 on 8×8 images, B = 6 in micro-batches of 4 and 2 (uneven virtual steps).
    setup = bench.Setup(
        name="tiny",
        description="tiny",
        model="wrn-10-1",
        image_shape=(3, 8, 8),
        batch_size=6,
        views=views,
        physical_batch=4,
        num_examples=600,
    )
    reference = _update(bench, setup, "dpvision-vmap")
    rows = []
    if bench.unavailable("dpvision-bookkeeping", setup) is None:
        rows.append("dpvision-bookkeeping")
    if HAS_OPACUS and views == 1:
        rows += ["opacus-hooks", "opacus-ghost"]
    if not rows:
        pytest.skip("neither book-keeping clipping nor opacus is installed")
    # Opacus divides C by (norm + 1e-6), dpvision by the norm: relative differences ~1e-7.
    for row in rows:
        update = _update(bench, setup, row)
        for name, expected in reference.items():
            torch.testing.assert_close(update[name], expected, rtol=1e-5, atol=1e-9, msg=row)
    # The non-private row differs: nothing is clipped (this test can fail).
    plain = _update(bench, setup, "non-private")
    assert not all(torch.allclose(plain[k], v) for k, v in reference.items())


@pytest.mark.parametrize("family", ["vit", pytest.param("convnext", marks=pytest.mark.slow)])
def test_transformer_era_families_run_and_write_their_own_files(tmp_path, family):
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--only",
            family,
            "--no-isolation",
            "--rows",
            "dpvision-bookkeeping",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / f"dpsgd_speed_{family}_quick.json").read_text())
    rows = {r["row"]: r for r in result["setups"][0]["rows"]}
    assert rows["dpvision-bookkeeping"]["status"] == "ok", rows
    assert rows["dpvision-bookkeeping"]["time_ratio"] > 0


def test_bookkeeping_profile_names_every_phase(tmp_path):
    script = SCRIPT.with_name("bookkeeping_profile.py")
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            *("--model", "tanh-cnn", "--batch", "4", "--repeats", "1", "--threads", "1"),
            *("--views", "2", "--precision", "fp32", "--name", "smoke", "--out", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads((tmp_path / "smoke_fp32.json").read_text())["results"]
    private, plain = result["dpvision"], result["non-private"]
    phases = private["phases"]
    expected = {"forward", "backward", "norms[Conv2d]", "clipped_sum[Conv2d]", "noise"}
    assert expected | {"clip_factors", "optimizer", "norms[Linear]"} <= set(phases)
    assert {"forward", "backward", "optimizer"} <= set(plain["phases"])
    assert sum(phases.values()) == pytest.approx(private["seconds"])  # scaled to the step
    assert result["ratio"] == pytest.approx(private["seconds"] / plain["seconds"])
    assert "| norms[Conv2d] |" in (tmp_path / "smoke_fp32.md").read_text()


def test_the_accelerator_table_command_runs_and_names_its_device(tmp_path):
    """``--only gpu`` (the table of the accelerator issue), here on the CPU in quick mode."""
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--only",
            "gpu",
            "--no-isolation",
            "--rows",
            "dpvision-bookkeeping",
            "--precision",
            "bf16",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    name = "dpsgd_speed_gpu_cpu_bf16_quick"
    result = json.loads((tmp_path / f"{name}.json").read_text())
    names = [s["name"] for s in result["setups"]]
    assert names == ["seed003", "vit", "convnext", "vit-s16", "convnext-t", "resnet50-gn"]
    for setup in result["setups"][3:]:  # timm's rows: measured with the models extra
        (row,) = [r for r in setup["rows"] if r["row"] == "dpvision-bookkeeping"]
        assert row["status"] in ("ok", "not available"), row
    seed003 = {r["row"]: r for r in result["setups"][0]["rows"]}
    ours = seed003["dpvision-bookkeeping"]
    assert ours["status"] == "ok", ours
    assert ours["precision"] == "bf16"
    assert ours["physical_batch"] == 8
    assert ours["projected_full_run_hours"] == pytest.approx(ours["median_s"] * 875 / 3600)
    report = (tmp_path / f"{name}.md").read_text()
    assert "Projected wall time of the full run (875 logical steps" in report
    assert "Targets (dpvision book-keeping): × non-private" in report


def test_auto_micro_batch_halves_until_a_step_fits(bench, monkeypatch):
    """The probe of ``--physical-batch auto``: out-of-memory at 8 and 4 examples, 2 fits."""
    setup = bench.Setup(
        name="tiny",
        description="tiny",
        model="tanh-cnn",
        image_shape=(1, 28, 28),
        batch_size=8,
        views=1,
        physical_batch=bench.AUTO,
        num_examples=600,
    )
    real = bench.make_step
    tried = []

    def limited(row, trial, *args, **kwargs):
        tried.append(trial.physical_batch)
        step, path = real(row, trial, *args, **kwargs)
        if trial.physical_batch > 2:

            def too_big():
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

            return too_big, path
        return step, path

    monkeypatch.setattr(bench, "make_step", limited)
    row = bench.run_row(setup, "non-private", steps=1, warmup=1, device="cpu", threads=None)
    assert tried == [8, 4, 2]
    assert row["physical_batch"] == 2
    assert row["micro_batches"] == 4
    assert len(row["seconds"]) == 1
