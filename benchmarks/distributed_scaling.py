"""Scale-out benchmark: throughput with 1 and 2 torchrun processes, and the scaling ratio.

The question (issue 7): what does running the same job as 2 ``torchrun`` processes (gloo)
buy over 1 process, and does it still compute the same thing? Each workload runs three
ways, one after the other, on the same machine in the same invocation:

* ``1 proc × 1 thread``: ``torchrun --nproc_per_node 1`` with one torch thread: the
  baseline of the scaling ratio;
* ``2 procs × 1 thread``: ``torchrun --nproc_per_node 2``, one thread each (torchrun's
  default): the scale-out;
* ``1 proc × 2 threads``: the other way to use the same cores, for reference.

Scaling ratio = throughput(2 procs) / throughput(1 proc × 1 thread); 2.0 is perfect.

Workloads:

* ``dp-sgd cnn``: ``dpvision train`` on Fashion-MNIST, seed 004's recipe (Tanh CNN,
  B = 2048, σ = 1.809, C = 0.1, lr 4, momentum 0.9, EMA), ``--steps`` logical steps;
  throughput = steps · B / the time of the training loop (``train_seconds`` of the result,
  which excludes loading the data and the final evaluation).
* ``dp-sgd cnn K=4``: the same with augmentation multiplicity K = 4 (4 views per example).
* ``dp-ls``: ``DPLeastSquares(noise_multiplier=5, clip_norm=1).fit`` on synthetic
  memory-mapped float32 features (``--ls-n`` × ``--ls-d``, ``--ls-classes`` classes),
  examples per second of the fit.

For each workload the report also says whether the 2-process run released the same thing
as the 1-process run: the ledgers are compared, and the largest parameter difference is
given (DP-LS coefficients; DP-SGD test accuracy).

Run (about 6 minutes here; needs Fashion-MNIST, found through DPVISION_DATA or --data-dir):
    python benchmarks/distributed_scaling.py
Smoke test:
    python benchmarks/distributed_scaling.py --steps 2 --ls-n 4000 --ls-d 32 --ls-classes 10 \
        --out /tmp/scaling-smoke
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

RECIPE = {  # seed 004's Fashion-MNIST Tanh CNN recipe (configs/seed004), short
    "model": "tanh-cnn",
    "batch_size": 2048,
    "physical_batch_size": 512,
    "learning_rate": 4.0,
    "momentum": 0.9,
    "max_grad_norm": 0.1,
    "ema_decay": 0.9999,
    "eval_every": 0,
}
LAYOUTS = (  # (label, processes, threads per process)
    ("1 proc × 1 thread", 1, 1),
    ("2 procs × 1 thread", 2, 1),
    ("1 proc × 2 threads", 1, 2),
)


def log(message: str) -> None:
    print(f"[scaling] {message}", file=sys.stderr, flush=True)


def torchrun(processes: int, threads: int, args: list[str]) -> float:
    """Runs ``args`` under torchrun; returns the wall seconds of the whole launch."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    from dpvision.distributed import torchrun_command

    command = torchrun_command(processes, *args)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"failed: {shlex.join(command)}\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def dpsgd_run(
    args: argparse.Namespace, augmult: int, processes: int, threads: int, out: Path
) -> dict[str, Any]:
    learner = {**RECIPE, "steps": args.steps, "augmult": augmult}
    if augmult:
        learner.update({"crop_padding": 2, "physical_batch_size": 128})
    command = ["-m", "dpvision", "train", "--dataset", "fashion-mnist", "--method", "dp-sgd"]
    command += ["--noise-multiplier", "1.809", "--quiet", "--json", str(out)]
    if args.data_dir:
        command += ["--data-dir", args.data_dir]
    for key, value in learner.items():
        command += ["--set", f"learner.{key}={json.dumps(value)}"]
    launch = torchrun(processes, threads, command)
    result = json.loads(out.read_text())
    examples = args.steps * RECIPE["batch_size"]
    return {
        "seconds": result["train_seconds"],
        "launch_seconds": launch,
        "examples_per_second": examples / result["train_seconds"],
        "world_size": result["world_size"],
        "ledger": result["privacy_ledger"],
        "test_accuracy": result["test_accuracy"],
    }


