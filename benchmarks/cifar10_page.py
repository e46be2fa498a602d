"""Writes ``docs/results/cifar10.md`` from the runs ``benchmarks/cifar10.py`` stored.

One table per seed paper, a line per published row: the paper's number, dpvision's (median
over seeds, min–max), ε as the ledger reports it, the seeds, the median wall time and peak
memory, the commit. A row more than the band (± 2 points) plus the copy's expected cost
below the paper's number needs a reason (``WHY``, written from a measurement); without one
the page says *unexplained*. Rows not run yet show their command, and their projected time
where ``--project`` timed a fraction.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BAND = 0.02
"""The papers' band around their number (± 2 points, as the configs' ``[reference]``)."""

ABLATION_CEILING = (
    "CPU-sized: 1 epoch of WRN-10-1 (196 steps at B 256, 49 at B 1024) where the paper's "
    "WRN-40-4 trains for thousands of steps; without noise, the last step's recipe reaches "
    "only {t3-ablation-nonprivate} in its 49 steps (`t3-ablation-nonprivate`)"
)

WHY: dict[str, str] = {
    "t4-sn-cnn-eps1": "below the band by more than the copy: the row keeps ε = 3's settings, "
    "and PrivDataNorm's two releases at σ_norm = 8 alone cost ε = 0.86 of the budget of 1 "
    "(classic-rdp, from this run's ledger), leaving the 360 gradient steps σ = 30.6, 5.4× "
    "ε = 3's 5.67; the paper chose its settings per ε (Table 1: 'the best ScatterNet model for "
    "each DP budget ε ≤ 3 with a hyper-parameter search')",
    **dict.fromkeys(
        ("t2-probe-eps1", "t2-probe-eps3"),
        "the CPU-sized encoder is the gap, not the privacy: its features reach "
        "{t2-probe-nonprivate} with no noise at all (`t2-probe-nonprivate`) where the paper's "
        "reach 74.05; the private probes reach {t2-probe-eps1} (ε = 1) and {t2-probe-eps3} "
        "(ε = 3) of that ceiling, the paper's 67.78 and 71.08 of its 74.05",
    ),
    **dict.fromkeys(
        ("t2-randp-wrn10-1-eps1", "t2-randp-wrn10-1-eps3"),
        "the prior is weak at CPU size: the encoder's frozen features reach {t2-probe-nonprivate} "
        "with no noise (`t2-probe-nonprivate`; the paper's 74.05), little above what DP-SGD from "
        "scratch reaches here ({t2-scratch-wrn10-1-eps1} at ε = 1, {t2-scratch-wrn10-1-eps3} at "
        "ε = 3), so the warm start has little to give",
    ),
    **dict.fromkeys(
        [
            "t3-ablation-0-baseline",
            "t3-ablation-1-group-norm",
            "t3-ablation-4-augmult",
            "t3-ablation-5-ema",
        ],
        ABLATION_CEILING,
    ),
    "t3-ablation-2-large-batch": ABLATION_CEILING
    + "; that is below the B 256 private row ({t3-ablation-1-group-norm}): at one epoch the 4× "
    "fewer steps, not the batch, set the level",
    "t3-ablation-3-weight-standardization": ABLATION_CEILING
    + "; the paper's +1.2 for weight standardisation is smaller than the spread between "
    "seeds here ({range:t3-ablation-3-weight-standardization} against "
    "{range:t3-ablation-2-large-batch} for the step before)",
}
"""Row key → why it is outside the band plus the copy's cost (a CPU-sized row: why it is
below the paper's level), with the measurement: ``{KEY}`` is row KEY's median and
``{range:KEY}`` its min–max over seeds, filled in as the page is written."""


def _why(key: str, by_row: dict[str, list[dict[str, Any]]]) -> str | None:
    """:data:`WHY`'s reason for row ``key``, its ``{KEY}`` filled with the medians."""
    return _filled(WHY[key], by_row) if key in WHY else None


def _filled(text: str, by_row: dict[str, list[dict[str, Any]]]) -> str:
    """``text`` with each ``{KEY}`` replaced by row KEY's median, ``{range:KEY}`` by its
    min–max over seeds (or a word that it has not run)."""

    def measured(match: re.Match[str]) -> str:
        spread, name = match.group(1), match.group(2)
        runs = by_row.get(name)
        if not runs:
            return f"(`{name}`: not run yet)"
        if spread:
            accuracies = [r["test_accuracy"] for r in runs]
            return f"{_pct(min(accuracies))}–{_pct(max(accuracies))}"
        return _pct(_median(runs))

    return re.sub(r"\{(range:)?([a-z0-9-]+)\}", measured, text)


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


def _epsilon(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:g}"


