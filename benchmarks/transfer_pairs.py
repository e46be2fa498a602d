"""Transfer across domains: does a public prior help, and does dpvision's choice notice?

For each pair (public prior → private dataset), at ε ∈ {1, 3}, median of seeds 0, 1, 2,
test accuracy of:

* ``scratch``: DP-SGD of the Tanh CNN from random initialisation at its full schedule
  (for digits the schedule is chosen on the validation split among ``SCHEDULES``; for
  Fashion-MNIST the 40-epoch recipe of seed 004, from ``dpsgd_fmnist.py``'s runs);
* ``prior, learner.init alone``: the default fine-tuning flow — the same recipe with only
  ``learner.init`` set (its head zeroed when the file was trained on other classes, its
  inputs normalised as the file records);
* ``prior, head kept``: the behaviour before issue 40 (``learner.head_init = "keep"``), where
  the file's head fits;
* ``prior, best fixed setting``: the fine-tuning setting (all or head, schedule, learning
  rate) with the best median validation accuracy at ε = 1, chosen in advance for free —
  what knowing the best setting is worth;
* ``private choice``: ``dpvision tune --transfer`` (scratch, all, head), its whole search
  within the same ε;
* ``scratch at the search's σ``: scratch trained with the noise multiplier the search gave
  its scratch candidate: the difference to ``scratch`` is what the selection costs.

Every private run holds out a validation split (``VALIDATION`` of its private rows) that
chooses hyper-parameters; the test set is read once per run, at its end, and never
chooses anything. Runs are ``dpvision train`` / ``dpvision tune`` processes with one torch
thread, ``--workers`` side by side; re-running skips stored runs.

Run:  DPVISION_DATA=../shared/data python benchmarks/transfer_pairs.py --workers 2
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
FOLDER = RESULTS / "transfer_pairs"
FMNIST_PRIOR = FOLDER / "tanh_cnn_fashion_mnist_3_epochs.pt"
SLICE_PRIOR = RESULTS / "finetune_fmnist" / "tanh_cnn_public_slice.pt"
RANDP_PRIOR = RESULTS / "dp_randp" / "encoder_tanh_cnn_dead_leaves.pt"
EPSILONS = (1.0, 3.0)
SEEDS = (0, 1, 2)
DELTA = 1e-5

# Digits (scikit-learn's 1 438 training images, brought to 28 × 28 for the 28 × 28 priors).
DIGITS_VALIDATION = 0.2
DIGITS_BASE = ["--dataset", "digits", "--set", "image_size=28", "--set", "learner.model='tanh-cnn'"]
SCHEDULES = {  # the scratch schedules compared on validation (B = 256, C = 1, no momentum)
    "e10-lr1": {"epochs": 10, "learning_rate": 1.0},
    "e40-lr0.25": {"epochs": 40, "learning_rate": 0.25},
}
FINETUNE_SETTINGS = {  # fine-tuning settings compared on validation
    "all-e10-lr1": {"finetune": "all", "epochs": 10, "learning_rate": 1.0},
    "all-e40-lr0.25": {"finetune": "all", "epochs": 40, "learning_rate": 0.25},
    "head-e10-lr4": {"finetune": "head", "epochs": 10, "learning_rate": 4.0},
    "head-e40-lr1": {"finetune": "head", "epochs": 40, "learning_rate": 1.0},
}
DIGITS_PAIRS = {
    "fashion-mnist → digits": FMNIST_PRIOR,
    "dead leaves (DP-RandP) → digits": RANDP_PRIOR,
}

# Fashion-MNIST: 10 % public slice, the rest private (finetune_fmnist.py's split and recipe).
FMNIST_VALIDATION = 0.1
FMNIST_RECIPE = {
    "model": "tanh-cnn",
    "batch_size": 2048,
    "momentum": 0.9,
    "max_grad_norm": 0.1,
    "epochs": 10,
    "ema_decay": 0.9999,
    "physical_batch_size": 1024,
    "learning_rate": 4.0,
}
SLICE_PAIR = "fashion-mnist public slice → fashion-mnist"


def _sets(options: dict[str, Any], prefix: str = "learner.") -> list[str]:
    return [x for k, v in options.items() for x in ("--set", f"{prefix}{k}={json.dumps(v)}")]


def _common(epsilon: float, seed: int, validation: float) -> list[str]:
    return [
        "--method",
        "dp-sgd",
        "--epsilon",
        f"{epsilon:g}",
        "--seed",
        str(seed),
        *_sets({"delta": DELTA, "validation_fraction": validation}, prefix=""),
        "--quiet",
    ]


def _run(name: str, command: str, args: list[str]) -> dict[str, Any]:
    out = FOLDER / f"{name}.json"
    if out.exists():
        return json.loads(out.read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.perf_counter()
    process = subprocess.run(
        [sys.executable, "-m", "dpvision", command, *args, "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if process.returncode:
        raise SystemExit(f"{name} failed: {process.stderr.strip()[-2000:]}")
    result = json.loads(out.read_text())
    validation = result.get("validation_accuracy", result.get("validation_score_noisy", math.nan))
    print(
        f"{name}: validation {100 * validation:.2f} %, test {100 * result['test_accuracy']:.2f} %"
        f" at ε = {result['epsilon']:.4f} ({time.perf_counter() - start:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return result


def _pretrain() -> None:
    """The issue's public prior: the Tanh CNN trained for 3 epochs on all 60 000
    Fashion-MNIST training images (public for the digits pairs)."""
    if FMNIST_PRIOR.exists():
        return
    FOLDER.mkdir(parents=True, exist_ok=True)
    command = [
        *("pretrain", "--objective", "supervised", "--dataset", "fashion-mnist"),
        *("--epochs", "3", "--out", str(FMNIST_PRIOR), "--quiet"),
        *("--json", str(FOLDER / "pretrain_fashion_mnist.json")),
    ]
    subprocess.run([sys.executable, "-m", "dpvision", *command], check=True)


def _slug(text: str) -> str:
    return (
        text.replace(" → ", "_to_")
        .replace(" (DP-RandP)", "")
        .replace(" ", "-")
        .replace("(", "")
        .replace(")", "")
    )


def _median(results: list[dict[str, Any]], key: str = "test_accuracy") -> float:
    return statistics.median(r[key] for r in results)


class Bench:
    def __init__(self, workers: int) -> None:
        self.pool = ThreadPoolExecutor(workers)

    def many(self, jobs: list[tuple[str, str, list[str]]]) -> list[dict[str, Any]]:
        return list(self.pool.map(lambda job: _run(*job), jobs))

    def digits(self, pair: str, prior: Path) -> dict[str, Any]:
        slug = _slug(pair)

        def args(options: dict[str, Any], epsilon: float, seed: int) -> list[str]:
            return [*DIGITS_BASE, *_common(epsilon, seed, DIGITS_VALIDATION), *_sets(options)]

        def grid(
            prefix: str, settings: dict[str, dict[str, Any]], extra: dict[str, Any]
        ) -> dict[str, dict[float, list[dict[str, Any]]]]:
            jobs, keys = [], []
            for label, options in settings.items():
                for epsilon in EPSILONS:
                    for seed in SEEDS:
                        name = f"{slug}_{prefix}-{label}_eps{epsilon:g}_seed{seed}"
                        jobs.append((name, "train", args({**options, **extra}, epsilon, seed)))
                        keys.append((label, epsilon))
            out: dict[str, dict[float, list[dict[str, Any]]]] = {}
            for (label, epsilon), result in zip(keys, self.many(jobs), strict=True):
                out.setdefault(label, {}).setdefault(epsilon, []).append(result)
            return out

        scratch = self._digits_scratch(args)  # the same for both digits pairs: stored once
        best_schedule = max(
            SCHEDULES, key=lambda k: _median(scratch[k][1.0], "validation_accuracy")
        )
        schedule = SCHEDULES[best_schedule]
        default = grid("init", {best_schedule: schedule}, {"init": str(prior)})[best_schedule]
        kept = None
        if prior == FMNIST_PRIOR:  # the file's 10-class head fits digits' 10 classes
            kept = grid(
                "init-keep", {best_schedule: schedule}, {"init": str(prior), "head_init": "keep"}
            )[best_schedule]
        fixed = grid("ft", FINETUNE_SETTINGS, {"init": str(prior)})
        best_fixed = max(fixed, key=lambda k: _median(fixed[k][1.0], "validation_accuracy"))
        choice = self._choices(
            slug,
            lambda epsilon, seed: [
                *DIGITS_BASE,
                *_common(epsilon, seed, DIGITS_VALIDATION),
                *_sets({**schedule, "init": str(prior)}),
            ],
        )
        at_sigma = self._scratch_at_sigma(
            slug,
            choice,
            lambda epsilon, seed: [
                *DIGITS_BASE,
                *_common(epsilon, seed, DIGITS_VALIDATION),
                *_sets(schedule),
            ],
        )
        return {
            "scratch": scratch[best_schedule],
            "scratch_label": f"{best_schedule} (validation: "
            + ", ".join(
                f"{k} {100 * _median(v[1.0], 'validation_accuracy'):.1f} %"
                for k, v in scratch.items()
            )
            + ")",
            "default": default,
            "kept": kept,
            "fixed": fixed[best_fixed],
            "fixed_label": f"{best_fixed} (validation: "
            + ", ".join(
                f"{k} {100 * _median(v[1.0], 'validation_accuracy'):.1f} %"
                for k, v in fixed.items()
            )
            + ")",
            "choice": choice,
            "at_sigma": at_sigma,
        }

    def _digits_scratch(self, args: Any) -> dict[str, dict[float, list[dict[str, Any]]]]:
        jobs, keys = [], []
        for label, options in SCHEDULES.items():
            for epsilon in EPSILONS:
                for seed in SEEDS:
                    name = f"digits_scratch-{label}_eps{epsilon:g}_seed{seed}"
                    jobs.append((name, "train", args(options, epsilon, seed)))
                    keys.append((label, epsilon))
        out: dict[str, dict[float, list[dict[str, Any]]]] = {}
        for (label, epsilon), result in zip(keys, self.many(jobs), strict=True):
            out.setdefault(label, {}).setdefault(epsilon, []).append(result)
        return out

    def _choices(self, slug: str, base: Any) -> dict[float, list[dict[str, Any]]]:
        jobs, keys = [], []
        for epsilon in EPSILONS:
            for seed in SEEDS:
                name = f"{slug}_choice_eps{epsilon:g}_seed{seed}"
                jobs.append((name, "tune", ["--transfer", *base(epsilon, seed)]))
                keys.append(epsilon)
        out: dict[float, list[dict[str, Any]]] = {}
        for epsilon, result in zip(keys, self.many(jobs), strict=True):
            out.setdefault(epsilon, []).append(result)
        return out

    def _scratch_at_sigma(
        self, slug: str, choice: dict[float, list[dict[str, Any]]], base: Any
    ) -> dict[float, list[dict[str, Any]]]:
        jobs, keys = [], []
        for epsilon in EPSILONS:
            for seed, tuned in zip(SEEDS, choice[epsilon], strict=True):
                sigma = tuned["tuning"]["noise_multipliers"][0]  # the scratch candidate's
                args = base(epsilon, seed)
                at = args.index("--epsilon")
                args[at : at + 2] = ["--noise-multiplier", repr(sigma)]
                name = f"{slug}_scratch-at-search-sigma_eps{epsilon:g}_seed{seed}"
                jobs.append((name, "train", [*args, "--noise-multiplier", repr(sigma)]))
                keys.append(epsilon)
        out: dict[float, list[dict[str, Any]]] = {}
        for epsilon, result in zip(keys, self.many(jobs), strict=True):
            out.setdefault(epsilon, []).append(result)
        return out

    def fashion_slice(self) -> dict[str, Any]:
        """Fashion-MNIST's public slice → the rest: the fixed rows are the stored runs of
        ``finetune_fmnist.py`` (the same split and recipe) and ``dpsgd_fmnist.py``."""
        slug = _slug(SLICE_PAIR)

        def stored(folder: str, pattern: str) -> dict[float, list[dict[str, Any]]]:
            def read(epsilon: float, seed: int) -> dict[str, Any]:
                path = RESULTS / folder / pattern.format(e=f"{epsilon:g}", s=seed)
                return dict(json.loads(path.read_text()))

            return {epsilon: [read(epsilon, seed) for seed in SEEDS] for epsilon in EPSILONS}

        def base(epsilon: float, seed: int) -> list[str]:
            return [
                "--dataset",
                "fashion-mnist",
                *_common(epsilon, seed, FMNIST_VALIDATION),
                *_sets({"accountant": "pld", "public_fraction": 0.1}, prefix=""),
                *_sets(FMNIST_RECIPE),
            ]

        choice = self._choices(
            slug, lambda epsilon, seed: [*base(epsilon, seed), *_sets({"init": str(SLICE_PRIOR)})]
        )
        at_sigma = self._scratch_at_sigma(slug, choice, base)
        return {
            "scratch": stored("dpsgd_fmnist", "cnn_eps{e}_seed{s}.json"),
            "scratch_label": "seed 004's 40 epochs, lr 4 (dpsgd_fmnist.py: on all 60 000 "
            "training images, more than the 48 600 private ones here)",
            "scratch_short": stored("finetune_fmnist", "scratch_lr4_eps{e}_seed{s}.json"),
            "default": stored("finetune_fmnist", "public-all_lr4_eps{e}_seed{s}.json"),
            "kept": None,
            "fixed": stored("finetune_fmnist", "public-all_lr4_eps{e}_seed{s}.json"),
            "fixed_label": "all, lr 4, 10 epochs (validation: all lr 4 86.96 %, lr 1 85.37 %; "
            "bias+head lr 16 86.15 %; head lr 16 85.74 %: finetune_fmnist.md)",
            "choice": choice,
            "at_sigma": at_sigma,
        }


def _cell(results: list[dict[str, Any]] | None) -> str:
    if not results:
        return "—"
    values = [100 * r["test_accuracy"] for r in results]
    return f"**{statistics.median(values):.2f}** ({'/'.join(f'{v:.1f}' for v in values)})"


def _report(pairs: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# Transfer across domains: scratch, fine-tuning, and the private choice",
        "",
        f"Generated by `benchmarks/transfer_pairs.py` on {time.strftime('%Y-%m-%d')} "
        f"({platform.machine()}, {os.cpu_count()} cores, torch "
        f"{__import__('torch').__version__}). Test accuracy %, median of seeds 0, 1, 2 "
        "(each seed's in brackets); δ = 1e-5; every row of a column at the same total ε "
        "(the private choice's ε covers its whole search). Hyper-parameters were chosen on "
        "each run's validation split, never on the test set.",
        "",
    ]
    for pair, rows in pairs.items():
        lines += [f"## {pair}", "", "| row | ε = 1 | ε = 3 | note |", "|---|---|---|---|"]
        table = [
            ("scratch, full schedule", rows["scratch"], rows["scratch_label"]),
            ("scratch, 10 epochs", rows.get("scratch_short"), "finetune_fmnist.py's scratch row"),
            ("prior, `learner.init` alone (default flow)", rows["default"], ""),
            ("prior, head kept (before issue 40)", rows["kept"], '`learner.head_init = "keep"`'),
            ("prior, best fixed setting", rows["fixed"], rows["fixed_label"]),
            ("private choice (`tune --transfer`)", rows["choice"], _picks(rows["choice"])),
            ("scratch at the search's σ", rows["at_sigma"], _sigmas(rows["choice"])),
        ]
        for label, results, note in table:
            if results is None:
                continue
            lines.append(
                f"| {label} | {_cell(results.get(1.0))} | {_cell(results.get(3.0))} | {note} |"
            )
        lines += ["", _verdict(rows), ""]
    return "\n".join(lines) + "\n"


def _picks(choice: dict[float, list[dict[str, Any]]]) -> str:
    names = {"": "scratch"}
    parts = []
    for epsilon, results in choice.items():
        picked = []
        for r in results:
            setting = r["selected"]["setting"]
            init = setting.get("learner.init", "")
            picked.append(names.get(init, setting.get("learner.finetune", "?")))
        parts.append(f"ε = {epsilon:g}: {', '.join(picked)}")
    return "selected: " + "; ".join(parts)


def _sigmas(choice: dict[float, list[dict[str, Any]]]) -> str:
    parts = []
    for epsilon, results in choice.items():
        tuning = results[0]["tuning"]
        parts.append(
            f"ε = {epsilon:g}: σ × {tuning['noise_scale']:.2f}, score noise ±"
            f"{100 * tuning['score_noise'] / tuning['n_validation']:.1f} points"
        )
    return "; ".join(parts)


def _verdict(rows: dict[str, Any]) -> str:
    out = []
    for epsilon in EPSILONS:
        scratch = _median(rows["scratch"][epsilon])
        default = _median(rows["default"][epsilon])
        choice = _median(rows["choice"][epsilon])
        fixed = _median(rows["fixed"][epsilon])
        cost = scratch - _median(rows["at_sigma"][epsilon])
        out.append(
            f"ε = {epsilon:g}: the prior {'helps' if default > scratch else 'does not help'} "
            f"(default flow {100 * (default - scratch):+.2f} points over scratch); the "
            f"selection costs {100 * cost:.2f} points (scratch at the search's σ) and the "
            f"private choice is {100 * (choice - scratch):+.2f} points from scratch "
            f"({'within' if choice >= scratch - cost - 1e-9 else 'beyond'} that cost), "
            f"{100 * (fixed - choice):.2f} below the best fixed setting."
        )
    return " ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pairs", default="all", help="comma-separated: digits, slice")
    args = parser.parse_args()
    FOLDER.mkdir(parents=True, exist_ok=True)
    _pretrain()
    bench = Bench(args.workers)
    wanted = {"digits", "slice"} if args.pairs == "all" else set(args.pairs.split(","))
    pairs: dict[str, dict[str, Any]] = {}
    if "slice" in wanted:
        pairs[SLICE_PAIR] = bench.fashion_slice()
    if "digits" in wanted:
        for pair, prior in DIGITS_PAIRS.items():
            pairs[pair] = bench.digits(pair, prior)
    out = RESULTS / "transfer_pairs.md"
    out.write_text(_report(pairs))
    (RESULTS / "transfer_pairs.json").write_text(
        json.dumps(
            {
                pair: {
                    key: {str(e): [r["test_accuracy"] for r in v] for e, v in value.items()}
                    for key, value in rows.items()
                    if isinstance(value, dict)
                }
                for pair, rows in pairs.items()
            },
            indent=1,
        )
    )
    print(f"written {out}")


if __name__ == "__main__":
    main()
