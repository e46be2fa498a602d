"""``dpvision tune``: private hyper-parameter selection whose cost is in the ledger.

Papernot & Steinke (ICLR 2022): the mechanism Q draws one candidate uniformly at random,
trains it on the training part of a secret split of the private data and releases a noisy
count of the validation examples it classifies correctly; Q runs K times, K drawn from
:class:`~dpvision.accounting.Repetitions`, and only the run with the best noisy score is
released: its model, its candidate, its noisy score. The other runs' scores and models are
discarded, never printed.

Calibration (:mod:`dpvision.runs.selection_plan`): every candidate trains with its
single-run σ for the target ε (RDP, the accountant that accounts the selection) multiplied
by one common factor s ≥ 1, the smallest for which the whole selection stays within the
target. The search and K's distribution: :mod:`dpvision.runs.search`.

Privacy: Q's releases when it draws candidate c are c's Gaussian releases (its clipped
sums, sensitivity as in each learner) and the count of correct validation examples plus
N(0, σ_v²), sensitivity 1: a neighbouring dataset's extra example lands in the training or
the validation part (a keyed hash of each example under the secret split key, shared by
every run), and Q's RDP is bounded by the sum of the two. The ledger holds one
:class:`~dpvision.accounting.ledger.SelectionEntry` with every candidate's releases; the
reported ε is its RDP bound and never exceeds the target. Each run's ledger is checked
against the releases the selection was calibrated for before anything is released.

The bound holds only while K and the runs stay secret, so every coin of the search comes
from the tune's :class:`~dpvision.mechanisms.secret.SecretRandomness` (derived from
``secret_seed`` and the base config, else fresh OS entropy; in secure mode the score noise
from the CSPRNG itself), never from the public ``seed``: K and the candidates drawn (its
``"tune coins"`` stream), each run's noise, sampling and training (a child secret per run)
and each noisy score. Every run trains with the base's public seed, so the winner's config
does not tell its position. Published (the result, the model file, the log lines): the
selected candidate, its model and noisy score, and what is public before any coin is
drawn — the search, the distribution of K and its mean, the noise factor and multipliers,
σ_v, n_train, n_validation, ε and the ledger. Never published: K, which candidates ran and
in which order, any other run's score, and any timing of the search (a total wall time is
about K times one run's); the runs' own log records and warnings are withheld. Only K = 0
(a Poisson K) shows, inherently: there is no model.

Progress (issue 39): the search can take minutes, and K must stay secret, so what tune
prints is chosen by what it would tell.

* Log lines (captured stderr, ``--log-file``: published) are a fixed set whatever K, the
  draws and the timing: the plan (public before any coin), the score-noise warning when
  the plan calls for it (:func:`~dpvision.runs.selection_plan.score_noise_warning`, from
  public σ_v and n_val), and the selected candidate. No line per run, no "run k", no
  heartbeat in the log: lines every 10 s would number about K times one run's duration
  over 10 s, and their count is in every captured log.
* Every byte a run writes itself is withheld (:func:`_withheld_output`: log records,
  warnings, and stdout/stderr, so a progress bar a run draws — feature extraction, a
  learner's solves — or a model factory's ``print`` never shows): a bar restarting, or a
  per-run line, counts the runs.
* On an interactive terminal only, one line is redrawn in place every
  :data:`HEARTBEAT_SECONDS` (:func:`_heartbeat`) with the elapsed time and the public
  distribution of K, and erased when the search ends, so nothing of it stays in the
  scrollback or reaches a log. Its text depends on the elapsed time and public facts
  alone. It shows no time left: that needs one run's duration, and measuring it on the
  runs would tell which candidates ran and, with the total, K. The whole search takes
  about K times one run's time: anyone who times the process learns roughly K, which no
  implementation of a secret K can prevent; dpvision publishes no duration (the result
  withholds ``wall_seconds``, and a ``--log-file`` gets the tune's lines without their
  timestamps: :func:`_untimed_log_files`), so do not publish one.
"""

import contextlib
import dataclasses
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpvision.config import TrainConfig, resolve, validate
from dpvision.errors import DPVisionError
from dpvision.log import logger, say
from dpvision.mechanisms import SecureRandom
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.runs.saved import TrainedModel, privacy_of
from dpvision.runs.search import Search, TuneSettings, parse_distribution, parse_search, set_items
from dpvision.runs.selection_plan import (
    Candidate,
    SelectionPlan,
    plan_selection,
    score_noise_warning,
)
from dpvision.runs.train import fit
from dpvision.runs.validation import ValidationRelease

