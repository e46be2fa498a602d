"""Histograms of an audit's scores: the canary losses under D and D' (two-phase), or the
scores of the canaries left out and drawn in (one run). PNGs, via matplotlib."""

# local imports: start-up time (heavy modules are imported in the functions using them)
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpvision.errors import DPVisionError


def loss_histogram(
    losses_without: np.ndarray,
    losses_with: np.ndarray,
    report: dict[str, Any],
    path: str | Path,
) -> None:
    """Writes overlaid histograms of the canary's loss under models trained on D and on D',
    with the chosen threshold, to the PNG ``path`` (atomically)."""
    threshold = report.get("threshold")
    _histogram(
        (losses_without, losses_with),
        ("trained on D (without z)", "trained on D' = D ∪ {z}"),
        [("threshold", threshold)] if threshold is not None else [],
        title=f"{report['method']}, canary {report['canary']}: claimed ε = "
        f"{report['claimed_epsilon']:.3g}, lower bound {report['epsilon_lower_bound']:.3g}",
        xlabel="loss of the canary z",
        ylabel="models",
        path=path,
    )


def score_histogram(report: dict[str, Any], path: str | Path) -> None:
    """Writes overlaid histograms of a one-run audit's canary scores (left out, drawn in),
    with the two guess thresholds, to the PNG ``path`` (atomically)."""
    _histogram(
        (np.asarray(report["scores_excluded"]), np.asarray(report["scores_included"])),
        ("canaries left out", "canaries drawn in"),
        [
            (f"guess out (lowest {report['guess_out']})", report["threshold_out"]),
            (f"guess in (highest {report['guess_in']})", report["threshold_in"]),
        ],
        title=f"one run, {report['method']}, {report['canary']} canaries: claimed ε = "
        f"{report['claimed_epsilon']:.3g}, lower bound {report['epsilon_lower_bound']:.3g} "
        f"({report['correct']}/{report['guesses']} right)",
        xlabel="canary score",
        ylabel="canaries",
        path=path,
    )


def _histogram(
    samples: tuple[np.ndarray, np.ndarray],
    labels: tuple[str, str],
    lines: Sequence[tuple[str, float | None]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    path: str | Path,
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DPVisionError(
            "the audit histogram needs matplotlib: python -m pip install matplotlib"
        ) from None
    from dpvision.fileio import atomic_open

    both = np.concatenate(samples)
    low, high = float(both.min()), float(both.max())
    if not high > low:
        high = low + 1e-6
    bins = np.linspace(low, high, 60)
    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=110)
    for values, label in zip(samples, labels, strict=True):
        axes.hist(values, bins=bins, alpha=0.55, label=label)
    for (label, value), style in zip(lines, ("--", ":"), strict=False):
        if value is not None and math.isfinite(value):
            axes.axvline(value, color="black", linestyle=style, linewidth=1, label=label)
    axes.set_title(title, fontsize=9)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    with atomic_open(path, "wb") as out:
        out.write(buffer.getvalue())
