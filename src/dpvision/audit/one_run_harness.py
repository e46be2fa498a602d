"""``dpvision audit --one-run``: the one-run audit of a training configuration.

One training of dpvision's own code on the audit's D plus a random half of m canaries
(:mod:`dpvision.audit.one_run_targets`), the k highest scores guess "in" and the k lowest
"out", and the number of right guesses bounds ε from below at the stated confidence
(:mod:`dpvision.audit.one_run`; Steinke, Nasr & Jagielski 2023).
"""

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpvision.audit.harness import audit_config, check_counts, verdict
from dpvision.audit.one_run import audit_one_run
from dpvision.audit.one_run_targets import ONE_RUN_CANARIES, make_one_run_target
from dpvision.audit.plot import score_histogram
from dpvision.config import TrainConfig
from dpvision.data.core import ImageDataset
from dpvision.errors import DPVisionError
from dpvision.seeds import public_rng


@dataclasses.dataclass(frozen=True)
class OneRunSettings:
    """The size of a one-run audit.

    Attributes:
      dataset_size: |D|, the first examples of the config's dataset.
      canaries: m.
      canary: ``dirac`` (white-box) or ``mislabeled`` (black-box); None: ``dirac``.
      guesses: k, guesses "in" and as many "out" (fixed before any score is seen).
      confidence: probability that the reported lower bound is valid.
      delta: δ of the claim (None: the config's δ).
      seed: seeds the canaries, the coins and the training.
    """

    dataset_size: int = 100
    canaries: int = 1000
    canary: str | None = None
    guesses: int = 100
    confidence: float = 0.95
    delta: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_counts(self, ("dataset_size", "canaries", "guesses"), minimum=1)
        if 2 * self.guesses > self.canaries:
            raise DPVisionError(
                f"--guesses {self.guesses} in and {self.guesses} out need at least "
                f"{2 * self.guesses} canaries, got {self.canaries}"
            )
        if self.canary is not None and self.canary not in ONE_RUN_CANARIES:
            raise DPVisionError(
                f"unknown one-run canary {self.canary!r}; choose from {', '.join(ONE_RUN_CANARIES)}"
            )


def one_run_config(
    file: str | Path | None, flags: dict[str, Any], sets: Sequence[str], settings: OneRunSettings
) -> TrainConfig:
    """The config a one-run audit trains: :func:`~dpvision.audit.harness.audit_config`'s,
    with Dirac canaries on raw features (``preprocessing.kind = 'none'``) and, for
    ``dp-sgd``, full batches of the |D| + m examples (q = 1, where the one-run bound is
    sharpest); anything the user sets wins."""
    method = audit_config(file, flags, sets)[0].method
    defaults = []
    if method == "dp-sgd":
        full = settings.dataset_size + settings.canaries
        defaults += [f"learner.batch_size={full}", f"learner.physical_batch_size={full}"]
    elif (settings.canary or "dirac") == "dirac":
        defaults.append("preprocessing.kind='none'")
    return audit_config(file, flags, [*defaults, *sets])[0]


def run_one_run_audit(
    config: TrainConfig,
    settings: OneRunSettings,
    *,
    histogram: str | Path | None = None,
) -> dict[str, Any]:
    """Audits the training ``config`` describes in one run; returns the report (JSON-ready).

    Privacy: the audit data and canaries are the auditor's own; the claim is the ledger of
    the audited run, checked to be what ran.
    """
    start = time.perf_counter()
    config, dataset, target = _prepare(config, settings)
    delta = config.delta
    coins = public_rng(settings.seed, "one-run audit coins")
    included = coins.random(settings.canaries) < 0.5
    trained = time.perf_counter()
    scores = target.scores(included, settings.seed)
    train_seconds = time.perf_counter() - trained
    result = audit_one_run(
        scores,
        included,
        guess_in=settings.guesses,
        guess_out=settings.guesses,
        delta=delta,
        confidence=settings.confidence,
    )
    timings = {"train_seconds": train_seconds, "wall_seconds": time.perf_counter() - start}
    report = _report(config, settings, dataset.name, target, scores, included, result, timings)
    if histogram is not None:
        score_histogram(report, histogram)
        report["histogram"] = str(histogram)
    return report


