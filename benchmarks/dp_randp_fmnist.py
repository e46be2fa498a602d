"""DP-RandP on Fashion-MNIST: does a prior learned from random processes help?

Two parts, both at δ = 1e-5 with ε read back from each run's ledger:

``probe`` — Phase I's acceptance test. Private linear probing on the features of
  (a) the Tanh CNN body pre-trained on synthetic dead-leaves images (``dpvision pretrain``,
      file ``results/dp_randp/encoder_tanh_cnn_dead_leaves.pt``; its JSON beside it says how
      long it took), and
  (b) the same body at random initialisation (same architecture, same seed for the
      initialisation as Phase I, same public input normalisation),
  with ScatterNet features beside them as the handcrafted baseline. ε ∈ {0.5, 1, 3},
  median of 3 seeds, plus the non-private ceiling (one seed). Learners: DP-SGD on a linear
  head (the recipe tuned for ScatterNet in ``feature_learners_fmnist.py``, untuned for the
  encoders) and DP-LS (defaults). Encoder features are the multi-block features of
  Tang et al. App. G (``layers=blocks,grid=4``: every activation of the body average-pooled
  to 4×4 and concatenated, 800 dims); every feature vector is group-normalised per example
  (free), as the pixels and ScatterNet features of the other benchmarks.

``phases`` — the ablation of Tang et al.'s Table 24 on this dataset, ε ∈ {1, 3}: the three
  phases (Phase II on the head for N₁ = 96 steps, then Phase III), Phase III only from the
  same encoder (warm start), and end-to-end DP-SGD from random initialisation (cold), all
  with the seed-004 CNN recipe (B = 2048, lr 4, momentum 0.9, C = 0.1, 40 epochs, EMA
  0.9999). Each run is a ``dpvision train`` process with its own checkpoint.

Nothing was tuned on the test set; the Phase II learning rate is the recipe's (untuned).

Run:  DPVISION_DATA=../shared/data python benchmarks/dp_randp_fmnist.py probe
      DPVISION_DATA=../shared/data python benchmarks/dp_randp_fmnist.py phases --workers 2
      (--report-only rebuilds the summaries from the stored runs)
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
FOLDER = RESULTS / "dp_randp"
PRETRAINED = FOLDER / "encoder_tanh_cnn_dead_leaves.pt"
RANDOM = FOLDER / "encoder_tanh_cnn_random.pt"
DELTA = 1e-5
SEEDS = (0, 1, 2)

SGD = {"clip_norm": 0.1, "optimizer": "momentum", "momentum": 0.9}
SGD_SCHEDULE: dict[float, dict[str, Any]] = {  # feature_learners_fmnist.py's, for ScatterNet
    0.5: {**SGD, "batch_size": 4096, "epochs": 10, "learning_rate": 8.0},
    1.0: {**SGD, "batch_size": 8192, "epochs": 20, "learning_rate": 16.0},
    3.0: {**SGD, "batch_size": 8192, "epochs": 40, "learning_rate": 16.0},
}
BLOCKS = "layers=blocks,grid=4"
FEATURES = {
    "pretrained": f"encoder:path={PRETRAINED},{BLOCKS}",
    "random-init": f"encoder:path={RANDOM},{BLOCKS}",
    "scatternet": "scatternet",
    "scatternet-pooled": "scatternet:pool=2",
}
# (name, method, features key, preprocessing, learner options for ε)
PROBES: list[tuple[str, str, str]] = [
    ("dp-sgd-linear", "pretrained", "sgd"),
    ("dp-sgd-linear", "random-init", "sgd"),
    ("dp-sgd-linear", "scatternet", "sgd"),
    ("dp-ls", "pretrained", "ls"),
    ("dp-ls", "random-init", "ls"),
    ("dp-ls", "scatternet-pooled", "ls"),
]

COMMON = {
    "model": "tanh-cnn",
    "batch_size": 2048,
    "learning_rate": 4.0,
    "momentum": 0.9,
    "max_grad_norm": 0.1,
    "epochs": 40,
    "ema_decay": 0.9999,
    "physical_batch_size": 1024,
}
PHASES: dict[str, tuple[str, dict[str, Any]]] = {
    "three-phases": ("dp-randp", {"encoder": str(PRETRAINED), "phase2_steps": 96}),
    "phase-3-only (warm)": ("dp-randp", {"encoder": str(PRETRAINED), "phase2_steps": 0}),
    "end-to-end (cold)": ("dp-sgd", {"normalization": "dataset"}),
}


def _meta() -> dict[str, Any]:
    import torch

    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
    }


# --- probe --------------------------------------------------------------------------------


def _random_encoder() -> None:
    """The pre-trained body's architecture at its Phase I initialisation, untrained."""
    import dataclasses

    import torch

    from dpvision.models.encoder import build_body, read_encoder, save_encoder
    from dpvision.training.pretrain import _seeds

    info, _ = read_encoder(PRETRAINED)
    torch.manual_seed(_seeds(info.metadata["options"]["seed"])["init"])
    body = build_body(info.model, info.input_shape, info.groups)
    metadata = {"trained_on": "nothing (random initialisation)", "private_data": False}
    save_encoder(RANDOM, body, dataclasses.replace(info, metadata=metadata))


