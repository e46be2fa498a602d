"""Public pre-training, then private fine-tuning, on Fashion-MNIST with a public slice.

The split (``public_fraction = 0.1``, :mod:`dpvision.data.public`): 6 000 fixed training
images are declared public, the other 54 000 are private; of these, a seeded validation
split of 10 % (5 400) is held out for choosing the learning rate, so every private run
trains on 48 600 images and reports the test accuracy of the 10 000 test images once, at
the end. δ = 1e-5; σ calibrated by PLD to each target ε; ε read back from each ledger.

Rows, each at ε ∈ {0.5, 1, 3}, median of 3 seeds:

* ``scratch``: end-to-end DP-SGD of the Tanh CNN from random initialisation on the private
  rows (the seed-004 recipe, shortened: B = 2048, momentum 0.9, C = 0.1, EMA 0.9999).
* ``public → all`` / ``head`` / ``bias+head``: the same DP-SGD from the CNN pre-trained
  without privacy on the 6 000 public images (``dpvision pretrain --objective supervised``),
  training all parameters, the classifier only, or the biases and the classifier. (The Tanh
  CNN has no normalisation layers, so ``norms+head`` is ``head`` and is not run.)
* ``randp → all`` / ``head``: the same DP-SGD from the DP-RandP encoder of
  ``dp_randp_fmnist.py`` (the CNN body pre-trained on synthetic dead-leaves images):
  ``--method dp-randp`` with Phase III only (all) or Phase II only (head).
* ``scatternet + linear``: DP-SGD on a linear head over ScatterNet features (the recipe of
  ``feature_learners_fmnist.py``), on the same private rows.
* ``public backbone → DP-LS`` / ``DP-FC``: DP-LS and DP-FC (5 epochs) on the features of
  the publicly pre-trained CNN's body (``--features backbone:model=tanh-cnn,weights=FILE``,
  32 dims), group-normalised per example (every vector then has norm √32, so nothing is
  clipped at C = √32).

Tuning: the learning rate of each DP-SGD row is chosen among two candidates by validation
accuracy at ε = 1, seed 0 (the candidates are in ``RATES``), then used for every ε and
seed; nothing is chosen on the test set. Every run is a ``dpvision train`` process with one
torch thread; ``--workers`` run side by side.

Run:  DPVISION_DATA=../shared/data python benchmarks/finetune_fmnist.py --workers 2
      (re-running skips the runs already stored; --report-only rebuilds the summary)
"""

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
FOLDER = RESULTS / "finetune_fmnist"
PUBLIC_MODEL = FOLDER / "tanh_cnn_public_slice.pt"
RANDP_ENCODER = RESULTS / "dp_randp" / "encoder_tanh_cnn_dead_leaves.pt"
EPSILONS = (0.5, 1.0, 3.0)
SEEDS = (0, 1, 2)
DELTA = 1e-5
PUBLIC = 0.1
VALIDATION = 0.1
EPOCHS = 10

RECIPE = {
    "model": "tanh-cnn",
    "batch_size": 2048,
    "momentum": 0.9,
    "max_grad_norm": 0.1,
    "epochs": EPOCHS,
    "ema_decay": 0.9999,
    "physical_batch_size": 1024,
}
# row → (method, learner options, learning-rate candidates)
ROWS: dict[str, tuple[str, dict[str, Any], tuple[float, ...]]] = {
    "scratch": ("dp-sgd", {}, (2.0, 4.0)),
    "public → all": ("dp-sgd", {"init": str(PUBLIC_MODEL), "finetune": "all"}, (1.0, 4.0)),
    "public → head": ("dp-sgd", {"init": str(PUBLIC_MODEL), "finetune": "head"}, (4.0, 16.0)),
    "public → bias+head": (
        "dp-sgd",
        {"init": str(PUBLIC_MODEL), "finetune": "bias+head"},
        (4.0, 16.0),
    ),
    "randp → all": ("dp-randp", {"encoder": str(RANDP_ENCODER), "phase2_steps": 0}, (2.0, 4.0)),
    "randp → head": (
        "dp-randp",
        {"encoder": str(RANDP_ENCODER), "phase2_fraction": 1.0},
        (4.0, 16.0),
    ),
}
FEATURE_ROWS = ("scatternet + linear", "public backbone → DP-LS", "public backbone → DP-FC")
SCATTER = {  # feature_learners_fmnist.py's DP-SGD schedule for ScatterNet + linear
    0.5: {"batch_size": 4096, "epochs": 10, "learning_rate": 8.0},
    1.0: {"batch_size": 8192, "epochs": 20, "learning_rate": 16.0},
    3.0: {"batch_size": 8192, "epochs": 40, "learning_rate": 16.0},
}


def _slug(text: str) -> str:
    return text.replace(" → ", "-").replace("+", "-").replace(" ", "-")


