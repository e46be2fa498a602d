"""The report's figures: accuracy against ε per setup, and training curves.

Privacy:
  Draws released results only.
"""

# local imports: start-up time (heavy modules are imported in the functions using them)
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpvision.report.results import _published

if TYPE_CHECKING:
    pass


def _history(result: dict[str, Any]) -> list[tuple[int, float, str]]:
    """(step, accuracy in %, split) of a run's ``history``: the validation split's where
    the run held one out, else the test set's (the EMA's when it kept one)."""
    points = []
    for entry in result.get("history") or []:
        for split in ("validation", "test"):
            value = entry.get(f"{split}_accuracy_ema", entry.get(f"{split}_accuracy"))
            if value is not None:
                points.append((int(entry["step"]), 100 * float(value), split))
                break
    split = "validation" if any(s == "validation" for *_, s in points) else "test"
    return [p for p in points if p[2] == split]


def plot_history(dataset: str, results: list[dict[str, Any]], path: Path) -> None:
    """Accuracy against training step, one line per run (from each result's ``history``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpvision.fileio import atomic_open

    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    splits: set[str] = set()
    for result in sorted(results, key=lambda r: r["_file"]):
        points = _history(result)
        splits.update(s for *_, s in points)
        axes.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker=".",
            label=f"{result['_file']} (ε = {float(result['epsilon']):.3g})",
        )
    axes.set_xlabel("step")
    axes.set_ylabel(f"{' / '.join(sorted(splits))} accuracy (%)")
    axes.set_title(f"{dataset}: accuracy during training")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    figure.tight_layout()
    with atomic_open(path, "wb") as handle:
        figure.savefig(handle, format="png")
    plt.close(figure)


def plot_curves(
    dataset: str,
    groups: dict[tuple[str, float], list[dict[str, Any]]],
    path: Path,
    published: set[tuple[float, float, str]] | None = None,
) -> None:
    """Accuracy against ε (log axis) per setup, with the seeds' spread and published points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpvision.fileio import atomic_open

    by_setup: dict[str, list[tuple[float, list[float]]]] = defaultdict(list)
    published = set(published or ())
    for (label, epsilon), runs in groups.items():
        if math.isfinite(epsilon):
            by_setup[label].append((epsilon, [100 * float(r["test_accuracy"]) for r in runs]))
        published.update(_published(runs))
    figure, axes = plt.subplots(figsize=(8, 6), dpi=120)
    ticks: set[float] = set()
    for label, points in sorted(by_setup.items()):
        points.sort()
        xs = [e for e, _ in points]
        ticks.update(xs)
        medians = [statistics.median(a) for _, a in points]
        low = [m - min(a) for m, (_, a) in zip(medians, points, strict=True)]
        high = [max(a) - m for m, (_, a) in zip(medians, points, strict=True)]
        axes.errorbar(xs, medians, yerr=[low, high], marker="o", capsize=3, label=label)
    # Published points in black, one marker shape per source, so they never read as runs.
    for source, marker in zip(sorted({s for _, _, s in published}), "*DP^sXv", strict=False):
        xs = [e for e, _, s in published if s == source]
        ys = [100 * a for _, a, s in published if s == source]
        ticks.update(xs)
        size = 170 if marker == "*" else 70
        axes.scatter(
            xs, ys, marker=marker, s=size, color="black", zorder=5, label=f"published: {source}"
        )
    axes.set_xscale("log")
    if ticks:
        axes.set_xticks(sorted(ticks))
        axes.set_xticklabels([f"{t:g}" for t in sorted(ticks)])
        axes.minorticks_off()
    axes.set_xlabel("ε (log scale), δ as in each config")
    axes.set_ylabel("test accuracy (%)")
    axes.set_title(f"{dataset}: privacy-utility (median over seeds, bars: min–max)")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    figure.tight_layout()
    with atomic_open(path, "wb") as handle:
        figure.savefig(handle, format="png")
    plt.close(figure)