__all__ = [
    "Search",
    "TuneSettings",
    "parse_distribution",
    "parse_search",
    "release_score",
    "run_tune",
    "tune",
]

DEFAULT_VALIDATION_FRACTION = 0.1
HEARTBEAT_SECONDS = 5.0
"""How often the terminal-only line of :func:`_heartbeat` is redrawn."""


def run_tune(
    base: TrainConfig,
    search: Search,
    settings: TuneSettings = TuneSettings(),  # noqa: B008 (frozen: one shared default is safe)
    *,
    quiet: bool = False,
) -> tuple[dict[str, Any], TrainedModel | None]:
    """Runs the private selection; returns the result (the best run's, with ``tuning``
    and the selection's ledger and ε) and its model — or no model when K = 0 was drawn
    (Poisson), in which case nothing about the data is released.

    Privacy: see the module docstring; the reported ε covers every run and the selection.
    K, the candidates drawn and every run but the best stay secret: the result, the model
    and the log say nothing of them.
    """
    with _untimed_log_files():
        return _tune(base, search, settings, quiet)


def tune_secret(base: TrainConfig, search: Search, settings: TuneSettings) -> SecretRandomness:
    """The tune's secret randomness: fresh OS bits, or derived from ``secret_seed``, the
    base config, the search and the settings, so that two searches (another space, another
    K distribution or σ_v) under one secret seed never share K, draws or noise; the plan
    binds it to the rows (:meth:`~dpvision.mechanisms.secret.SecretRandomness.bind_rows`)."""
    return base.secret_randomness(
        tune={"search": dataclasses.asdict(search), "settings": dataclasses.asdict(settings)}
    )


def _tune(
    base: TrainConfig, search: Search, settings: TuneSettings, quiet: bool
) -> tuple[dict[str, Any], TrainedModel | None]:
    """:func:`run_tune`'s work."""
    if base.epsilon is None or not math.isfinite(base.epsilon):
        raise DPVisionError("dpvision tune needs a finite target ε: the budget of the whole search")
    if not base.validation_fraction:
        base = dataclasses.replace(base, validation_fraction=DEFAULT_VALIDATION_FRACTION)
    secret = tune_secret(base, search, settings)
    plan = plan_selection(base, search, settings, secret)  # binds the rows: data_facts
    say(
        f"tune: {len(plan.candidates)} candidates, a secret number of runs K "
        f"({plan.repetitions.describe()}), σ × {plan.scale:.4g} over one run's, score noise "
        f"σ_v = {plan.score_noise:.4g} on {plan.num_validation} validation examples; "
        f"ε = {plan.epsilon:.4f} for the whole search; the runs are not shown (that would "
        "tell K)",
        quiet,
    )
    warning = score_noise_warning(plan.score_noise, plan.num_validation, plan.num_train)
    if warning is not None:
        logger.warning(warning)
    public = {
        "epsilon": plan.epsilon,
        "delta": base.delta,
        "accountant": "rdp",
        "privacy_ledger": plan.ledger.to_dict()["entries"],
        "secret_randomness": secret.source,
    }
    with _heartbeat(plan, quiet):
        best = _hidden_runs(base, plan, secret)
    if best is None:
        say("tune: no run was drawn (K = 0, which a Poisson K allows): nothing released", quiet)
        result = {
            "dataset": plan.candidates[0].config.dataset,
            "method": "tune",
            "selected": None,
            **public,
            "noise_multiplier": None,
            "tuning": _tuning(search, plan),
        }
        return result, None
    return _release_best(best, search, plan, public, quiet)


def _tuning(search: Search, plan: SelectionPlan) -> dict[str, Any]:
    """The result's ``tuning``: the search and its calibration, all public before any coin
    is drawn (never K nor the candidates drawn)."""
    return {
        "search": {
            key: list(values) for key, values in zip(search.keys, search.values, strict=True)
        },
        "candidates": [c.setting for c in plan.candidates],
        "distribution": plan.repetitions.describe(),
        "mean_runs": plan.repetitions.mean,
        "shape": plan.repetitions.shape if math.isfinite(plan.repetitions.shape) else "inf",
        "noise_scale": plan.scale,
        "noise_multipliers": [plan.scale * c.single_sigma for c in plan.candidates],
        "score_noise": plan.score_noise,
        "n_validation": plan.num_validation,
        "n_train": plan.num_train,
    }