# --- DP-LS -------------------------------------------------------------------------------


def make_features(folder: Path, n: int, d: int, classes: int) -> tuple[Path, Path]:
    """Learnable synthetic features (class means + noise, rows of norm ≈ 1), written once."""
    x_path, y_path = folder / f"x-{n}-{d}-{classes}.npy", folder / f"y-{n}-{classes}.npy"
    if x_path.exists() and y_path.exists():
        return x_path, y_path
    rng = np.random.default_rng(0)
    means = rng.normal(size=(classes, d)).astype(np.float32)
    labels = rng.integers(0, classes, n)
    out = np.lib.format.open_memmap(x_path, mode="w+", dtype=np.float32, shape=(n, d))
    for start in range(0, n, 65536):
        y = labels[start : start + 65536]
        x = means[y] + rng.normal(size=(len(y), d)).astype(np.float32)
        out[start : start + len(y)] = x / np.linalg.norm(x, axis=1, keepdims=True)
    out.flush()
    del out
    np.save(y_path, labels)
    return x_path, y_path


def dp_ls_worker(x_path: str, y_path: str, out: str) -> None:
    """Run by every rank under torchrun: times one DP-LS fit; rank 0 writes the result."""
    import torch

    from dpvision.distributed import init_from_env, shutdown
    from dpvision.learners import DPLeastSquares

    workers = init_from_env()
    features = np.load(x_path, mmap_mode="r")
    labels = np.load(y_path)
    classes = int(Path(y_path).stem.split("-")[-1])  # make_features names it y-N-CLASSES
    learner = DPLeastSquares(
        noise_multiplier=5.0, clip_norm=1.0, random_state=0, num_classes=classes
    )
    start = time.perf_counter()
    learner.fit(features, labels)
    seconds = time.perf_counter() - start
    if workers.is_main:
        np.save(Path(out).with_suffix(".coef.npy"), learner.coef_)
        payload = {
            "seconds": seconds,
            "world_size": workers.world_size,
            "threads": torch.get_num_threads(),
            "ledger": learner.privacy_ledger_.to_dict()["entries"],
        }
        Path(out).write_text(json.dumps(payload))
    shutdown()


def dp_ls_run(
    x_path: Path, y_path: Path, n: int, processes: int, threads: int, out: Path
) -> dict[str, Any]:
    launch = torchrun(
        processes, threads, [__file__, "--dp-ls-worker", str(x_path), str(y_path), str(out)]
    )
    result = json.loads(out.read_text())
    coef = np.load(out.with_suffix(".coef.npy"))
    return {
        "seconds": result["seconds"],
        "launch_seconds": launch,
        "examples_per_second": n / result["seconds"],
        "world_size": result["world_size"],
        "ledger": result["ledger"],
        "coef": coef,
    }


# --- report ------------------------------------------------------------------------------


