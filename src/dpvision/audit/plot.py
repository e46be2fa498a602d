"""The histogram of an audit's canary losses under D and D' (a PNG, via matplotlib)."""

import io
import math
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
    try:
        # local import: start-up time
        import matplotlib

        matplotlib.use("Agg")
        # local import: start-up time
        import matplotlib.pyplot as plt
    except ImportError:
        raise DPVisionError(
            "the audit histogram needs matplotlib: python -m pip install matplotlib"
        ) from None
    # local import: start-up time
    from dpvision.fileio import atomic_open

    both = np.concatenate([losses_without, losses_with])
    low, high = float(both.min()), float(both.max())
    if not high > low:
        high = low + 1e-6
    bins = np.linspace(low, high, 60)
    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=110)
    axes.hist(losses_without, bins=bins, alpha=0.55, label="trained on D (without z)")
    axes.hist(losses_with, bins=bins, alpha=0.55, label="trained on D' = D ∪ {z}")
    threshold = report.get("threshold")
    if threshold is not None and math.isfinite(threshold):
        axes.axvline(threshold, color="black", linestyle="--", linewidth=1, label="threshold")
    claimed = report["claimed_epsilon"]
    axes.set_title(
        f"{report['method']}, canary {report['canary']}: claimed ε = {claimed:.3g}, "
        f"lower bound {report['epsilon_lower_bound']:.3g}",
        fontsize=10,
    )
    axes.set_xlabel("loss of the canary z")
    axes.set_ylabel("models")
    axes.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    with atomic_open(path, "wb") as out:
        out.write(buffer.getvalue())