def _duration(seconds: float) -> str:
    if seconds >= 3 * 86400:
        return f"{seconds / 86400:.0f} days"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _projection(p: dict[str, Any]) -> str:
    """One projection in words: the projected time, where, and from what it was timed."""
    scaled = [q for q in p["parts"] if q.get("timed_batch")]
    how = (
        f", the DP-SGD steps timed at B = {scaled[0]['timed_batch']}, K = 1 and scaled by the "
        f"{scaled[0]['views_scale']:g}× example views of a step"
        if scaled
        else ""
    )
    unresolved = [q["command"] for q in p["parts"] if q["seconds_per_step"] <= 0]
    bound = (
        f"; a lower bound: the {', '.join(unresolved)} part's two timed runs did not separate "
        "(the longer one's loop was not slower, other work sharing the cores), so its steps "
        "count as free"
        if unresolved
        else ""
    )
    return (
        f"projected {'at least ' if unresolved else ''}{_duration(p['projected_seconds'])} on "
        f"{p['device']} ({p['machine']}; from {p['timed_steps'][0]} and {p['timed_steps'][1]} "
        f"timed steps{how}{bound})"
    )


def _median(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["test_accuracy"] for r in runs)


def _against(row: Any, median: float, by_row: dict[str, list[dict[str, Any]]]) -> str:
    """The row's difference from the row it is a claim against, beside the paper's."""
    other = by_row.get(row.against)
    if not other:
        return f"against `{row.against}`: not run yet"
    delta = 100 * (median - _median(other))
    text = f"{delta:+.2f} points against `{row.against}`"
    if row.published_delta is None:
        return text
    paper = 100 * row.published_delta
    same = (delta > 0) == (paper > 0)
    return f"{text} (paper {paper:+.1f}: {'same direction' if same else '**opposite**'})"


def _measured(
    row: Any, runs: list[dict[str, Any]], copy_cost: float, by_row: dict[str, list[Any]]
) -> list[str]:
    accuracies = [r["test_accuracy"] for r in runs]
    median = statistics.median(accuracies)
    spread = f" ({_pct(min(accuracies))}–{_pct(max(accuracies))})" if len(runs) > 1 else ""
    reported = max(r["epsilon"] for r in runs)
    wall = statistics.median(r["wall_seconds"] for r in runs)
    peak = max(r["peak_rss_gib"] for r in runs)
    commits = sorted({r["commit"] for r in runs})
    status = ""
    if row.published is not None and row.level:
        gap = median - row.published
        if gap < -(BAND + copy_cost):
            status = (
                _why(row.key, by_row) or "**unexplained**: below the band by more than the copy"
            )
        elif gap < -BAND:
            status = "below the band, within the copy's expected cost"
        elif gap > BAND:
            status = "above the band"
        else:
            status = "within the band"
    if row.against is not None:
        status = "; ".join(x for x in (status, _against(row, median, by_row)) if x)
    if not row.level and row.key in WHY:  # a CPU-sized stand-in: why it is below the paper
        status = "; ".join(x for x in (status, _why(row.key, by_row)) if x)
    return [
        f"**{_pct(median)}**{spread}",
        "∞" if math.isinf(reported) else f"{reported:.3f}",
        f"{len(runs)}" + (f" of {row.seeds}" if len(runs) < row.seeds else ""),
        _duration(wall),
        f"{peak:.1f} GiB",
        ", ".join(commits),  # "+local": src/ or configs/ differed from the commit
        status,
    ]


def _best_on_cpu(
    rows: Sequence[Any],
    by_row: dict[str, list[dict[str, Any]]],
    targets: dict[float, dict[str, Any]],
    ablation: str,
) -> list[str]:
    """The best measured CPU row at each ε of ``targets`` (its median over seeds and wall
    time) beside the target and the published rows it is read against; then ``ablation``."""
    lines = [
        "## The best on a CPU",
        "",
        "The best median on this page at each ε among the rows that ran on a CPU, against the "
        "best published from-scratch results at that ε.",
        "",
        "| ε | best CPU row | dpvision | seeds | wall | target | published |",
        "|---|---|---|---|---|---|---|",
    ]
    for epsilon, target in targets.items():
        measured = [
            (_median(by_row[row.key]), row)
            for row in rows
            if not row.gpu and row.epsilon == epsilon and by_row.get(row.key)
        ]
        published = "; ".join(f"{name}: {_pct(value)}" for name, value in target["published"])
        cells = ["not run yet", "", "", ""]
        if measured:
            median, row = max(measured, key=lambda pair: pair[0])
            runs = by_row[row.key]
            wall = statistics.median(r["wall_seconds"] for r in runs)
            cells = [f"`{row.key}`: {row.what}", f"**{_pct(median)}**", str(len(runs))]
            cells.append(_duration(wall))
        cells = [_epsilon(epsilon), *cells, _pct(target["target"]), published]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, "", _filled(ablation, by_row), ""]