def _common(epsilon: float, seed: int) -> list[str]:
    return [
        "--dataset",
        "fashion-mnist",
        "--epsilon",
        f"{epsilon:g}",
        "--set",
        f"delta={DELTA}",
        "--set",
        "accountant='pld'",
        "--set",
        f"seed={seed}",
        "--set",
        f"public_fraction={PUBLIC}",
        "--set",
        f"validation_fraction={VALIDATION}",
        "--quiet",
    ]


def _dpsgd_args(row: str, rate: float, epsilon: float, seed: int) -> list[str]:
    method, options, _ = ROWS[row]
    learner = {**RECIPE, **options, "learning_rate": rate}
    sets = [x for k, v in learner.items() for x in ("--set", f"learner.{k}={json.dumps(v)}")]
    return ["--method", method, *_common(epsilon, seed), *sets]


def _feature_args(row: str, epsilon: float, seed: int) -> list[str]:
    if row == "scatternet + linear":
        options = {**SCATTER[epsilon], "clip_norm": 0.1, "optimizer": "momentum", "momentum": 0.9}
        sets = [x for k, v in options.items() for x in ("--set", f"learner.{k}={json.dumps(v)}")]
        return [
            "--method",
            "dp-sgd-linear",
            "--features",
            "scatternet",
            "--set",
            "preprocessing.kind='group-norm'",
            "--set",
            "preprocessing.groups=27",
            *_common(epsilon, seed),
            *sets,
        ]
    method = "dp-ls" if row.endswith("DP-LS") else "dp-fc"
    extra = [] if method == "dp-ls" else ["--set", f"learner.covariance_clip_norm={math.sqrt(32)}"]
    extra += [] if method == "dp-ls" else ["--set", "learner.epochs=5"]
    return [  # on the public backbone's 32-d embeddings, group-normalised: norm √32
        *extra,
        "--method",
        method,
        "--features",
        f"backbone:model=tanh-cnn,weights={PUBLIC_MODEL}",
        "--set",
        "preprocessing.kind='group-norm'",
        "--set",
        "preprocessing.groups=1",
        "--set",
        "preprocessing.channels=32",
        "--set",
        f"learner.clip_norm={math.sqrt(32)}",
        *_common(epsilon, seed),
    ]


