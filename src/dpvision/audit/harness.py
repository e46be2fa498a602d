"""The two-phase audit of De et al. (2022, App. A.2), after Tramèr et al. (2022).

Phase I (design): for every canary kind and every combination of the swept
hyper-parameters, train ``phase1_runs`` models on D and as many on D', fit a Gaussian to
each side's canary losses and keep the configuration whose two Gaussians are furthest apart
in total variation. Any configuration is a valid target: the guarantee holds for all of
them, so choosing the most revealing one is the adversary's right.

Phase II (measure): with the chosen configuration, train ``runs`` fresh models on each of
D and D' (seeds disjoint from phase I), choose the threshold on the first
``selection_fraction`` of them and report, on the rest, the Clopper-Pearson ε lower bound,
the membership AUC and advantage, beside the claimed ε and the advantage it allows.
"""

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpvision.audit.canaries import CANARIES, make_audit_data
from dpvision.audit.plot import loss_histogram
from dpvision.audit.statistics import (
    advantage_upper_bound,
    audit_scores,
    gaussian_tv_distance,
)
from dpvision.audit.targets import AuditTarget, make_target
from dpvision.config import TrainConfig, load_toml, override, parse_override, resolve
from dpvision.errors import DPVisionError
from dpvision.features import Progress, feature_shape, parse_feature_spec
from dpvision.learners import LEARNERS, DPLinearClassifier
from dpvision.learners.memory import WARN_SECONDS, fits, gigabytes
from dpvision.log import logger, say
from dpvision.recipes import AUTO
from dpvision.runs.auto import apply_recipe


@dataclasses.dataclass(frozen=True)
class AuditSettings:
    """How much an audit trains, and what it sweeps.

    Attributes:
      dataset_size: |D|, the first examples of the config's dataset.
      canaries: canary kinds tried in phase I (``blank``, ``noise``, ``mislabeled``).
      canary_label: label of the ``blank`` and ``noise`` canaries.
      sweep: config keys (as for ``--set``) and the values phase I tries for each.
      phase1_runs: models per side for each phase-I candidate.
      runs: models per side in phase II.
      confidence: probability that the reported lower bound is valid.
      selection_fraction: share of phase-II runs that choose the threshold.
      delta: δ of the claim (None: 1/|D|, as in De et al.).
      seed: seeds everything.
    """

    dataset_size: int = 100
    canaries: tuple[str, ...] = ("blank",)
    canary_label: int = 0
    sweep: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    phase1_runs: int = 200
    runs: int = 1000
    confidence: float = 0.999
    selection_fraction: float = 0.1
    delta: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_counts(self, ("phase1_runs", "runs", "dataset_size"), minimum=2)
        unknown = [c for c in self.canaries if c not in CANARIES]
        if unknown or not self.canaries:
            raise DPVisionError(
                f"unknown canary {', '.join(unknown) or '(none)'}; choose from "
                f"{', '.join(CANARIES)}"
            )

    def candidates(self) -> list[tuple[str, tuple[str, ...]]]:
        """Every (canary, ``--set`` items) combination phase I tries."""
        keys = [key for key, _ in self.sweep]
        grids = [values for _, values in self.sweep]
        combos = [
            tuple(f"{key}={_toml(value)}" for key, value in zip(keys, values, strict=True))
            for values in itertools.product(*grids)
        ]
        return [(canary, combo) for canary in self.canaries for combo in combos]


def check_counts(settings: Any, names: Sequence[str], *, minimum: int) -> None:
    """Raises a one-line error unless each of ``names`` is a whole number ≥ ``minimum`` and
    ``settings.confidence`` is in (0, 1)."""
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise DPVisionError(f"{name.replace('_', '-')} must be a whole number >= {minimum}")
    if not 0 < settings.confidence < 1:
        raise DPVisionError(f"confidence must be in (0, 1), got {settings.confidence}")


# What an audit trains when the user does not say: small enough for thousands of runs.
# dp-sgd follows De et al.'s |D| = 100 setting (Table 8: batch 64, 50-100 updates) with a
# small MLP on the pixels, plain SGD (every schedule option set: the dp-sgd recipe of a
# training run fills none of them); the feature learners keep their own defaults.
AUDIT_DEFAULTS: dict[str, tuple[str, ...]] = {
    "dp-sgd": (
        "learner.model='mlp-32'",
        "learner.batch_size=64",
        "learner.physical_batch_size=64",
        "learner.steps=50",
        "learner.learning_rate=1.0",
        "learner.max_grad_norm=1.0",
        "learner.optimizer='sgd'",
        "learner.momentum=0.0",
        "learner.normalization='none'",
    ),
}

