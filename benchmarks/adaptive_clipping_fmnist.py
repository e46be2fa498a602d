"""Adaptive clipping against a fixed clip norm tuned on validation (Fashion-MNIST, ε 1 and 3).

Two setups (``--setup``), both on ScatterNet features, δ = 10⁻⁵, σ calibrated by PLD:

* ``recipe``: dpvision's default recipe (``dpvision train --dataset fashion-mnist``: DP-SGD
  on a linear head, group norm, momentum 0.9, its B, epochs and learning rate per ε), whose
  own C is 0.1. Fixed C ∈ {0.03, 0.1, 0.3, 1}; adaptive from C₀ = 0.1 and from C₀ = 1.
* ``trainer``: the DP-SGD trainer with an MLP (``mlp-64``), B = 2048, 10 epochs, momentum
  0.9, updates divided by C (``normalize_update``, learning rate 0.5). Fixed C ∈ {0.1, 0.3,
  1, 3, 10}; adaptive from C₀ = 0.1.

Fixed C is tuned on a validation split (10 002 of the 60 000 training images held out,
seed 0); the best C at each ε, and adaptive clipping from the first C₀ listed (target
quantile 0.5, Opacus' defaults otherwise, σ_b = qN/20: nothing tuned), are then trained on
all 60 000 and tested, 3 seeds; the median is reported.

Run:  python benchmarks/adaptive_clipping_fmnist.py --setup recipe   (about 20 minutes on
2 cores; ``trainer`` about 17). Results: benchmarks/results/adaptive_clipping_fmnist_SETUP.*
"""

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from dpvision.config import resolve
from dpvision.fileio import write_json_atomic
from dpvision.runs.train import run_training

RESULTS = Path(__file__).resolve().parent / "results"
EPSILONS = (1.0, 3.0)
SEEDS = (0, 1, 2)
ADAPTIVE = "learner.clipping='adaptive'"
SETUPS: dict[str, dict[str, Any]] = {
    "recipe": {
        "flags": {},
        "sets": (),
        "clip": "learner.clip_norm",
        "fixed": (0.03, 0.1, 0.3, 1.0),
        "starts": (1.0, 0.1),
        "what": "the default recipe (DP-SGD on a linear head over ScatterNet, group norm; "
        "B, epochs and learning rate of the recipe at each ε)",
    },
    "trainer": {
        "flags": {"method": "dp-sgd", "features": "scatternet"},
        "sets": (
            "learner.model='mlp-64'",
            "learner.batch_size=2048",
            "learner.physical_batch_size=2048",
            "learner.epochs=10",
            "learner.learning_rate=0.5",
            "learner.momentum=0.9",
            "learner.normalize_update=true",
        ),
        "clip": "learner.max_grad_norm",
        "fixed": (0.1, 0.3, 1.0, 3.0, 10.0),
        "starts": (0.1,),
        "what": "DP-SGD on ScatterNet features, mlp-64, B = 2048, 10 epochs, momentum 0.9, "
        "updates divided by C (normalize_update, lr 0.5)",
    },
}


def run(setup: dict[str, Any], epsilon: float, seed: int, sets: list[str], validation: bool):
    flags = {"dataset": "fashion-mnist", "epsilon": epsilon, "seed": seed, **setup["flags"]}
    extra = ["validation_fraction=0.1667"] if validation else []
    start = time.perf_counter()
    result = run_training(resolve(None, flags, [*setup["sets"], *sets, *extra]), quiet=True)
    row = {
        "epsilon": epsilon,
        "seed": seed,
        "set": sets,
        "validation": validation,
        "accuracy": result["validation_accuracy"] if validation else result["test_accuracy"],
        "claimed_epsilon": result["epsilon"],
        "final_clip_norm": result.get("final_clip_norm"),
        "seconds": time.perf_counter() - start,
    }
    print(row, flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=sorted(SETUPS), default="recipe")
    name = parser.parse_args().setup
    setup = SETUPS[name]
    adaptive = [[ADAPTIVE, f"{setup['clip']}={start}"] for start in setup["starts"]]
    rows, chosen = [], {}
    for epsilon in EPSILONS:
        tried = [run(setup, epsilon, 0, [f"{setup['clip']}={c}"], True) for c in setup["fixed"]]
        rows += tried
        chosen[epsilon] = max(tried, key=lambda r: r["accuracy"])["set"]
        rows += [run(setup, epsilon, 0, sets, True) for sets in adaptive]
    for epsilon in EPSILONS:
        for sets in (chosen[epsilon], adaptive[0]):
            rows += [run(setup, epsilon, seed, sets, False) for seed in SEEDS]
    write_json_atomic(RESULTS / f"adaptive_clipping_fmnist_{name}.json", {"rows": rows})
    markdown = _markdown(name, setup, rows, chosen, adaptive[0])
    (RESULTS / f"adaptive_clipping_fmnist_{name}.md").write_text(markdown)
    return 0


def _label(sets: list[str]) -> str:
    if sets[0] == ADAPTIVE:
        return f"adaptive, C₀ = {sets[1].split('=')[1]}, γ = 0.5"
    return sets[0]


def _markdown(
    name: str,
    setup: dict[str, Any],
    rows: list[dict[str, Any]],
    chosen: dict[float, list[str]],
    adaptive: list[str],
) -> str:
    lines = [
        f"# Adaptive clipping vs a tuned fixed C, Fashion-MNIST, setup `{name}` "
        "(`benchmarks/adaptive_clipping_fmnist.py`)",
        "",
        f"{setup['what']}; δ = 1e-5 (PLD). Validation: seed 0, 10 002 training images held "
        "out. Test: trained on all 60 000 training images, tested on the 10 000 test images, "
        f"seeds {SEEDS}. Generated on {time.strftime('%Y-%m-%d')} (2-core CPU).",
        "",
        "## Validation (seed 0)",
        "",
        "| ε | clipping | validation % | final C |",
        "|---|---|---|---|",
    ]
    for row in (r for r in rows if r["validation"]):
        final = "" if row["final_clip_norm"] is None else f"{row['final_clip_norm']:.3g}"
        lines.append(
            f"| {row['epsilon']:g} | {_label(row['set'])} | {100 * row['accuracy']:.2f} | {final} |"
        )
    lines += [
        "",
        "## Test",
        "",
        "| ε | clipping | test %, median (min–max) | final C (median) | claimed ε | s per run |",
        "|---|---|---|---|---|---|",
    ]
    for epsilon in EPSILONS:
        for sets, note in ((chosen[epsilon], "tuned"), (adaptive, "not tuned")):
            group = [
                r
                for r in rows
                if not r["validation"] and r["epsilon"] == epsilon and r["set"] == sets
            ]
            accs = [100 * r["accuracy"] for r in group]
            finals = [r["final_clip_norm"] for r in group if r["final_clip_norm"] is not None]
            final = f"{statistics.median(finals):.3g}" if finals else ""
            lines.append(
                f"| {epsilon:g} | {_label(sets)} ({note}) | {statistics.median(accs):.2f} "
                f"({min(accs):.2f}–{max(accs):.2f}) | {final} | "
                f"{max(r['claimed_epsilon'] for r in group):.4f} | "
                f"{statistics.median(r['seconds'] for r in group):.0f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
