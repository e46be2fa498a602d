"""``dpvision report``: the markdown report of a folder of result JSONs (tables per dataset,
flags, privacy ledgers) beside its figures.

Privacy:
  Reads results (released models' test accuracies and ledgers); touches no private data.
"""

# local imports: start-up time (heavy modules are imported in the functions using them)
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpvision.errors import DPVisionError
from dpvision.report.plots import _history, plot_curves, plot_history
from dpvision.report.results import (
    _groups,
    _ledger_summary,
    _same_epsilon,
    load_results,
    published_points,
    run_flags,
)


def report(
    folders: str | Path | Sequence[str | Path],
    out: str | Path | None = None,
    *,
    references: Sequence[str | Path] = (),
) -> dict[str, Any]:
    """Writes the markdown report (default ``FOLDER/report.md``, the first folder) and one
    PNG per dataset. ``references``: configs whose published points are plotted too.

    Returns a summary: the report's path, the PNGs, the rows and the flagged runs.
    """
    from dpvision.fileio import atomic_open

    roots = [folders] if isinstance(folders, str | Path) else list(folders)
    out_path = Path(out) if out is not None else Path(roots[0]) / "report.md"
    if out_path.is_dir() or (out is not None and not out_path.parent.is_dir()):  # before writing
        raise DPVisionError(f"cannot write the report to {out_path}: not a file in a folder")
    results = load_results(roots)
    extra = published_points(references)
    where = ", ".join(f"`{r}`" for r in roots)
    lines = ["# dpvision report", ""]
    lines += [f"{len(results)} runs from {where}. Accuracy is test accuracy in %.", ""]
    flagged: list[tuple[str, str]] = []
    rows: list[dict[str, Any]] = []
    pngs: list[Path] = []
    for dataset, groups in sorted(_groups(results).items()):
        lines += [f"## {dataset}", ""]
        lines += [
            "| setup | target ε | runs | median | min–max | paper | Δ (median − paper) | flags |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for (label, epsilon), runs in sorted(groups.items()):
            row, run_problems = _table_row(dataset, label, epsilon, runs, extra)
            rows.append(row)
            flagged += run_problems
            lines.append(_table_line(row))
        lines += _figures(dataset, groups, extra, out_path, pngs)
    lines += _flags_section(flagged) + _ledgers_section(results)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(out_path, "w") as handle:
        handle.write("\n".join(lines))
    return {"report": out_path, "plots": pngs, "rows": rows, "flagged": flagged}


def _table_row(
    dataset: str,
    label: str,
    epsilon: float,
    runs: list[dict[str, Any]],
    extra: dict[tuple[str, str], set[tuple[float, float, str]]],
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """One (setup, target ε) row of a dataset's table, and its runs' (file, flag)s."""
    accuracies = [100 * float(r["test_accuracy"]) for r in runs]
    median = statistics.median(accuracies)
    paper = None
    for at, accuracy, _ in sorted(extra.get((dataset, label), ())):
        if _same_epsilon(at, epsilon):
            paper = 100 * accuracy
    for run in runs:
        reference = run["config"].get("reference") or {}
        published_at = reference.get("epsilon")
        if reference.get("accuracy") is not None and (
            published_at is None or _same_epsilon(float(published_at), epsilon)
        ):
            paper = 100 * float(reference["accuracy"])
    run_problems = [(r["_file"], f) for r in runs for f in run_flags(r)]
    row = {
        "dataset": dataset,
        "setup": label,
        "epsilon": epsilon,
        "runs": len(runs),
        "median": median,
        "min": min(accuracies),
        "max": max(accuracies),
        "paper": paper,
        "flags": [f for _, f in run_problems],
    }
    return row, run_problems


def _table_line(row: dict[str, Any]) -> str:
    """The markdown line of a :func:`_table_row`."""
    paper, median, flags = row["paper"], row["median"], row["flags"]
    return (
        f"| {row['setup']} | {row['epsilon']:g} | {row['runs']} | {median:.2f} | "
        f"{row['min']:.2f}–{row['max']:.2f} | "
        f"{'—' if paper is None else f'{paper:.1f}'} | "
        f"{'—' if paper is None else f'{median - paper:+.2f}'} | "
        f"{'**' + '; '.join(flags) + '**' if flags else ''} |"
    )


def _figures(
    dataset: str,
    groups: dict[tuple[str, float], list[Any]],
    extra: dict[tuple[str, str], set[tuple[float, float, str]]],
    out_path: Path,
    pngs: list[Path],
) -> list[str]:
    """Draws a dataset's privacy-utility plot (and its training curves, where runs kept a
    history) beside the report, appends the PNGs to ``pngs``; returns their markdown."""
    png = out_path.with_name(f"{out_path.stem}-{dataset.replace(':', '_').replace('/', '_')}.png")
    points = set().union(*(v for (d, _), v in extra.items() if d == dataset))
    plot_curves(dataset, groups, png, points)
    pngs.append(png)
    lines = ["", f"![privacy-utility on {dataset}]({png.name})", ""]
    curves = [r for runs in groups.values() for r in runs if len(_history(r)) >= 2]
    if curves:
        png = png.with_name(f"{png.stem}-training.png")
        plot_history(dataset, curves, png)
        pngs.append(png)
        lines += [f"![training curves on {dataset}]({png.name})", ""]
    return lines


def _flags_section(flagged: list[tuple[str, str]]) -> list[str]:
    lines = ["## Flags", ""]
    if flagged:
        return [*lines, *(f"- **{file}**: {flag}" for file, flag in flagged)]
    return [
        *lines,
        "None: no run reports an ε above its target, and every run at a published ε "
        "lies inside its config's band.",
    ]


def _ledgers_section(results: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## Privacy ledgers", "", "| run | ε | δ | accountant | ledger |"]
    lines += ["|---|---:|---:|---|---|"]
    for result in results:
        lines.append(
            f"| {result['_file']} | {float(result['epsilon']):.4g} | {result.get('delta', '')} | "
            f"{result.get('accountant', '')} | {_ledger_summary(result)} |"
        )
    lines.append("")
    return lines