# Phase I's default grid (De et al. Table 8 swept learning rate, clipping norm and updates).
DEFAULT_SWEEPS: dict[str, tuple[tuple[str, tuple[Any, ...]], ...]] = {
    "dp-sgd": (("learner.learning_rate", (0.5, 1.0)), ("learner.max_grad_norm", (0.1, 1.0))),
    "dp-ls": (("learner.clip_norm", (1.0, 10.0)),),
    "dp-newton": (("learner.clip_norm", (1.0, 10.0)),),
    "dp-fc": (("learner.clip_norm", (1.0, 10.0)),),
    "dp-sgd-linear": (("learner.clip_norm", (1.0, 10.0)),),
}


def audit_config(
    file: str | Path | None, flags: dict[str, Any], sets: Sequence[str]
) -> tuple[TrainConfig, tuple[tuple[str, tuple[Any, ...]], ...]]:
    """The config to audit and phase I's default sweep: the defaults of ``dpvision train`` <
    :data:`AUDIT_DEFAULTS` < the TOML file < flags < ``--set``. Keys the user set are not
    swept by default."""
    given = {".".join(parse_override(item)[0]) for item in sets}
    raw = load_toml(file) if file is not None else {}
    learner = raw.get("learner", {})
    given |= {f"learner.{key}" for key in (learner if isinstance(learner, dict) else {})}
    method = resolve(file, flags, list(sets)).method
    auto, chosen = method == AUTO, list(sets)
    if auto:  # an audit trains thousands of times: DP-LS on pixels, not the recipe
        method, chosen = "dp-ls", ["method='dp-ls'", *sets]
    config = _audited(file, flags, chosen, given, method)
    if auto and not config.features.strip().startswith("precomputed"):  # refused later
        learner, d = _learner(config, config.load_dataset())
        # |D| is the audit's (default 100) plus a canary; n matters little next to d².
        footprint = learner.footprint(101, d, noisy=not config.noise_off)
        if not fits(footprint, str(config.placement.device)):
            # The d×d matrices of DP-LS would not fit: the audit of ``auto`` trains the
            # recipe's method, whose memory is linear in d, instead.
            assert footprint is not None
            say(
                f"audit: DP-LS on {d} features would need {gigabytes(footprint.bytes)}; "
                "auditing dp-sgd-linear (memory linear in d) instead"
            )
            method = "dp-sgd-linear"
            config = _audited(file, flags, ["method='dp-sgd-linear'", *sets], given, method)
    sweep = tuple((k, v) for k, v in DEFAULT_SWEEPS.get(method, ()) if k not in given)
    return config, sweep


def _audited(
    file: str | Path | None,
    flags: dict[str, Any],
    sets: Sequence[str],
    given: set[str],
    method: str,
) -> TrainConfig:
    """The config of ``method`` with the audit's defaults for what the user did not set."""
    defaults = [
        item
        for item in AUDIT_DEFAULTS.get(method, ())
        if ".".join(parse_override(item)[0]) not in given
    ]
    config, _ = apply_recipe(resolve(file, flags, [*defaults, *sets]))
    return config


def _learner(config: TrainConfig, dataset: Any) -> tuple[DPLinearClassifier, int]:
    """The feature learner ``config`` trains (unfitted) and d, its number of features,
    from the image shape (public): what :func:`check_audit_resources` estimates."""
    spec = parse_feature_spec(config.features)
    d = int(np.prod(feature_shape(tuple(dataset.train_images.shape[1:]), spec)))
    learner = LEARNERS[config.method](
        num_classes=dataset.num_classes, device=str(config.placement.device), **config.learner
    )
    return learner, d


def audit_trainings(settings: AuditSettings) -> int:
    """How many models an audit trains: phase I's runs per side for every candidate (when
    there are several), phase II's runs per side, and one calibration fit per target of a
    feature learner. Public: a function of the settings alone."""
    candidates = len(settings.candidates())
    phase1 = 2 * settings.phase1_runs * candidates + candidates if candidates > 1 else 0
    return phase1 + 2 * settings.runs + 1