def _run(name: str, args: list[str]) -> dict[str, Any]:
    out = FOLDER / f"{name}.json"
    if out.exists():
        return json.loads(out.read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.perf_counter()
    process = subprocess.run(
        [sys.executable, "-m", "dpvision", "train", *args, "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if process.returncode:
        raise SystemExit(f"{name} failed: {process.stderr.strip()[-2000:]}")
    result = json.loads(out.read_text())
    print(
        f"{name}: validation {100 * result.get('validation_accuracy', math.nan):.2f} %, test "
        f"{100 * result['test_accuracy']:.2f} % at ε = {result['epsilon']:.4f} "
        f"({time.perf_counter() - start:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return result


def _pretrain() -> None:
    if PUBLIC_MODEL.exists():
        return
    command = [
        sys.executable,
        "-m",
        "dpvision",
        "pretrain",
        "--objective",
        "supervised",
        "--dataset",
        "fashion-mnist",
        "--public-fraction",
        str(PUBLIC),
        "--model",
        "tanh-cnn",
        "--epochs",
        "20",
        "--batch-size",
        "128",
        "--learning-rate",
        "0.05",
        "--set",
        "crop_padding=2",
        "--set",
        "flip=true",
        "--out",
        str(PUBLIC_MODEL),
        "--json",
        str(FOLDER / "pretrain_public_slice.json"),
    ]
    subprocess.run(command, check=True)


def _name(row: str, rate: float, epsilon: float, seed: int) -> str:
    return f"{_slug(row)}_lr{rate:g}_eps{epsilon:g}_seed{seed}"


def run(workers: int) -> None:
    FOLDER.mkdir(parents=True, exist_ok=True)
    _pretrain()
    with ThreadPoolExecutor(workers) as pool:
        # 1. Tuning: every candidate at ε = 1, seed 0; the best validation accuracy wins.
        jobs = {
            (row, rate): pool.submit(_run, _name(row, rate, 1.0, 0), _dpsgd_args(row, rate, 1.0, 0))
            for row, (_, _, rates) in ROWS.items()
            for rate in rates
        }
        chosen = _chosen({key: job.result() for key, job in jobs.items()})
        # 2. Every ε and seed with the chosen rate, and the feature baselines.
        futures = [
            pool.submit(_run, _name(row, chosen[row], e, s), _dpsgd_args(row, chosen[row], e, s))
            for row in ROWS
            for e in EPSILONS
            for s in SEEDS
        ]
        futures += [
            pool.submit(_run, f"{_slug(row)}_eps{e:g}_seed{s}", _feature_args(row, e, s))
            for row in FEATURE_ROWS
            for e in EPSILONS
            for s in SEEDS
        ]
        for future in futures:
            future.result()


def _chosen(results: dict[tuple[str, float], dict[str, Any]]) -> dict[str, float]:
    best: dict[str, tuple[float, float]] = {}
    for (row, rate), result in results.items():
        score = result["validation_accuracy"]
        if row not in best or score > best[row][1]:
            best[row] = (rate, score)
    return {row: rate for row, (rate, _) in best.items()}


def report() -> str:
    import torch

    runs = {p.stem: json.loads(p.read_text()) for p in FOLDER.glob("*_seed*.json")}
    tuning = {
        (row, rate): runs[_name(row, rate, 1.0, 0)]
        for row, (_, _, rates) in ROWS.items()
        for rate in rates
        if _name(row, rate, 1.0, 0) in runs
    }
    chosen = _chosen(tuning)
    pretrain = json.loads((FOLDER / "pretrain_public_slice.json").read_text())
    lines = [
        "# Public pre-training and private fine-tuning on Fashion-MNIST",
        "",
        f"Generated by `benchmarks/finetune_fmnist.py` on {time.strftime('%Y-%m-%d')} "
        f"({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}).",
        "",
        f"**Split, in every row:** {PUBLIC:.0%} of the 60 000 training images (6 000, fixed: "
        "`public_fraction = 0.1`) are public; the other 54 000 are private, of which a "
        f"seeded {VALIDATION:.0%} (5 400) is the validation split used for the learning rate; "
        "every private run trains on the remaining 48 600. Test accuracy on the 10 000 test "
        f"images, median of {len(SEEDS)} seeds; δ = {DELTA:g}; ε is the largest the runs' "
        "ledgers report (PLD).",
        "",
        f"Public pre-training (no privacy cost): the Tanh CNN, {pretrain['steps']} SGD steps "
        f"on the 6 000 public images, {pretrain['wall_seconds']:.0f} s; its test accuracy "
        f"alone is {100 * pretrain['test_accuracy']:.2f} %.",
        "",
        f"DP-SGD rows: B = 2048, momentum 0.9, C = 0.1, {EPOCHS} epochs, EMA 0.9999 (the "
        "seed-004 recipe, shortened from 40 epochs); the learning rate chosen on the "
        "validation split at ε = 1, seed 0 (candidates and choice in the last column).",
        "",
        "| row | public / private / validation images | ε = 0.5 | ε = 1 | ε = 3 | ε (max) "
        "| learning rate (candidates: validation) |",
        "|---|---|---|---|---|---|---|",
    ]
    names = [*ROWS, *FEATURE_ROWS]
    for row in names:
        cells, worst, row_runs = [], 0.0, []
        for epsilon in EPSILONS:
            if row in ROWS:
                group = [runs.get(_name(row, chosen.get(row, math.nan), epsilon, s)) for s in SEEDS]
            else:
                group = [runs.get(f"{_slug(row)}_eps{epsilon:g}_seed{s}") for s in SEEDS]
            done = [r for r in group if r is not None]
            row_runs += done
            if not done:
                cells.append("not run")
                continue
            median = statistics.median(r["test_accuracy"] for r in done)
            worst = max(worst, *(r["epsilon"] for r in done))
            runs_text = "/".join(f"{100 * r['test_accuracy']:.1f}" for r in done)
            cells.append(f"**{100 * median:.2f} %** ({runs_text})")
        tuned = "—"
        if row in ROWS:
            candidates = ", ".join(
                f"{rate:g}: {100 * tuning[(row, rate)]['validation_accuracy']:.2f} %"
                for rate in ROWS[row][2]
                if (row, rate) in tuning
            )
            tuned = f"{chosen.get(row, '?')} ({candidates})"
        public = f"{pretrain['n_images']:,}".replace(",", " ")
        if row in ("scratch", "scatternet + linear"):
            public += " (unused)"
        elif row.startswith("randp"):
            public += " (unused; synthetic images instead)"
        sizes = [(r["n_train"], r.get("n_validation", 0)) for r in row_runs]
        split = " / ".join(
            [public, *(f"{v:,}".replace(",", " ") for v in sizes[0])] if sizes else [public, "?"]
        )
        lines.append(f"| {row} | {split} | {' | '.join(cells)} | {worst:.4f} | {tuned} |")
    lines += [
        "",
        "Rows: see the module docstring of `benchmarks/finetune_fmnist.py`. Per-run results "
        "(with the ledger and the resolved config) are in `benchmarks/results/finetune_fmnist/`.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if not args.report_only:
        run(args.workers)
    text = report()
    (RESULTS / "finetune_fmnist.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
