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
"""

import contextlib
import dataclasses
import logging
import math
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpvision.config import TrainConfig, resolve, validate
from dpvision.errors import DPVisionError
from dpvision.log import say
from dpvision.mechanisms import SecureRandom
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.runs.saved import TrainedModel, privacy_of
from dpvision.runs.search import Search, TuneSettings, parse_distribution, parse_search, set_items
from dpvision.runs.selection_plan import Candidate, SelectionPlan, plan_selection
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
    if base.epsilon is None or not math.isfinite(base.epsilon):
        raise DPVisionError("dpvision tune needs a finite target ε: the budget of the whole search")
    if not base.validation_fraction:
        base = dataclasses.replace(base, validation_fraction=DEFAULT_VALIDATION_FRACTION)
    secret = base.secret_randomness()  # secret_seed and this config, else fresh OS bits
    plan = plan_selection(base, search, settings, secret)
    say(
        f"tune: {len(plan.candidates)} candidates, a secret number of runs K "
        f"({plan.repetitions.describe()}), σ × {plan.scale:.4g} over one run's, score noise "
        f"σ_v = {plan.score_noise:.4g} on {plan.num_validation} validation examples; "
        f"ε = {plan.epsilon:.4f} for the whole search",
        quiet,
    )
    public = {
        "epsilon": plan.epsilon,
        "delta": base.delta,
        "accountant": "rdp",
        "privacy_ledger": plan.ledger.to_dict()["entries"],
        "secret_randomness": secret.source,
    }
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
    coins = secret.numpy("tune coins")
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
    """Withholds every log record and Python warning while a run trains: a run is quiet,
    but a warning (e.g. the feature cache's) would still be printed once per run of some
    candidates, and their number and kind would tell K and the candidates drawn."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(record=True):  # recorded, then dropped with the run
            yield
    finally:
        logging.disable(previous)


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
            f"candidate {candidate.index} made releases other than the {candidate.count} at "
            f"q = {candidate.sample_rate:g}, σ = {sigma:.6g} it was calibrated for: this is a "
            "bug in dpvision, please report it; nothing was released"
        )