def check_audit_resources(config: TrainConfig, dataset: Any, settings: AuditSettings) -> float:
    """Refuses an audit of a feature learner whose d×d matrices do not fit in memory, before
    any feature is extracted, and warns when all its trainings together will be long.
    Returns the estimated seconds of all the fits (0 where not estimated: dp-sgd, whose
    memory is bounded by its chunks of runs).

    Raises:
      DPVisionError: as :meth:`~dpvision.learners.DPLinearClassifier.check_resources`.
    """
    if config.method not in LEARNERS:
        return 0.0
    n = settings.dataset_size + 1
    learner, d = _learner(config, dataset)
    per_fit = learner.check_resources(n, d, noisy=not config.noise_off)
    trainings = audit_trainings(settings)
    total = per_fit * trainings
    if total > WARN_SECONDS:
        logger.warning(
            f"audit: {trainings} trainings of {config.method} on {d} features, about "
            f"{_seconds(per_fit)} each: about {_seconds(total)} in all (fewer --runs or "
            "--phase1-runs, --sweep none, a single --canary, fewer features, or "
            "--set method='dp-sgd-linear' take less)"
        )
    return total


def _seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def parse_sweep(items: Sequence[str]) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """``["learner.learning_rate=0.1,0.5"]`` → ((``learner.learning_rate``, (0.1, 0.5)),)."""
    sweep = []
    for item in items:
        path, raw = parse_override(item)
        text = item.split("=", 1)[1]
        values = tuple(parse_override(f"v={part}")[1] for part in text.split(",") if part.strip())
        if not values:
            raise DPVisionError(f"--sweep {item}: give at least one value")
        del raw
        sweep.append((".".join(path), values))
    return tuple(sweep)


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _gaussian_tv(out: np.ndarray, inside: np.ndarray) -> float:
    return gaussian_tv_distance(
        float(out.mean()), float(out.std()), float(inside.mean()), float(inside.std())
    )


def run_audit(
    config: TrainConfig,
    settings: AuditSettings,
    *,
    progress: bool = True,
    histogram: str | Path | None = None,
) -> dict[str, Any]:
    """Audits the training ``config`` describes; returns the report (a JSON-ready dict).

    Args:
      config: what ``dpvision train`` would run (method, ε, learner options, ...), except
        that it trains on the audit's D or D' and δ defaults to 1/|D|.
      settings: the audit's sizes, canaries and sweep.
      progress: show a progress bar on stderr.
      histogram: where to write the PNG of the phase-II canary losses (None: no plot).
    """
    start = time.perf_counter()
    if config.features.strip().startswith("precomputed"):
        raise DPVisionError(
            "the audit inserts a canary image and extracts its features; precomputed feature "
            "vectors have no images: audit with pixels, scatternet or encoder features"
        )
    delta = settings.delta if settings.delta is not None else 1 / settings.dataset_size
    config = dataclasses.replace(config, delta=delta)
    dataset = config.load_dataset()
    candidates = settings.candidates()
    check_audit_resources(config, dataset, settings)

    def target_for(canary: str, items: tuple[str, ...]) -> AuditTarget:
        data = make_audit_data(
            dataset,
            size=settings.dataset_size,
            canary=canary,
            label=settings.canary_label,
            seed=settings.seed,
        )
        return make_target(override(config, list(items)), data)

    phase1, phase1_seconds, best = _phase_one(candidates, settings, target_for, progress)
    canary, items = candidates[best]
    started = time.perf_counter()
    with Progress(2 * settings.runs, desc="audit phase II", unit="models", enabled=progress) as bar:
        target = target_for(canary, items)
        out = target.canary_losses(False, settings.runs, _seed(settings, 2, 0), bar.update)
        inside = target.canary_losses(True, settings.runs, _seed(settings, 2, 0), bar.update)
    phase2_seconds = time.perf_counter() - started
    result = audit_scores(
        out,
        inside,
        delta=delta,
        confidence=settings.confidence,
        selection_fraction=settings.selection_fraction,
    )
    phases = {
        "phase1": phase1,
        "phase1_runs_per_side": settings.phase1_runs if phase1 else 0,
        "phase1_seconds": phase1_seconds,
        "phase2_seconds": phase2_seconds,
        "wall_seconds": time.perf_counter() - start,
    }
    chosen, losses = (canary, items), (out, inside)
    report = _report(config, settings, dataset.name, target, chosen, result, losses, phases)
    if histogram is not None:
        loss_histogram(out, inside, report, histogram)
        report["histogram"] = str(histogram)
    return report