def _probe_config(method: str, features: str, kind: str, epsilon: float, seed: int) -> Any:
    from dpvision.config import PreprocessingConfig, TrainConfig, validate
    from dpvision.features import feature_shape, parse_feature_spec

    spec = parse_feature_spec(FEATURES[features])
    dims = math.prod(feature_shape((28, 28, 1), spec))
    if features.startswith("scatternet"):
        pre = PreprocessingConfig(kind="group-norm", groups=27)
    else:  # every feature its own channel: per-example standardisation over all of them
        pre = PreprocessingConfig(kind="group-norm", groups=1, channels=dims)
    options = SGD_SCHEDULE[3.0 if math.isinf(epsilon) else epsilon] if kind == "sgd" else {}
    if kind == "ls":  # after group normalisation every vector has norm √d: nothing clipped
        options = {"clip_norm": math.sqrt(dims)}
    return validate(
        TrainConfig(
            dataset="fashion-mnist",
            method=method,
            features=FEATURES[features],
            epsilon=epsilon,
            delta=DELTA,
            seed=seed,
            preprocessing=pre,
            learner=dict(options),
        )
    )


def _probe(report_only: bool) -> None:
    from dpvision.runs.train import run_training

    folder = FOLDER / "probe"
    folder.mkdir(parents=True, exist_ok=True)
    if not report_only:
        if not RANDOM.exists():
            _random_encoder()
        for method, features, kind in PROBES:
            for epsilon in (0.5, 1.0, 3.0, math.inf):
                for seed in SEEDS if math.isfinite(epsilon) else (0,):
                    out = folder / f"{method}_{features}_eps{epsilon:g}_seed{seed}.json"
                    if out.exists():
                        continue
                    config = _probe_config(method, features, kind, epsilon, seed)
                    result = run_training(config, quiet=True)
                    result["probe_features"] = features
                    out.write_text(json.dumps(result, indent=1) + "\n")
                    print(
                        f"{out.name}: {100 * result['test_accuracy']:.2f} % "
                        f"({result['wall_seconds']:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    pretrain = json.loads((FOLDER / "pretrain_tanh_cnn_dead_leaves.json").read_text())
    rows = []
    for method, features, _ in PROBES:
        row: dict[str, Any] = {"method": method, "features": features}
        for epsilon in (0.5, 1.0, 3.0, math.inf):
            group = [
                r
                for r in runs
                if r["method"] == method
                and r["probe_features"] == features
                and r["config"]["epsilon"] == epsilon
            ]
            if group:
                accuracies = sorted(r["test_accuracy"] for r in group)
                row[f"{epsilon:g}"] = {
                    "median": statistics.median(accuracies),
                    "runs": accuracies,
                    "max_epsilon": max(r["epsilon"] for r in group),
                    "dims": group[0]["num_features"],
                }
        rows.append(row)
    meta = {**_meta(), "phase1_wall_seconds": pretrain["wall_seconds"]}
    (RESULTS / "dp_randp_probe.json").write_text(
        json.dumps({"meta": meta, "pretrain": pretrain["options"], "rows": rows}, indent=2) + "\n"
    )
    markdown = _probe_markdown(rows, meta, pretrain)
    (RESULTS / "dp_randp_probe.md").write_text(markdown)
    print(markdown)


def _probe_markdown(
    rows: list[dict[str, Any]], meta: dict[str, Any], pretrain: dict[str, Any]
) -> str:
    options = pretrain["options"]
    lines = [
        "# DP-RandP Phase I on Fashion-MNIST: private linear probing, pre-trained vs random",
        "",
        f"Generated by `benchmarks/dp_randp_fmnist.py probe` on {meta['date']} "
        f"({meta['machine']}, torch {meta['torch']}). Test accuracy (%), median of seeds "
        f"{', '.join(map(str, SEEDS))} (all runs in brackets); δ = {DELTA:g}; the "
        "non-private column is one seed with the noise off.",
        "",
        f"Phase I: `dpvision pretrain --model {options['model']} --synthetic "
        f"{options['synthetic']} --size 28 --channels 1 --num-images {options['num_images']} "
        f"--batch-size {options['batch_size']} --steps {options['steps']}` took "
        f"{pretrain['wall_seconds'] / 60:.1f} min on this CPU (one torch thread), final "
        f"alignment + uniformity loss {pretrain['final_loss']:.3f}. No private data and no "
        "privacy budget went into it.",
        "",
        "| learner | features | dims | ε = 0.5 | ε = 1 | ε = 3 | non-private |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = []
        dims = ""
        for key in ("0.5", "1", "3", "inf"):
            cell = row.get(key)
            if cell is None:
                cells.append("–")
                continue
            dims = str(cell["dims"])
            runs = "/".join(f"{100 * a:.2f}" for a in cell["runs"])
            cells.append(f"**{100 * cell['median']:.2f}**" + (f" ({runs})" if key != "inf" else ""))
        lines.append(f"| {row['method']} | {row['features']} | {dims} | {' | '.join(cells)} |")
    worst = max(
        cell["max_epsilon"] / float(key)
        for row in rows
        for key, cell in row.items()
        if key in ("0.5", "1", "3")
    )
    lines += [
        "",
        f"Largest reported ε / target over all private runs: {worst:.4f}.",
        "",
        "`pretrained` and `random-init` are the same Tanh CNN body (26 k parameters), the "
        "first after Phase I, the second at the initialisation Phase I started from. Their "
        "features are `layers=blocks,grid=4`: the two convolutional activations and the 32-d "
        "embedding, each average-pooled to 4×4 and concatenated (App. G of Tang et al.). "
        "ScatterNet (J = 2, L = 8) is the handcrafted baseline of Tramèr & Boneh; DP-LS gets "
        "its 2×2-pooled variant (1296 dims) as in `feature_learners_fmnist.md`. DP-SGD uses "
        "the per-ε schedule tuned for ScatterNet on a validation split "
        "(`feature_learners_fmnist.py`), untuned for the encoder features; DP-LS its "
        "defaults. Per-run results: `benchmarks/results/dp_randp/probe/`.",
    ]
    return "\n".join(lines) + "\n"


# --- phases -------------------------------------------------------------------------------


def _phase_command(setup: str, epsilon: float, seed: int, out: Path) -> list[str]:
    method, extra = PHASES[setup]
    command = [
        sys.executable, "-m", "dpvision", "train",
        "--dataset", "fashion-mnist", "--method", method, "--features", "pixels",
        "--epsilon", str(epsilon), "--delta", str(DELTA), "--seed", str(seed),
        "--json", str(out), "--checkpoint", str(out.with_suffix(".ckpt")), "--quiet",
    ]  # fmt: skip
    for key, value in {**COMMON, **extra}.items():
        command += ["--set", f"learner.{key}={json.dumps(value)}"]
    return command


def _slug(setup: str) -> str:
    return setup.split(" ")[0]


def _phase_run(setup: str, epsilon: float, seed: int, folder: Path) -> None:
    out = folder / f"{_slug(setup)}_eps{epsilon:g}_seed{seed}.json"
    if out.exists():
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run(
        _phase_command(setup, epsilon, seed, out), env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{out.name} failed: {done.stderr.strip().splitlines()[-1:]}")
    print(f"{out.name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    out.with_suffix(".ckpt").unlink(missing_ok=True)


def _phases(args: argparse.Namespace) -> None:
    folder = FOLDER / "phases"
    folder.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        setups = [s for s in PHASES if not args.only or _slug(s) in args.only]
        jobs = [(s, e, seed) for e in args.epsilons for seed in args.seeds for s in setups]
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            list(pool.map(lambda job: _phase_run(*job, folder), jobs))
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    rows = []
    for epsilon in sorted({r["config"]["epsilon"] for r in runs.values()}):
        for setup in PHASES:
            group = [
                r
                for name, r in runs.items()
                if name.startswith(_slug(setup) + "_") and r["config"]["epsilon"] == epsilon
            ]
            if not group:
                continue
            rows.append(
                {
                    "setup": setup,
                    "target_epsilon": epsilon,
                    "epsilon": max(r["epsilon"] for r in group),
                    "noise_multiplier": group[0]["noise_multiplier"],
                    "steps": group[0]["steps"],
                    "phase2_steps": group[0].get("phase2_steps"),
                    "phase2_epsilon": group[0].get("phase2_epsilon"),
                    "phase2_epsilon_fraction": group[0].get("phase2_epsilon_fraction"),
                    "ema": [r["test_accuracy_ema"] for r in group],
                    "last": [r["test_accuracy_last"] for r in group],
                    "seeds": [r["seed"] for r in group],
                    "median_ema": statistics.median(r["test_accuracy_ema"] for r in group),
                    "median_last": statistics.median(r["test_accuracy_last"] for r in group),
                    "wall_seconds": statistics.median(r["wall_seconds"] for r in group),
                }
            )
    meta = _meta()
    (RESULTS / "dp_randp_phases.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    markdown = _phases_markdown(rows, meta)
    (RESULTS / "dp_randp_phases.md").write_text(markdown)
    print(markdown)


def _phases_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# DP-RandP on Fashion-MNIST: the importance of the phases (Tang et al., Table 24)",
        "",
        f"Generated by `benchmarks/dp_randp_fmnist.py phases` on {meta['date']} "
        f"({meta['machine']}, torch {meta['torch']}). Test accuracy of the EMA parameters "
        f"(and of the last ones) on the 10 000 test images; δ = {DELTA:g}; ε read back from "
        "each run's ledger (PLD). Every run: Tanh CNN, B = 2048 (Poisson), lr 4, momentum "
        "0.9, C = 0.1, 40 epochs, EMA 0.9999; σ is calibrated for all the steps together, "
        "so Phase II + Phase III is one composition.",
        "",
        "| setup | target ε | ε (ledger, max) | σ | steps | Phase II steps (ε₁/ε) | "
        "EMA (median) | last (median) | runs, EMA (seeds) | wall s (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        phase2 = "–"
        if row["phase2_steps"] is not None:
            share = row["phase2_epsilon_fraction"]
            phase2 = f"{row['phase2_steps']}" + (f" ({share:.2f})" if share else "")
        runs = "/".join(f"{100 * a:.2f}" for a in row["ema"])
        lines.append(
            f"| {row['setup']} | {row['target_epsilon']:g} | {row['epsilon']:.4f} | "
            f"{row['noise_multiplier']:.4g} | {row['steps']} | {phase2} | "
            f"**{100 * row['median_ema']:.2f}** | {100 * row['median_last']:.2f} | "
            f"{runs} ({', '.join(map(str, row['seeds']))}) | {row['wall_seconds']:.0f} |"
        )
    lines += [
        "",
        "`three-phases`: the encoder of `dp_randp_probe.md` (Phase I on synthetic dead "
        "leaves), then Phase II (head only, N₁ = 96 steps, Tang et al.'s fixed N₁) and "
        "Phase III (all parameters) in one DP-SGD run; `phase-3-only (warm)`: the same "
        "encoder, N₁ = 0; `end-to-end (cold)`: plain DP-SGD from random initialisation "
        "with the published per-dataset pixel normalisation (the recipe of "
        "`dpsgd_fmnist.md`). Per-run results: `benchmarks/results/dp_randp/phases/`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("probe", "phases"))
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--workers", type=int, default=1, help="phases: runs in parallel")
    parser.add_argument(
        "--only",
        action="append",
        help="phases: setups to run (three-phases, phase-3-only, end-to-end)",
    )
    parser.add_argument("--report-only", action="store_true", help="summarise stored runs")
    args = parser.parse_args()
    if args.part == "probe":
        _probe(args.report_only)
    else:
        _phases(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