def write_page(
    rows: Sequence[Any],
    store: dict[str, Any],
    page: Path,
    copy: str,
    copy_cost: float,
    intros: dict[str, str] | None = None,
    best: tuple[dict[float, dict[str, Any]], str] | None = None,
) -> None:
    """Writes the page for ``rows`` from ``store`` (``docs/results/cifar10.json``); ``copy``
    names the dataset copy, ``copy_cost`` is its expected cost against the papers; ``best``:
    (per ε, the target and published rows; the ablation's text) for :func:`_best_on_cpu`."""
    by_row: dict[str, list[dict[str, Any]]] = {}
    for run in store["runs"]:
        by_row.setdefault(run["row"], []).append(run)
    projections: dict[str, list[dict[str, Any]]] = {}
    for projection in store.get("projections", []):
        projections.setdefault(projection["row"], []).append(projection)
    machines = sorted({r["machine"] for r in store["runs"]})
    lines = [
        "# CIFAR-10: the seed papers' tables, measured with dpvision",
        "",
        f"**The copy.** Every number on this page comes from {copy}. The papers used the "
        "original pixels, so a row up to 3 points below the paper's band is within the "
        "copy's expected cost; a row further below says why.",
        "",
        "Made by `benchmarks/cifar10.py` (rows, commands and what is measured: its docstring); "
        "the runs are in [`cifar10.json`](cifar10.json). Accuracy is the test accuracy at the "
        "end of the run (the papers report the best over epochs or the final one, as their "
        "tables say), as a percentage: the median over seeds (min–max). ε is what the run's "
        "ledger reports (δ = 1e-5 throughout). Wall time is the median over the seeds of "
        "one run's time, peak memory the largest resident set of any of them, on "
        f"{'; '.join(machines) or 'no machine yet'}. Hyper-parameters are the papers' (the "
        "configs under `configs/`) or chosen on a validation split, never on the test set.",
        "",
    ]
    papers: dict[str, list[Any]] = {}
    for row in rows:
        papers.setdefault(row.paper, []).append(row)
    head = (
        "| row | paper | ε | published | dpvision | reported ε | seeds | wall | peak memory "
        "| commit | against the paper |"
    )
    for paper, members in papers.items():
        intro = (intros or {}).get(paper)
        lines += [f"## {paper}", "", *([intro, ""] if intro else []), head, "|" + "---|" * 11]
        notes: dict[str, list[str]] = {}  # note → the rows it is said of, in order
        for row in members:
            published = "—" if row.published is None else _pct(row.published)
            label = f"`{row.key}`: {row.what}"
            cells = [label, row.table, _epsilon(row.epsilon), published]
            runs = by_row.get(row.key)
            if runs:
                cells += _measured(row, runs, copy_cost, by_row)
            else:
                projected = projections.get(row.key, [])
                said = [_projection(p) for p in projected]
                if row.gpu:
                    said.append("`scripts/gpu-check --cifar` projects it on a GPU and runs it")
                where = "; ".join(said)
                cells += ["not run yet", "", "", "", "", "", where]
            lines.append("| " + " | ".join(cells) + " |")
            if row.note:
                notes.setdefault(f"{row.note}.", []).append(row.key)
            for run in runs or []:
                if run.get("features_extracted") and len(runs or []) > 1:
                    note = (
                        f"seed {run['seed']}'s run extracted the features "
                        f"({_duration(run['wall_seconds'])} in all); the others read them "
                        "from the cache."
                    )
                    notes.setdefault(note, []).append(row.key)
        lines += ["", "Commands (add `--seed N`; `{work}` is a scratch folder):", ""]
        commands = [" ".join(c) for row in members for c in row.commands]
        lines += [f"    dpvision {c}" for c in dict.fromkeys(commands)]  # shared ones once
        said = [
            ("Every row" if len(keys) == len(members) else ", ".join(f"`{k}`" for k in keys))
            + f": {note}"
            for note, keys in notes.items()
        ]
        lines += ["", *(f"- {line}" for line in said), ""] if said else [""]
    if best is not None:
        lines += _best_on_cpu(rows, by_row, *best)
    waiting = [row for row in rows if row.key not in by_row]
    if waiting:
        lines += [
            "## Not measured yet",
            "",
            f"{len(waiting)} of {len(rows)} rows: "
            + ", ".join(f"`{row.key}`" + (" (GPU)" if row.gpu else "") for row in waiting)
            + ". `python benchmarks/cifar10.py --rows KEY` runs a row; `--project` times a "
            "fraction of it first.",
            "",
        ]
    page.write_text("\n".join(lines).rstrip() + "\n")