def _phase_one(
    candidates: list[tuple[str, tuple[str, ...]]],
    settings: AuditSettings,
    target_for: Callable[[str, tuple[str, ...]], AuditTarget],
    progress: bool,
) -> tuple[list[dict[str, Any]], float, int]:
    """Phase I: each candidate (canary, set) trained ``phase1_runs`` times without and with
    the canary; (their rows, the seconds taken, the index of the most distinguishable)."""
    if len(candidates) <= 1:
        return [], 0.0, 0
    phase1: list[dict[str, Any]] = []
    started = time.perf_counter()
    total = 2 * settings.phase1_runs * len(candidates)
    with Progress(total, desc="audit phase I", unit="models", enabled=progress) as bar:
        for index, (canary, items) in enumerate(candidates):
            target = target_for(canary, items)
            seed = _seed(settings, 1, index)
            out = target.canary_losses(False, settings.phase1_runs, seed, bar.update)
            inside = target.canary_losses(True, settings.phase1_runs, seed, bar.update)
            phase1.append(
                {
                    "canary": canary,
                    "set": list(items),
                    "tv_distance": _gaussian_tv(out, inside),
                    "mean_loss_without": float(out.mean()),
                    "mean_loss_with": float(inside.mean()),
                }
            )
    best = max(range(len(phase1)), key=lambda i: phase1[i]["tv_distance"])
    return phase1, time.perf_counter() - started, best


def _report(
    config: TrainConfig,
    settings: AuditSettings,
    dataset_name: str,
    target: AuditTarget,
    chosen: tuple[str, tuple[str, ...]],
    result: Any,
    losses: tuple[np.ndarray, np.ndarray],
    phases: dict[str, Any],
) -> dict[str, Any]:
    """The audit's report: the claim, the bound and its statistics, the phases' timings."""
    claim = target.claim
    return {
        "method": config.method,
        "dataset": dataset_name,
        "dataset_size": settings.dataset_size,
        "canary": chosen[0],
        "canary_label": target.data.canary_label,
        "chosen_set": list(chosen[1]),
        "claimed_epsilon": claim.epsilon,
        "target_epsilon": config.epsilon,
        "delta": config.delta,
        "accountant": claim.accountant,
        "noise_multiplier": claim.noise_multiplier,
        "steps": claim.steps,
        "sample_rate": claim.sample_rate,
        "epsilon_lower_bound": result.epsilon_lower_bound,
        "confidence": result.confidence,
        "violation": result.epsilon_lower_bound > claim.epsilon,
        "membership_auc": result.auc,
        "membership_advantage": result.max_advantage,
        "advantage_at_threshold": result.advantage,
        "advantage_upper_bound": advantage_upper_bound(claim.epsilon, config.delta),
        "threshold": result.threshold,
        "threshold_direction": "loss <= threshold" if result.sign > 0 else "loss >= threshold",
        "fpr": result.fpr,
        "tpr": result.tpr,
        "fpr_upper": result.fpr_upper,
        "tpr_lower": result.tpr_lower,
        "runs_per_side": settings.runs,
        "selection_runs": result.selection_runs,
        "evaluation_runs": result.evaluation_runs,
        **phases,
        "seed": settings.seed,
        "privacy_ledger": claim.ledger,
        "config": config.to_dict(),
        "losses_without": losses[0].tolist(),
        "losses_with": losses[1].tolist(),
    }


def _seed(settings: AuditSettings, phase: int, index: int) -> int:
    state = np.random.SeedSequence([settings.seed, phase, index]).generate_state(1)
    return int(state[0])


def verdict(report: dict[str, Any]) -> tuple[str, str]:
    """(the claimed ε as text, the verdict) of an audit report."""
    claimed = report["claimed_epsilon"]
    text = "∞ (no noise)" if math.isinf(claimed) else f"{claimed:.4f}"
    if report["violation"]:
        return text, "VIOLATION: the lower bound exceeds the claimed ε"
    return text, "no violation found"


def summary(report: dict[str, Any]) -> str:
    """A few readable lines about an audit report."""
    claimed_text, verdict_text = verdict(report)
    return (
        f"audit of {report['method']} on {report['dataset_size']} examples of "
        f"{report['dataset']}, canary {report['canary']} "
        f"({', '.join(report['chosen_set']) or 'config as given'})\n"
        f"claimed ε = {claimed_text} at δ = {report['delta']:.3g}; ε lower bound "
        f"{report['epsilon_lower_bound']:.4f} at {100 * report['confidence']:g} % confidence "
        f"({report['evaluation_runs']} + {report['evaluation_runs']} evaluation runs): "
        f"{verdict_text}\n"
        f"membership AUC {report['membership_auc']:.3f}, advantage "
        f"{report['membership_advantage']:.3f} (at most {report['advantage_upper_bound']:.3f} "
        f"under the claim)\n"
        f"wall time {report['wall_seconds']:.1f} s (phase I {report['phase1_seconds']:.1f} s, "
        f"phase II {report['phase2_seconds']:.1f} s)"
    )