def _release_best(
    best: tuple[float, int, dict[str, Any], TrainedModel],
    search: Search,
    plan: SelectionPlan,
    public: dict[str, Any],
    quiet: bool,
) -> tuple[dict[str, Any], TrainedModel]:
    """The tune's result and model: the best run's, with the selection's ``public`` privacy
    keys, ``tuning``, the selected candidate and its noisy score.

    Privacy: the best run's result without its exact validation statistics, history and
    timings (:func:`_withheld_key`); its model; its noisy score clamped to [0, 1]
    (post-processing of the release of :func:`release_score`).
    """
    score, index, result, model = best
    chosen = plan.candidates[index]
    released = {k: v for k, v in result.items() if not _withheld_key(k)}
    released.update(public)
    released.update(
        tuning=_tuning(search, plan),
        selected={"candidate": index, "setting": chosen.setting},
        # Post-processing of the noisy count: an accuracy outside [0, 1] says nothing more.
        validation_score_noisy=min(max(score / plan.num_validation, 0.0), 1.0),
        recipe={
            **chosen.recipe,
            "summary": f"{chosen.recipe['summary']}; selected privately from "
            f"{len(plan.candidates)} candidates ({', '.join(set_items(chosen.setting))})",
        },
    )
    say(
        f"tune: selected candidate {index} "
        f"({', '.join(set_items(chosen.setting)) or 'the base config'}), noisy validation "
        f"accuracy {100 * released['validation_score_noisy']:.2f} %",
        quiet,
    )
    return released, dataclasses.replace(model, privacy=privacy_of(released))


def _hidden_runs(
    base: TrainConfig, plan: SelectionPlan, secret: SecretRandomness
) -> tuple[float, int, dict[str, Any], TrainedModel] | None:
    """The K runs, K and their candidates drawn from ``secret``; the best run's (noisy
    score, candidate, result, model), or None when K = 0.

    Privacy: each run trains under its own child of ``secret`` with the base's public seed
    (a seed per run would tell the winner's position), releases nothing about the
    validation rows, and only its exact count of correct validation examples plus secret
    N(0, σ_v²) leaves it; the runs' log records and warnings are withheld.
    """
    coins = secret.coins("tune coins")  # K and the draws, keyed by the rows as the noise
    runs = plan.repetitions.sample(coins)
    drawn = [int(coins.integers(len(plan.candidates))) for _ in range(runs)]
    best: tuple[float, int, dict[str, Any], TrainedModel] | None = None
    for number, index in enumerate(drawn, 1):
        candidate = plan.candidates[index]
        sigma = plan.scale * candidate.single_sigma
        config = dataclasses.replace(candidate.config, epsilon=None, noise_multiplier=sigma)
        selection = ValidationRelease.for_selection()
        with _withheld_output():
            result, model = fit(
                validate(config),
                quiet=True,
                secret=secret.child(f"run {number}"),
                validation=selection,
            )
        _check_ran_as_planned(result, candidate, sigma)
        noise = SecureRandom() if secret.secure else secret.numpy(f"score {number}")
        score = release_score(selection.exact[-1], plan.score_noise, noise)
        if best is None or score > best[0]:
            best = (score, index, result, model)
        del result, model, selection  # the exact count is never kept or shown
    return best


