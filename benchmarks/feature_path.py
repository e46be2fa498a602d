"""The feature path on CIFAR-10's scale: a DP-SGD-linear step against its matrix products,
and the peak memory of the default CIFAR-10 run, before and after, each in one run.

``--part step`` (default): one process, synthetic float32 features of ScatterNet's CIFAR-10
size (N × 15 552, 10 classes), one Poisson-sized batch of B rows, each timing the median of
``--repeats``, interleaved:

* ``GEMM, float32``: the step's two products (scores XWᵀ and the weighted sum EᵀX) in
  float32 on the batch already gathered: the floor the issue measures against;
* ``GEMM, float64``: the same two products in float64, the precision the step takes them
  in (float32 scores would move the release by more than C: see
  :meth:`DPSGDLinear._clipped_sum`), on the batch already gathered;
* ``step before``: the step as of the release before this page (commit ef6facf): the batch
  gathered as a float64 copy, scores and sums in float64;
* ``step after``: :meth:`DPSGDLinear._clipped_sum`, as ``dpvision train`` runs it.

``--part memory``: ``dpvision train --dataset cifar10-jpeg --epsilon 3`` (the default recipe)
run twice as child processes, once on the source of ``--before`` (a temporary git worktree)
and once on this tree's, after warming the feature cache; each child's peak resident memory
(``ru_maxrss`` from ``wait4``), wall time and test accuracy, against the feature matrix
(N × 15 552 float32).

Run:  python benchmarks/feature_path.py --part step          (about 2 min on 2 cores)
      DPVISION_DATA=... python benchmarks/feature_path.py --part memory   (about 15 min)
Results: benchmarks/results/feature_path_{step,memory}.{json,md}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from provenance import commit

from dpvision.fileio import write_json_atomic
from dpvision.learners import DPSGDLinear
from dpvision.learners.dp_sgd_linear import _Head, clipped_gradient_sum, loss_gradient
from dpvision.learners.statistics import read_rows
from dpvision.learners.step_blocks import StepBlocks, row_sq_norms
from dpvision.mechanisms.clip_policy import make_clip_policy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCATTERNET_CIFAR10 = 243 * 8 * 8
CLIP = 0.1
BEFORE = "ef6facf"


def _median_seconds(function: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return times


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def step_before(
    features: np.ndarray, labels: np.ndarray, batch: np.ndarray, head: Any, sq: torch.Tensor
) -> torch.Tensor:
    """The step of commit ef6facf: a float64 copy of the batch, float64 products."""
    weight, bias = head.weight.detach(), head.bias.detach()
    x = read_rows(features, batch)
    y = torch.from_numpy(np.asarray(labels[batch], dtype=np.int64))
    errors = loss_gradient(torch.addmm(bias, x, weight.T), y, "softmax")
    grad_w, grad_b, _ = clipped_gradient_sum(
        x, errors, CLIP, fit_intercept=True, sq_norms=sq[torch.from_numpy(batch)]
    )
    return torch.cat([grad_w.reshape(-1), grad_b])


def run_step(args: argparse.Namespace) -> dict[str, Any]:
    n, d, m, batch_size = args.rows, args.dim, 10, args.batch
    rng = np.random.default_rng(0)
    features = (rng.standard_normal((n, d), dtype=np.float32) / np.sqrt(d)).astype(np.float32)
    labels = rng.integers(0, m, n)
    batch = np.sort(rng.choice(n, batch_size, replace=False))
    head = _Head(m, d, 0.0)
    with torch.no_grad():
        head.theta.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    learner = DPSGDLinear(noise_multiplier=1.0, clip_norm=CLIP, num_classes=m)
    policy = make_clip_policy("flat", CLIP, expected_batch_size=float(batch_size))
    sq = row_sq_norms(features)
    blocks = StepBlocks(features, learner.chunk_size, m)

    def after() -> torch.Tensor:
        clipped = learner._clipped_sum(features, labels, batch, head, sq, policy, blocks)
        return clipped.grads["theta"]

    x32 = torch.from_numpy(features[batch])
    x64 = x32.double()
    w32, w64 = head.weight.detach().float(), head.weight.detach()
    e32 = torch.randn(batch_size, m)
    e64 = e32.double()

    def gemm32() -> None:
        x32 @ w32.T
        e32.T @ x32

    def gemm_step() -> None:
        x64 @ w64.T
        e64.T @ x64

    timings: dict[str, list[float]] = {"gemm32": [], "gemm_step": [], "before": [], "after": []}
    cases = {
        "gemm32": gemm32,
        "gemm_step": gemm_step,
        "before": lambda: step_before(features, labels, batch, head, sq),
        "after": after,
    }
    for case in cases.values():  # warm
        case()
    for _ in range(args.repeats):
        for name, case in cases.items():
            timings[name] += _median_seconds(case, 1)
    old, new = step_before(features, labels, batch, head, sq), after()
    difference = float((old - new).norm() / old.norm())
    seconds = {name: statistics.median(values) for name, values in timings.items()}
    return {
        "machine": _machine(),
        "torch": torch.__version__,
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "rows": n,
        "dim": d,
        "classes": m,
        "batch": batch_size,
        "repeats": args.repeats,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "all_seconds": {k: [round(t, 4) for t in v] for k, v in timings.items()},
        "after_over_gemm32": round(seconds["after"] / seconds["gemm32"], 2),
        "after_over_gemm_step": round(seconds["after"] / seconds["gemm_step"], 2),
        "before_over_after": round(seconds["before"] / seconds["after"], 2),
        "relative_difference": difference,
    }


def step_page(report: dict[str, Any]) -> str:
    s = report["seconds"]
    rows = [
        ("GEMM, float32 (the floor)", s["gemm32"]),
        ("GEMM, float64 (the precision of the step's products)", s["gemm_step"]),
        (f"step before (commit {BEFORE}: float64 copy of the batch)", s["before"]),
        ("step after (`DPSGDLinear._clipped_sum`)", s["after"]),
    ]
    return "\n".join(
        [
            "# DP-SGD-linear: a step against its matrix products",
            "",
            f"Made by `benchmarks/feature_path.py --part step` on {report['machine']} (torch "
            f"{report['torch']}, commit {report['commit']}, {report['date']}): synthetic "
            f"float32 features, {report['rows']} × {report['dim']} (ScatterNet's CIFAR-10 "
            f"size), {report['classes']} classes, a batch of {report['batch']} rows; medians "
            f"of {report['repeats']} interleaved repeats, one process.",
            "",
            "| what | seconds |",
            "|---|---|",
            *(f"| {what} | {seconds:.3f} |" for what, seconds in rows),
            "",
            f"- The step is **{report['after_over_gemm32']:.2f}×** the float32 GEMMs and "
            f"**{report['after_over_gemm_step']:.2f}×** the same products in float64, the "
            "precision it takes them in; "
            f"**{report['before_over_after']:.2f}×** faster than before.",
            "- Why not float32: a float32 GEMM rounds a row's scores differently by its place "
            "in the batch, and where softmax is within rounding of 1 that turns the direction "
            "of the row's clipped gradient: a privacy review moved the release by 6.2 C with "
            "float32 scores (and by 48 C with MKL's edge kernel in float64 at m ≥ 12). The "
            "step scores fixed-shape float64 blocks instead, checked once a fit to give a row "
            "the same bits in every slot (`dpvision.learners.step_blocks`).",
            f"- Before and after agree to {report['relative_difference']:.1e} (relative).",
        ]
    )


def _child_peak(command: list[str], env: dict[str, str]) -> tuple[int, float, int]:
    """(peak resident bytes, wall seconds, exit code) of one child process."""
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=ROOT)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * 1024, time.perf_counter() - started, process.returncode


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    from dpvision.data import load_dataset
    from dpvision.features import FeatureSpec, load_or_extract

    dataset = load_dataset(args.dataset, download=False)
    train, _ = load_or_extract(dataset, FeatureSpec("scatternet"), progress=False)  # warm
    matrix_bytes = int(train.nbytes)
    del train
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        old = Path(scratch) / "before"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(old), args.before],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            for label, source in (("before", old / "src"), ("after", ROOT / "src")):
                out = Path(scratch) / f"{label}.json"
                env = {**os.environ, "PYTHONPATH": str(source)}
                command = [sys.executable, "-m", "dpvision", "train", "--dataset", args.dataset]
                command += ["--epsilon", "3", "--seed", "0", "--json", str(out), "--quiet"]
                peak, wall, code = _child_peak(command, env)
                result = json.loads(out.read_text()) if code == 0 else {}
                runs.append(
                    {
                        "what": label,
                        "source": args.before if label == "before" else commit(),
                        "exit_code": code,
                        "peak_bytes": peak,
                        "peak_over_matrix": round(peak / matrix_bytes, 2),
                        "wall_seconds": round(wall, 1),
                        "test_accuracy": result.get("test_accuracy"),
                    }
                )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)
    return {
        "machine": _machine(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "dataset": args.dataset,
        "command": "dpvision train --dataset cifar10-jpeg --epsilon 3 --seed 0",
        "matrix_bytes": matrix_bytes,
        "runs": runs,
    }


def memory_page(report: dict[str, Any]) -> str:
    gib = 2.0**30
    return "\n".join(
        [
            "# The default CIFAR-10 run's peak memory, before and after",
            "",
            f"Made by `benchmarks/feature_path.py --part memory` on {report['machine']} "
            f"(torch {report['torch']}, {report['date']}): `{report['command']}` run as two "
            "child processes, the feature cache warm; peak resident memory is each child's "
            f"`ru_maxrss`. The feature matrix (train, float32): "
            f"{report['matrix_bytes'] / gib:.2f} GiB; the target is at most 1.5× it.",
            "",
            "| run | source | peak GiB | × the matrix | wall s | test accuracy |",
            "|---|---|---|---|---|---|",
            *(
                f"| {r['what']} | {r['source']} | {r['peak_bytes'] / gib:.2f} | "
                f"{r['peak_over_matrix']:.2f} | {r['wall_seconds']:.0f} | "
                + (f"{100 * r['test_accuracy']:.2f} % |" if r["test_accuracy"] else "failed |")
                for r in report["runs"]
            ),
            "",
            *(
                [
                    f"- Each side runs the default recipe of its own source: after commit "
                    f"{BEFORE}, colour images of 5 000 examples or more take PrivDataNorm and "
                    "60 epochs at ε = 3 (367 steps, against group-norm's 293), hence the "
                    "accuracies."
                ]
                if report["runs"][0]["source"] == BEFORE
                else []
            ),
            "- Wall times are whole runs on the machine as it was; they compare only when "
            "nothing else ran beside them (the step's own speed: "
            "[feature_path_step.md](feature_path_step.md)).",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("step", "memory"), default="step")
    parser.add_argument("--rows", type=int, default=50000, help="N for --part step")
    parser.add_argument("--dim", type=int, default=SCATTERNET_CIFAR10, help="d for --part step")
    parser.add_argument("--batch", type=int, default=8192, help="B for --part step")
    parser.add_argument("--repeats", type=int, default=7, help="timings per case")
    parser.add_argument("--dataset", default="cifar10-jpeg", help="for --part memory")
    parser.add_argument("--before", default=BEFORE, help="the commit --part memory compares")
    args = parser.parse_args()
    if not 1 <= args.batch <= args.rows or args.dim < 1 or args.repeats < 1:
        print(
            "feature_path.py: need 1 <= --batch <= --rows, --dim >= 1, --repeats >= 1",
            file=sys.stderr,
        )
        return 2
    report = run_step(args) if args.part == "step" else run_memory(args)
    page = step_page(report) if args.part == "step" else memory_page(report)
    RESULTS.mkdir(exist_ok=True)
    write_json_atomic(RESULTS / f"feature_path_{args.part}.json", report)
    (RESULTS / f"feature_path_{args.part}.md").write_text(page + "\n")
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