def _prepare(
    config: TrainConfig, settings: OneRunSettings
) -> tuple[TrainConfig, ImageDataset, Any]:
    """The config at the audit's δ, its dataset and the one-run target (checked first:
    features with images, an audit dataset the training set can hold)."""
    if config.features.strip().startswith("precomputed"):
        raise DPVisionError(
            "the audit builds its canaries from images; precomputed feature vectors have "
            "none: audit with pixels, scatternet or encoder features"
        )
    delta = settings.delta if settings.delta is not None else config.delta
    config = dataclasses.replace(config, delta=delta)
    dataset = config.load_dataset()
    if settings.dataset_size > dataset.num_train:
        raise DPVisionError(
            f"the audit dataset size {settings.dataset_size} exceeds the {dataset.num_train} "
            f"training examples of {dataset.name}"
        )
    return (
        config,
        dataset,
        make_one_run_target(
            config,
            dataset,
            size=settings.dataset_size,
            canaries=settings.canaries,
            canary=settings.canary,
            seed=settings.seed,
        ),
    )


def _report(
    config: TrainConfig,
    settings: OneRunSettings,
    dataset_name: str,
    target: Any,
    scores: np.ndarray,
    included: np.ndarray,
    result: dict[str, Any],
    timings: dict[str, float],
) -> dict[str, Any]:
    """The one-run audit's report: the claim, the guesses and the bound, the timings."""
    order = np.argsort(-scores, kind="stable")
    claim = target.claim
    return {
        "audit": "one-run",
        "method": config.method,
        "dataset": dataset_name,
        "dataset_size": settings.dataset_size,
        "canary": settings.canary or "dirac",
        "score": target.score,
        "canaries": settings.canaries,
        "included": int(included.sum()),
        "guess_in": settings.guesses,
        "guess_out": settings.guesses,
        "guesses": result["guesses"],
        "correct": result["correct"],
        "claimed_epsilon": claim.epsilon,
        "target_epsilon": config.epsilon,
        "delta": config.delta,
        "accountant": claim.accountant,
        "noise_multiplier": claim.noise_multiplier,
        "steps": claim.steps,
        "sample_rate": claim.sample_rate,
        "epsilon_lower_bound": result["epsilon_lower_bound"],
        "confidence": settings.confidence,
        "violation": result["epsilon_lower_bound"] > claim.epsilon,
        "threshold_in": float(scores[order[settings.guesses - 1]]),
        "threshold_out": float(scores[order[-settings.guesses]]),
        **timings,
        "seed": settings.seed,
        "privacy_ledger": claim.ledger,
        "config": config.to_dict(),
        "scores_included": scores[included].tolist(),
        "scores_excluded": scores[~included].tolist(),
    }


def one_run_summary(report: dict[str, Any]) -> str:
    """A few readable lines about a one-run audit report."""
    claimed_text, verdict_text = verdict(report)
    return (
        f"one-run audit of {report['method']} on {report['dataset_size']} examples of "
        f"{report['dataset']} + {report['canaries']} {report['canary']} canaries "
        f"({report['included']} drawn in)\n"
        f"claimed ε = {claimed_text} at δ = {report['delta']:.3g}; ε lower bound "
        f"{report['epsilon_lower_bound']:.4f} at {100 * report['confidence']:g} % confidence "
        f"({report['correct']} of {report['guesses']} guesses right): {verdict_text}\n"
        f"score: {report['score']}\n"
        f"wall time {report['wall_seconds']:.1f} s (training {report['train_seconds']:.1f} s)"
    )