@contextlib.contextmanager
def _withheld_output() -> Iterator[None]:
    """Withholds every log record, Python warning and write to stdout or stderr while a run
    trains: a run is quiet, but a warning (e.g. the feature cache's), a progress bar drawn
    on a terminal or a model factory's ``print`` would still show once per run of some
    candidates, and their number and kind would tell K and the candidates drawn."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with (
            open(os.devnull, "w", encoding="utf-8") as sink,
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
            warnings.catch_warnings(record=True),  # recorded, then dropped with the run
        ):
            yield
    finally:
        logging.disable(previous)


@contextlib.contextmanager
def _untimed_log_files() -> Iterator[None]:
    """The tune's lines go to a ``--log-file`` without their timestamps: the time between
    the plan line and the selected candidate's is about K runs' time (K secret)."""
    files = [h for h in logger.handlers if isinstance(h, logging.FileHandler)]
    formats = [h.formatter for h in files]
    for handler in files:
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    try:
        yield
    finally:
        for handler, format_ in zip(files, formats, strict=True):
            handler.setFormatter(format_)


@contextlib.contextmanager
def _heartbeat(plan: SelectionPlan, quiet: bool) -> Iterator[None]:
    """While the hidden runs train, redraws one line in place on an interactive terminal
    every :data:`HEARTBEAT_SECONDS` (nothing when ``quiet`` or when stderr is not a terminal),
    and erases it at the end.

    Privacy: the line holds the elapsed time and the public distribution of K only; it is
    never logged (see the module docstring for why it shows no time left).
    """
    stream = sys.stderr  # the terminal itself: the runs' own stderr is withheld
    if quiet or not _is_terminal(stream):
        yield
        return
    started, stop, interval = time.monotonic(), threading.Event(), HEARTBEAT_SECONDS
    runs = plan.repetitions.describe()

    def beat() -> None:
        while not stop.wait(interval):
            stream.write(f"\r{heartbeat_text(time.monotonic() - started, runs)}\x1b[K")
            stream.flush()

    thread = threading.Thread(target=beat, name="dpvision tune heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        stream.write("\r\x1b[K")  # erased: no trace of the duration stays on the screen
        stream.flush()


def heartbeat_text(elapsed: float, runs: str) -> str:
    """The terminal line of :func:`_heartbeat`: ``elapsed`` seconds and the distribution of K.

    >>> print(heartbeat_text(130.0, "geometric, mean 4"))
    [dpvision] tune: 2.2 min so far (a secret number of runs: geometric, mean 4)
    """
    shown = f"{elapsed:.0f} s" if elapsed < 120 else f"{elapsed / 60:.1f} min"
    return f"[dpvision] tune: {shown} so far (a secret number of runs: {runs})"


def _is_terminal(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError, OSError):
        return False


def tune(
    search: Sequence[str],
    config: str | Path | None = None,
    *,
    distribution: str = "geometric",
    mean_runs: float | None = None,
    score_noise: float | None = None,
    save: str | Path | None = None,
    quiet: bool = True,
    **fields: Any,
) -> tuple[dict[str, Any], TrainedModel | None]:
    """``dpvision tune`` from Python: the result (the best run's, with ``tuning`` and the
    selection's ε) and the selected model (``None`` when K = 0 runs were drawn)::

        result, model = dpvision.tune(["learner.epochs=20,40"], dataset="digits", epsilon=3.0)
        result["epsilon"], result["selected"], model.predict(images)

    ``config`` and ``fields`` build the base run as :func:`dpvision.train` does; bad values
    and bad search specs raise :class:`~dpvision.errors.DPVisionError` before any training.

    Privacy: the result's ε covers every run and the selection, within the target ε.
    """
    parsed = parse_search(search)
    settings = TuneSettings(distribution, mean_runs, score_noise)
    settings.repetitions(len(parsed.candidates()))
    result, model = run_tune(resolve(config, fields), parsed, settings, quiet=quiet)
    if save is not None and model is not None:
        model.save(save)
    return result, model


def release_score(
    correct: int, score_noise: float, rng: np.random.Generator | SecureRandom
) -> float:
    """The released score of one run: the number of correct validation examples plus
    N(0, σ_v²) (from the CSPRNG when ``rng`` is a :class:`SecureRandom`).

    Privacy: adding or removing one validation example changes the count by at most 1
    (L2 sensitivity 1) for a given model; ``score_noise`` is σ_v itself (0 only in tests).
    """
    if not (math.isfinite(score_noise) and score_noise >= 0):
        raise DPVisionError(f"the score noise must be >= 0, got {score_noise}")
    if not score_noise:
        return float(correct)
    if isinstance(rng, SecureRandom):
        return float(correct) + score_noise * float(rng.standard_normal(1)[0])
    return float(correct) + float(rng.normal(0.0, score_noise))


def _withheld_key(key: str) -> bool:
    """Keys of the best run's result that the tune result leaves out: exact statistics of the
    validation examples, and what would tell the run's place among the K (its timings, its
    per-step history; a total wall time would be about K times one run's)."""
    return key.startswith("validation_") or key in (
        "history",
        "epsilon_zcdp",
        "wall_seconds",
        "train_seconds",
    )


def _check_ran_as_planned(result: dict[str, Any], candidate: Candidate, sigma: float) -> None:
    """The run made exactly the releases the selection was calibrated for."""
    entries = result["privacy_ledger"]
    ok = (
        sum(e["count"] for e in entries) == candidate.count
        and all(math.isclose(e["noise_multiplier"], sigma, rel_tol=1e-12) for e in entries)
        and all(e["sample_rate"] == candidate.sample_rate for e in entries)
    )
    if not ok:
        raise DPVisionError(
            "a run made releases other than those it was calibrated for: this is a bug in "
            "dpvision, please report it; nothing was released"
        )