def summarize(name: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    base = runs[LAYOUTS[0][0]]
    rows = []
    for label, processes, threads in LAYOUTS:
        run = runs[label]
        row = {
            "layout": label,
            "processes": processes,
            "threads": threads,
            "seconds": run["seconds"],
            "launch_seconds": run["launch_seconds"],
            "examples_per_second": run["examples_per_second"],
            "speedup": run["examples_per_second"] / base["examples_per_second"],
            "same_ledger": run["ledger"] == base["ledger"],
        }
        if "coef" in run:
            row["max_coef_difference"] = float(np.abs(run["coef"] - base["coef"]).max())
        else:
            row["test_accuracy"] = run["test_accuracy"]
        rows.append(row)
    return {"workload": name, "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    p, m = report["parameters"], report["machine"]
    lines = [
        "# Scale-out: 1 and 2 torchrun processes (gloo)",
        "",
        f"Generated by `benchmarks/distributed_scaling.py` on {report['date']}. "
        f"Machine: {m['cpus']} CPUs, {m['platform']}, torch {m['torch']}. "
        f"Load average at start {m['load_start']}, at end {m['load_end']}.",
        "",
        f"DP-SGD: Fashion-MNIST, seed 004's Tanh CNN recipe (B = {RECIPE['batch_size']}, "
        f"σ = 1.809, C = 0.1), {p['steps']} logical steps; time = the training loop only "
        f"(`train_seconds`). DP-LS: {p['ls_n']:,} × {p['ls_d']} float32 memory-mapped "
        f"features, {p['ls_classes']} classes, σ = 5.",
        "",
        "**Scaling ratio** = throughput with 2 processes / throughput with 1 process × 1 "
        "thread (2.0 would be perfect).",
        "",
        "| workload | layout | seconds | examples/s | vs 1 proc × 1 thread | same ledger | "
        "same result |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for item in report["workloads"]:
        for row in item["rows"]:
            if "max_coef_difference" in row:
                same = f"max |Δcoef| = {row['max_coef_difference']:.1e}"
            else:
                same = f"test accuracy {row['test_accuracy']:.4f}"
            lines.append(
                f"| {item['workload']} | {row['layout']} | {row['seconds']:.2f} | "
                f"{row['examples_per_second']:,.0f} | **{row['speedup']:.2f}×** | "
                f"{'yes' if row['same_ledger'] else 'NO'} | {same} |"
            )
    lines += [
        "",
        "Each process loads the data itself; launch seconds (torchrun start, imports, data "
        "loading, evaluation) are in the JSON and not in the throughput. One run per cell, "
        "measured one after the other.",
        "",
        "Command:",
        "",
        f"    {report['command']}",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="DP-SGD logical steps")
    parser.add_argument("--ls-n", type=int, default=1_000_000)
    parser.add_argument("--ls-d", type=int, default=256)
    parser.add_argument("--ls-classes", type=int, default=100)
    parser.add_argument("--data-dir", default=None, help="where Fashion-MNIST is")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "dpv-scaling"))
    parser.add_argument("--out", default=str(RESULTS / "distributed_scaling"))
    parser.add_argument("--skip-dpsgd", action="store_true")
    parser.add_argument("--dp-ls-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dp_ls_worker:
        dp_ls_worker(*args.dp_ls_worker)
        return
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    load_start = [round(v, 2) for v in os.getloadavg()]
    workloads = []
    if not args.skip_dpsgd:
        for name, augmult in (("dp-sgd cnn", 0), ("dp-sgd cnn K=4", 4)):
            runs = {}
            for label, processes, threads in LAYOUTS:
                log(f"{name}: {label}")
                runs[label] = dpsgd_run(
                    args, augmult, processes, threads, work / f"dpsgd-{augmult}-{processes}.json"
                )
            workloads.append(summarize(name, runs))
    x_path, y_path = make_features(work, args.ls_n, args.ls_d, args.ls_classes)
    runs = {}
    for label, processes, threads in LAYOUTS:
        log(f"dp-ls: {label}")
        runs[label] = dp_ls_run(
            x_path, y_path, args.ls_n, processes, threads, work / f"ls-{processes}-{threads}.json"
        )
    workloads.append(summarize("dp-ls", runs))
    import torch

    report = {
        "date": started,
        "parameters": {
            "steps": args.steps,
            "ls_n": args.ls_n,
            "ls_d": args.ls_d,
            "ls_classes": args.ls_classes,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_start": load_start,
            "load_end": [round(v, 2) for v in os.getloadavg()],
        },
        "command": shlex.join([sys.executable.split("/")[-1], *sys.argv]),
        "workloads": workloads,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
