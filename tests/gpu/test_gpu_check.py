"""``scripts/gpu-check``, run here without CUDA: it still writes its one report, quickly
(the ``gpu`` tests skipped, a speed table of the CPU smoke run), so the script does not rot
between the rare runs on a GPU machine. Its default CPU table (``--only gpu --quick``) is
tested in ``tests/benchmarks``; here one small row keeps the test short."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


SPEED = "--quick --only vit --device cpu --no-isolation --steps 1 --rows dpvision-vmap"


def _gpu_check(tmp_path: Path, *options: str) -> str:
    """The report of ``scripts/gpu-check OPTIONS REPORT`` without CUDA, one small speed row."""
    report = tmp_path / "out" / "gpu-check.md"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    env["GPU_CHECK_SPEED_ARGS"] = SPEED
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check"), *options, str(report)],
        cwd=tmp_path,  # from anywhere: the script finds the repository itself
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return report.read_text()


def test_gpu_check_writes_its_report_without_cuda(tmp_path):
    text = _gpu_check(tmp_path, "--budget", "120")
    speed = SPEED
    for heading in ("# dpvision GPU check", "## Device", "## pytest -m gpu tests/gpu"):
        assert heading in text
    assert "no CUDA device" in text
    assert "TF32 as a fresh process finds it: `torch.backends.cuda.matmul.allow_tf32`" in text
    assert "skipped, " in text
    assert "(exit code 0," in text
    assert f"`python benchmarks/dpsgd_speed.py {speed}`: exit code 0" in text
    assert "| dpvision, torch.func vmap | " in text  # the table itself


def test_gpu_check_speed_only_skips_the_tests(tmp_path):
    text = _gpu_check(tmp_path, "--speed-only")
    assert "## Device" in text
    assert "## pytest -m gpu tests/gpu" not in text
    assert f"`python benchmarks/dpsgd_speed.py {SPEED}`: exit code 0" in text
