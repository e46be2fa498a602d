"""The public plan of a DP-SGD run, fixed before it trains (:func:`prepare_schedule`): its
steps and sampling rate, its σ and its validation counts; and its public seeds and the
settings a checkpoint must match.

Privacy: nothing here reads an example; the numbers come from the config, the weight files'
digests, the number of training rows and the ledger of what was released before.
"""

import dataclasses
import math
from pathlib import Path
from typing import Any

from dpvision.accounting import PrivacyLedger, calibrate_noise_multiplier
from dpvision.config import TrainConfig
from dpvision.config.schema import ADDED_DEFAULTS
from dpvision.data.inputs import TrainingData
from dpvision.errors import DPVisionError
from dpvision.features.backbone import encoder_digest
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.recipes import deep_schedule
from dpvision.runs.validation import ValidationRelease
from dpvision.seeds import public_seeds
from dpvision.training.options import DPSGDOptions, names_before_rename


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The public schedule: ``steps`` logical steps Poisson-sampled at ``sample_rate`` from
    ``num_examples`` training rows, each with noise multiplier ``sigma``."""

    num_examples: int
    sample_rate: float
    steps: int
    sigma: float


def prepare_schedule(
    config: TrainConfig,
    data: TrainingData,
    secret: SecretRandomness,
    validation: ValidationRelease | None,
) -> tuple[Schedule, ValidationRelease]:
    """The steps, q and σ of a DP-SGD run on ``data``, and its validation releases
    (``validation``: tune's selection mode).

    Privacy: the validation counts are recorded in ``data.ledger`` first, then σ is
    calibrated so that the ledger's preprocessing, those counts and the steps together meet
    the config's (ε, δ) (:func:`noise_multiplier_for`).
    """
    options, num_train = config.dpsgd, len(data.train_y)
    if options.batch_size > num_train:
        # N is public (the result reports it): the dp-sgd recipe's batch for it.
        suggested = deep_schedule(num_train, config.epsilon)["batch_size"]
        raise DPVisionError(
            f"learner.batch_size {options.batch_size} exceeds the {num_train} training "
            f"examples; try --set learner.batch_size={suggested} (the dp-sgd recipe's, "
            "when batch_size is left unset)"
        )
    steps, sample_rate = steps_and_rate(options, num_train)
    released = ValidationRelease.plan(
        config,
        validation_count(config, options, steps, data.validation_y is not None),
        data.ledger,
        secret,
        validation,
    )
    sigma = noise_multiplier_for(config, sample_rate, steps, data.ledger)
    return Schedule(num_train, sample_rate, steps, sigma), released


def run_seeds(seed: int) -> dict[str, int]:
    """Independent seeds for the *public* randomness (initialisation, augmentation), derived
    from the run's public seed; the noise and the sampling never come from it."""
    return public_seeds(seed, "dp-sgd run", ("init", "augment"))


def run_settings(config: TrainConfig) -> dict[str, Any]:
    """What changes a run: the config without where the data are, what it reproduces, and
    the performance knobs; with a DP-RandP encoder, that file's digest. A checkpoint is
    resumed only by a run of the same settings."""
    data = config.to_dict()
    data.pop("data_dir", None)
    data.pop("reference", None)  # what the run reproduces, not how it runs
    for name in ("validation_fraction", "public_fraction"):
        if not data.get(name):  # as before the option existed: old checkpoints resume
            data.pop(name, None)
    for name, default in ADDED_DEFAULTS.items():  # image geometry, test_fraction: as above
        if data.get(name) == default:
            data.pop(name, None)
    if config.dataset.strip().lower().startswith("imagefolder:"):
        # Before split_seed, a single tree's split was keyed by the seed: a checkpoint from
        # then resumes only a run whose split_seed is its seed (the same training side).
        data.pop("split_seed", None)
        if config.split_seed != config.seed:
            data["split_seed"] = config.split_seed
    if config.image_size is not None:  # the splits read the rows at their own size (issue 40)
        data["row_identity"] = "native"
    options = config.dpsgd
    # Under the options' former names, so that checkpoints written before the rename resume.
    data["learner"] = names_before_rename(options.run_settings())
    for key in ("encoder", "init"):
        path = getattr(options, key)
        if path is not None and Path(path).is_file():
            # A run resumes only from the very same weights, not another file at the path.
            data["learner"][f"{key}_sha256"] = encoder_digest(path)
    return data


def steps_and_rate(options: DPSGDOptions, num_train: int) -> tuple[int, float]:
    """(steps, q) of a DP-SGD run on ``num_train`` rows: q = B/N, and ``learner.steps`` or
    enough steps for ``learner.epochs`` expected passes (⌈epochs/q⌉)."""
    sample_rate = options.batch_size / num_train
    if options.steps is not None:
        return int(options.steps), float(sample_rate)
    assert options.epochs is not None  # DPSGDOptions.validated: one of steps and epochs
    return math.ceil(options.epochs / sample_rate), float(sample_rate)


def noise_multiplier_for(
    config: TrainConfig, sample_rate: float, steps: int, prior: PrivacyLedger
) -> float:
    """σ of the DP-SGD steps: 0 with the noise off, the config's σ, or σ calibrated so that
    ``prior`` (private preprocessing) and ``steps`` Poisson-sampled steps at ``sample_rate``
    together meet the config's (ε, δ)."""
    if config.noise_off:
        return 0.0
    if config.noise_multiplier is not None:
        return config.noise_multiplier
    assert config.epsilon is not None
    return calibrate_noise_multiplier(
        target_epsilon=config.epsilon,
        target_delta=config.delta,
        sample_rate=sample_rate,
        steps=steps,
        accountant=config.accountant,
        preceding_event=prior.dp_event() if len(prior) else None,
    )


def validation_count(
    config: TrainConfig, options: DPSGDOptions, steps: int, has_validation: bool
) -> int:
    """How many validation counts a run releases: one per evaluation of the validation
    split (every ``eval_every`` steps before the end, and the final one), two each with an
    EMA (the raw and the averaged parameters). dp-randp's Phase II switch shows no
    validation accuracy (its step is known only once σ is)."""
    if not has_validation:
        return 0
    every = options.performance.eval_every
    evaluations = 1 + (len(range(every, steps, every)) if every else 0)
    return evaluations * (2 if options.ema_decay > 0 else 1)
