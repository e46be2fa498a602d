"""``dpvision sweep`` and ``dpvision report``: privacy-utility grids, tables and plots.

:func:`sweep` runs configs over a grid of target ε and seeds and writes one result JSON per
run (the DESIGN.md contract, the resolved config inside, ``[reference]`` included) to a
folder; a run whose JSON is already there, made by the same resolved config, is kept (so an
interrupted sweep resumes), and one made by another config (a smoke run's ``--set``) is
rerun, naming what differs. Every (config, ``--set``) pair is validated before any run.

:func:`report` reads every result JSON of a folder and writes a markdown report beside one
PNG per dataset:

* a table per dataset: for each setup (method, features, model) and target ε, the median
  test accuracy over seeds, the min–max spread, the published number beside it
  (``[reference]``) and the difference;
* flags: a run whose reported ε exceeds its target, and a run at the published ε whose
  accuracy lies outside the config's ``reference.band``;
* the privacy ledger of every run, summarised (σ, q, steps, accountant, what was released);
* the plot: test accuracy against ε (log axis) per setup, the seeds' spread as error bars,
  and the published points overlaid.

Everything here reads results (already released models' test accuracies and ledgers):
nothing touches private training data.

The package: :mod:`~dpvision.report.sweep` runs the grid, :mod:`~dpvision.report.results`
reads and labels result JSONs, :mod:`~dpvision.report.markdown` writes the report and
:mod:`~dpvision.report.plots` draws its figures.
"""

from dpvision.report.markdown import report
from dpvision.report.plots import plot_curves, plot_history
from dpvision.report.results import (
    EPSILON_SLACK,
    SAME_EPSILON,
    load_results,
    published_points,
    run_flags,
    setup_label,
    target_epsilon,
)
from dpvision.report.sweep import _stale, sweep

__all__ = [
    "EPSILON_SLACK",
    "SAME_EPSILON",
    "_stale",
    "load_results",
    "plot_curves",
    "plot_history",
    "published_points",
    "report",
    "run_flags",
    "setup_label",
    "sweep",
    "target_epsilon",
]
