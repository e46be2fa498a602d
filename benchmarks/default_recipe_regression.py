"""Did issue 51 move the grey-scale default recipe? Digits and Fashion-MNIST, re-measured.

Issue 51 changed the DP-SGD-linear step's arithmetic (fixed-shape float64 blocks, the label
entry without cancellation), the preprocessing's reads (chunked views) and added a colour
recipe; the grey-scale recipe itself is unchanged. Three measurements, one page:

1. ``python benchmarks/default_recipe.py --part table --epsilons 1 3 --out
   benchmarks/results/default_recipe_regression``: the default at ε = 1 and 3, three fresh
   seeds, against the medians of ``default_recipe_table.md`` (2026-11-24, commit 020c04e).
2. Paired runs: the same command with the same ``--secret-seed`` (noise, sampling and splits
   replayed) at ef6facf (before issue 51's merge) and at the new head, for secret seeds
   11–13, digits and Fashion-MNIST, ε = 1 and 3::

       dpvision train --dataset D --epsilon E --seed 0 --secret-seed S --json RUNS/D-E-S-REV.json

   run with ``PYTHONPATH`` set to each commit's ``src/``.
3. Fashion-MNIST at ε = 3, four runs each of the 2026-11-24 code (020c04e, which has no
   ``--secret-seed``; its noise followed ``--seed``) and the new head, side by side
   (``RUNS/nov-fm3-rK.json``, ``RUNS/head-fm3-rK.json``).

Run: python benchmarks/default_recipe_regression.py   (writes the page from the stored runs)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "default_recipe_regression" / "runs"
PAGE = RESULTS / "default_recipe_regression.md"


def _accuracy(path: Path) -> float:
    return float(json.loads(path.read_text())["test_accuracy"])


def _pct(values: list[float]) -> str:
    return (
        f"**{100 * statistics.median(values):.2f}** "
        f"({100 * min(values):.2f}–{100 * max(values):.2f}; {len(values)} runs)"
    )


def main() -> int:
    before = json.loads((RESULTS / "default_recipe_table.json").read_text())["rows"]
    after = json.loads(
        (RESULTS / "default_recipe_regression" / "default_recipe_table.json").read_text()
    )["rows"]
    old = {(r["dataset"], r["epsilon"]): r["test_accuracies"] for r in before}
    lines = [
        "# The grey-scale default recipe, re-measured after issue 51",
        "",
        "Made by `python benchmarks/default_recipe_regression.py` from stored runs (what each "
        "is: its docstring). Test accuracy %, median (min–max).",
        "",
        "## Three fresh seeds against the 2026-11-24 table",
        "",
        "| dataset | ε | 2026-11-24 (020c04e) | now | difference of medians |",
        "|---|---|---|---|---|",
    ]
    for row in after:
        then, now = old[(row["dataset"], row["epsilon"])], row["test_accuracies"]
        delta = 100 * (statistics.median(now) - statistics.median(then))
        lines.append(
            f"| {row['dataset']} | {row['epsilon']:g} | {_pct(then)} | {_pct(now)} | {delta:+.2f} |"
        )
    lines += [
        "",
        "## The same secret randomness before and after issue 51 (ef6facf against the head)",
        "",
        "| dataset | ε | secret seed | before | after | the same |",
        "|---|---|---|---|---|---|",
    ]
    same = 0
    pairs = sorted(RUNS.glob("*-old.json"))
    for path in pairs:
        dataset, epsilon, seed = path.name.removesuffix("-old.json").rsplit("-", 2)
        a, b = _accuracy(path), _accuracy(path.with_name(path.name.replace("-old", "-new")))
        same += a == b
        lines.append(
            f"| {dataset} | {epsilon} | {seed} | {100 * a:.2f} | {100 * b:.2f} | "
            f"{'yes' if a == b else '**no**'} |"
        )
    nov = [_accuracy(p) for p in sorted(RUNS.glob("nov-fm3-r*.json"))]
    head = [_accuracy(p) for p in sorted(RUNS.glob("head-fm3-r*.json"))]
    lines += [
        "",
        f"{same} of {len(pairs)} pairs reach the same test accuracy to the last example: "
        "what issue 51 changed leaves the grey-scale default's runs as they were.",
        "",
        "## Fashion-MNIST at ε = 3: four runs each of the 2026-11-24 code and the head",
        "",
        f"- 2026-11-24 code (020c04e): {_pct(nov)}",
        f"- head: {_pct(head)}",
        "",
    ]
    if len(set(nov)) == 1:
        lines += [
            "Every run of the 2026-11-24 code reached the same accuracy: its noise and "
            "sampling followed the public `--seed` (a hole fixed since: secret randomness is "
            "fresh OS entropy in every run), so that table's three seeds are three fixed "
            "draws, and its medians one sample of the spread the fresh runs above show.",
            "",
        ]
    table = {(r["dataset"], r["epsilon"]): r["test_accuracies"] for r in after}
    fresh = [*head, *table[("fashion-mnist", 3.0)]]
    fresh += [_accuracy(p) for p in RUNS.glob("fashion-mnist-3-*-new.json")]
    lines += [
        f"All {len(fresh)} runs of the head at ε = 3 on Fashion-MNIST on this page (fresh, "
        f"paired and the table's): {_pct(fresh)}, against the 2026-11-24 table's "
        f"{_pct(old[('fashion-mnist', 3.0)])}.",
        "",
    ]
    PAGE.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
