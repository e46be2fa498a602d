"""Transfer across domains: does a public prior help, and does dpvision's choice notice?

For each pair (public prior → private dataset), at ε ∈ {1, 3}, median of seeds 0, 1, 2,
test accuracy of:

* ``scratch``: DP-SGD of the Tanh CNN from random initialisation at its full schedule
  (for digits the schedule is chosen on the validation split among ``SCHEDULES``; for
  Fashion-MNIST the 40-epoch recipe of seed 004 on the same private rows);
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

Pairs: Fashion-MNIST's first 3 epochs (all 60 000 training images, the issue's prior) and
the DP-RandP dead-leaves encoder → scikit-learn's digits at 28 × 28; Fashion-MNIST's 10 %
public slice, the dead-leaves encoder and a prior trained on the digits at 28 × 28 → the
other 90 % of Fashion-MNIST (``finetune_fmnist.py``'s split and recipe: B = 2048, momentum
0.9, C = 0.1, EMA 0.9999, lr 4; fine-tuning for 10 epochs; the public-slice prior made
again, as that script's predates the file's record of its rows). For the dead-leaves prior
→ Fashion-MNIST, fine-tuning at scratch's full 40 epochs is measured too
(``FMNIST_FULL_SCHEDULE_PAIRS``). The stored table holds all five pairs (the dead-leaves and
digits → Fashion-MNIST pairs took about an hour more here with two workers). A timm model
is not in the table: fine-tuning one on 54 000 images at three seeds and two ε is hours on
this 2-core CPU.

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
SLICE_PRIOR = FOLDER / "tanh_cnn_public_slice.pt"
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
FMNIST_FULL_EPOCHS = 40  # seed 004's schedule: scratch's full schedule
DIGITS_NPZ = FOLDER / "digits_28.npz"
DIGITS_PRIOR = FOLDER / "tanh_cnn_digits_28.pt"
FMNIST_PAIRS = {
    "fashion-mnist public slice → fashion-mnist": SLICE_PRIOR,
    "dead leaves (DP-RandP) → fashion-mnist": RANDP_PRIOR,
    "digits → fashion-mnist": DIGITS_PRIOR,
}
# Fine-tuning at scratch's full schedule, measured where the 10-epoch default flow lost to it
# at both ε (dead leaves: -0.8 / -3.8 points): is it the prior or the schedule?
FMNIST_FULL_SCHEDULE_PAIRS = (RANDP_PRIOR,)
FMNIST_FINETUNE = {  # the fine-tuning settings compared on validation where none are stored
    "all-lr4": {"finetune": "all", "learning_rate": 4.0},
    "head-lr16": {"finetune": "head", "learning_rate": 16.0},
}


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


def _pretrain_slice() -> None:
    """The same-domain prior: ``finetune_fmnist.py``'s pre-training (20 epochs on the 10 %
    public slice of Fashion-MNIST), made again with this version, whose file records the
    digests of its rows."""
    if SLICE_PRIOR.exists():
        return
    command = [
        *("pretrain", "--objective", "supervised", "--dataset", "fashion-mnist"),
        *("--public-fraction", "0.1", "--model", "tanh-cnn", "--epochs", "20"),
        *("--batch-size", "128", "--learning-rate", "0.05", "--set", "crop_padding=2"),
        *("--set", "flip=true", "--out", str(SLICE_PRIOR), "--quiet"),
        *("--json", str(FOLDER / "pretrain_public_slice.json")),
    ]
    subprocess.run([sys.executable, "-m", "dpvision", *command], check=True)


def _pretrain_digits() -> None:
    """A prior from the other side: the Tanh CNN trained for 30 epochs on all 1 438
    scikit-learn digits training images brought to 28 × 28 (public for Fashion-MNIST),
    written as an npz first since ``dpvision pretrain`` takes images at their own size."""
    if DIGITS_PRIOR.exists():
        return
    import numpy as np

    from dpvision.config import TrainConfig

    data = TrainConfig(dataset="digits", image_size=28).load_dataset()
    np.savez(
        DIGITS_NPZ,
        x_train=data.train_images,
        y_train=data.train_labels,
        x_test=data.test_images,
        y_test=data.test_labels,
    )
    command = [
        *("pretrain", "--objective", "supervised", "--dataset", f"npz:{DIGITS_NPZ}"),
        *("--set", "num_classes=10", "--epochs", "30", "--out", str(DIGITS_PRIOR), "--quiet"),
        *("--json", str(FOLDER / "pretrain_digits_28.json")),
    ]
    subprocess.run([sys.executable, "-m", "dpvision", *command], check=True)
    DIGITS_NPZ.unlink()


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
            "default_label": f"{best_schedule} with `learner.init`: the setting "
            f"all-{best_schedule} of the best-fixed grid, in separate runs (their difference "
            "is run-to-run noise)",
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

    def fashion(self, pairs: list[str]) -> dict[str, dict[str, Any]]:
        """The Fashion-MNIST pairs: 10 % of the training set public (left out of every
        private run), the rest private, ``finetune_fmnist.py``'s recipe. Scratch and the
        scratch candidate's σ are shared by the pairs (the same private rows, the same base
        recipe); the default flow is the fine-tuning setting ``all-lr4`` (the same runs)."""

        def base(epsilon: float, seed: int, **options: Any) -> list[str]:
            return [
                "--dataset",
                "fashion-mnist",
                *_common(epsilon, seed, FMNIST_VALIDATION),
                *_sets({"accountant": "pld", "public_fraction": 0.1}, prefix=""),
                *_sets({**FMNIST_RECIPE, **options}),
            ]

        def runs(name: str, **options: Any) -> dict[float, list[dict[str, Any]]]:
            jobs = [
                (f"{name}_eps{e:g}_seed{seed}", "train", base(e, seed, **options))
                for e in EPSILONS
                for seed in SEEDS
            ]
            results = iter(self.many(jobs))
            return {e: [next(results) for _ in SEEDS] for e in EPSILONS}

        out: dict[str, dict[str, Any]] = {}
        at_sigma: dict[float, list[dict[str, Any]]] | None = None
        for pair in pairs:
            prior = FMNIST_PAIRS[pair]
            slug = _slug(pair)
            choice = self._choices(
                slug, lambda epsilon, seed, prior=prior: base(epsilon, seed, init=str(prior))
            )
            if at_sigma is None:  # the scratch candidate's σ is the same in every pair
                at_sigma = self._scratch_at_sigma("fashion-mnist", choice, base)
            grid = {
                label: runs(f"{slug}_ft-{label}", init=str(prior), **options)
                for label, options in FMNIST_FINETUNE.items()
            }
            best = max(grid, key=lambda k: _median(grid[k][1.0], "validation_accuracy"))
            long = None
            if prior in FMNIST_FULL_SCHEDULE_PAIRS:
                long = runs(
                    f"{slug}_ft-all-e{FMNIST_FULL_EPOCHS}-lr4",
                    init=str(prior),
                    epochs=FMNIST_FULL_EPOCHS,
                )
            kept = None
            if prior == DIGITS_PRIOR:  # its 10-class head fits Fashion-MNIST's 10 classes
                kept = runs(f"{slug}_init-keep-e10-lr4", init=str(prior), head_init="keep")
            out[pair] = {
                "scratch_label": "seed 004's 40 epochs, lr 4, on the same private rows",
                "default": grid["all-lr4"],
                "default_label": "all, lr 4, 10 epochs: the same runs as all-lr4",
                "kept": kept,
                "long": long,
                "fixed": grid[best],
                "fixed_label": f"{best} (validation: "
                + ", ".join(
                    f"{k} {100 * _median(v[1.0], 'validation_accuracy'):.1f} %"
                    for k, v in grid.items()
                )
                + ")",
                "choice": choice,
                "at_sigma": at_sigma,
            }
        scratch = runs("fashion-mnist_scratch-e40-lr4", epochs=FMNIST_FULL_EPOCHS)  # slowest
        short = runs("fashion-mnist_scratch-e10-lr4")  # the search's scratch candidate at ε
        return {
            pair: {"scratch": scratch, "scratch_short": short, **rows} for pair, rows in out.items()
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
        "Rows: *scratch* from random initialisation at its full schedule; *`learner.init` "
        "alone*, the default fine-tuning flow (head zeroed unless the file was trained on "
        "this dataset, inputs normalised as the file records); *head kept*, the behaviour "
        "before issue 40, where the file's head fits; *best fixed setting*, the fine-tuning "
        "setting with the best median validation accuracy at ε = 1, known in advance for "
        "free; *private choice*, `dpvision tune --transfer` (scratch, all, head at 4× the "
        "learning rate; a secret number of runs, geometric with mean 3), its whole search "
        "within ε; *scratch at the search's σ*, the search's scratch candidate trained alone "
        "with the noise multiplier the search gave it (its ε, lower than the target, is not "
        "the point: it isolates what the search's larger σ costs).",
        "",
    ]
    for pair, rows in pairs.items():
        lines += [f"## {pair}", "", "| row | ε = 1 | ε = 3 | note |", "|---|---|---|---|"]
        table = [
            ("scratch, full schedule", rows["scratch"], rows["scratch_label"]),
            (
                "scratch, 10 epochs",
                rows.get("scratch_short"),
                "the fine-tuning schedule: the search's scratch candidate, at ε",
            ),
            (
                "prior, `learner.init` alone (default flow)",
                rows["default"],
                rows.get("default_label", ""),
            ),
            ("prior, head kept (before issue 40)", rows["kept"], '`learner.head_init = "keep"`'),
            (
                "prior, all, scratch's full schedule",
                rows.get("long"),
                "all, lr 4, 40 epochs: measured for this pair only (the 10-epoch flow lost "
                "to scratch at both ε); not a candidate of the best fixed setting",
            ),
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
    """Per ε: whether the prior helps, what the selection costs (the search's scratch
    candidate at ε minus the same at the search's σ) and whether the private choice is at
    least scratch minus that cost (the issue's acceptance)."""
    out = []
    for epsilon in EPSILONS:
        scratch = _median(rows["scratch"][epsilon])
        candidate = _median((rows.get("scratch_short") or rows["scratch"])[epsilon])
        default = _median(rows["default"][epsilon])
        choice = _median(rows["choice"][epsilon])
        fixed = _median(rows["fixed"][epsilon])
        cost = candidate - _median(rows["at_sigma"][epsilon])
        short = scratch - cost - choice
        out.append(
            f"- ε = {epsilon:g}: the prior {'helps' if default > scratch else 'does not help'}"
            f" (default flow {100 * (default - scratch):+.2f} points against scratch at its "
            f"full schedule). The selection costs {100 * cost:.2f} points (the search's "
            "scratch candidate at ε, minus the same at the search's σ); the private choice is "
            f"{100 * (choice - scratch):+.2f} points against scratch: "
            + (
                "at least scratch minus that cost"
                if short <= 1e-9
                else f"{100 * short:.2f} points short of scratch minus that cost"
            )
            + f"; the best fixed setting minus the choice: {100 * (fixed - choice):+.2f} points."
            + (
                f" Against its own scratch candidate (10 epochs, at ε) the choice is "
                f"{100 * (choice - candidate):+.2f} points."
                if rows.get("scratch_short")
                else ""
            )
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--pairs",
        default="all",
        help="comma-separated: digits (both digits pairs), fashion (the public slice), "
        "fashion-randp, fashion-digits (the other Fashion-MNIST pairs)",
    )
    args = parser.parse_args()
    FOLDER.mkdir(parents=True, exist_ok=True)
    _pretrain()
    bench = Bench(args.workers)
    groups = dict(zip(("fashion", "fashion-randp", "fashion-digits"), FMNIST_PAIRS, strict=True))
    wanted = {"digits", *groups} if args.pairs == "all" else set(args.pairs.split(","))
    pairs: dict[str, dict[str, Any]] = {}
    fashion = [pair for group, pair in groups.items() if group in wanted]
    if fashion:
        _pretrain_slice()
        _pretrain_digits()
        pairs.update(bench.fashion(fashion))
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
