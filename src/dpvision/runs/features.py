"""``dpvision train`` with a feature learner: dataset → features → (private)
preprocessing → DP-LS, DP-Newton, DP-FC or DP-SGD-linear → result (DESIGN.md)."""

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dpvision.accounting import PrivacyLedger, default_accountant, zcdp_epsilon
from dpvision.accounting.gaussian import is_unsampled_gaussian
from dpvision.config import TrainConfig
from dpvision.data.rows import Rows
from dpvision.data.splits import training_rows
from dpvision.distributed import current
from dpvision.errors import DPVisionError
from dpvision.features import feature_shape, load_or_extract, parse_feature_spec
from dpvision.features.backbone import encoder_digest, feature_source
from dpvision.features.precomputed import load_feature_files
from dpvision.features.preprocessing import FittedPreprocessing, preprocess
from dpvision.features.spec import NETWORK_FEATURES
from dpvision.learners import LEARNERS
from dpvision.learners.memory import gigabytes
from dpvision.log import say
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.runs.saved import TrainedModel, privacy_of
from dpvision.runs.validation import ValidationRelease
from dpvision.runs.weight_rows import weight_rows


def _channels(config: TrainConfig, dataset: Any, spec: Any) -> int:
    if config.preprocessing.channels is not None:
        return config.preprocessing.channels
    if spec.projection_dim is not None:
        return 1  # a random projection has no channel structure
    image_shape = tuple(dataset.train_images.shape[1:])
    return int(feature_shape(image_shape, replace(spec, flatten=False))[0])


def run_features(
    config: TrainConfig,
    *,
    quiet: bool,
    checkpoint: str | Path | None,
    secret: SecretRandomness,
    validation: ValidationRelease | None = None,
) -> tuple[dict[str, Any], TrainedModel]:
    """Trains a feature learner; returns the result dict (DESIGN.md) and the model.

    Privacy: the preprocessing and the learner release what :func:`fit_learner` says, the
    validation accuracy a noisy count (:mod:`dpvision.runs.validation`); every noise and
    the validation split's coins come from ``secret``.
    """
    if checkpoint is not None:
        raise DPVisionError(
            f"--checkpoint is for --method dp-sgd and dp-randp, not {config.method}"
        )
    start = time.perf_counter()
    workers = current()
    quiet = quiet or not workers.is_main
    significant = {k: v for k, v in config.to_dict().items() if k != "data_dir"}
    workers.check_agree(significant, "the configuration")
    spec = parse_feature_spec(config.features)
    dataset, train, test, channels, source, also_public = _features(config, spec, workers, quiet)
    say(
        f"training {config.method} on {train.shape[1]} features "
        f"(target ε = {config.epsilon if config.epsilon is not None else 'from σ'}, "
        f"δ = {config.delta:g})",
        quiet,
    )
    train, train_labels, test, validation_labels = _held_out(
        config, dataset, spec, (train, test), secret, also_public
    )
    held = len(validation_labels)
    fitted = fit_learner(
        config,
        train,
        train_labels,
        test,
        channels,
        dataset.num_classes,
        secret=secret,
        validations=1 if held else 0,
        validation=validation,
    )
    learner, test = fitted.learner, fitted.test
    scores: dict[str, Any] = {}
    if held:
        exact = float(learner.score(test[:held], validation_labels))
        released = fitted.validation.accuracy(exact, held)
        if fitted.validation.mode != "selection":
            scores["validation_accuracy"] = released
            scores["n_validation"] = held
            scores.update(fitted.validation.summary())
        test = test[held:]
    result = _result(config, dataset, fitted, test, train_labels, scores, secret, start)
    return result, _model(config, dataset, spec, fitted, result, source)


def _features(
    config: TrainConfig, spec: Any, workers: Any, quiet: bool
) -> tuple[Any, Any, Any, int, Any, Any]:
    """(dataset, train features, test features, channels, the network source or None, the
    rows public as copies of the weights' rows or None): precomputed vectors read, or the
    dataset loaded and its features extracted (rank 0 first under torchrun), after the
    learner's memory check.

    Privacy:
      Extraction is data-independent and releases nothing (see
      :func:`~dpvision.features.cache.load_or_extract`).
    """
    source, also_public = None, None
    if spec.name == "precomputed":
        assert spec.path is not None  # checked by FeatureSpec
        say(f"reading precomputed features of {config.dataset} from {spec.path}", quiet)
        dataset: Any = load_feature_files(spec.path, config.dataset, config.num_classes)
        train, test = dataset.train, dataset.test
        channels = config.preprocessing.channels or 1  # vectors: no channel structure
    else:
        say(f"loading dataset {config.dataset}", quiet)
        dataset = config.load_dataset()
        source = feature_source(spec) if spec.name in NETWORK_FEATURES else None
        # copies of the weights' public rows are public too
        also_public = weight_rows(config, dataset, source, what=f"the {spec.name} weights")
        # The learner's d×d matrices must fit: refused (or warned of) before the extraction.
        learner = LEARNERS[config.method](
            num_classes=dataset.num_classes, device=str(config.placement.device), **config.learner
        )
        d = int(np.prod(feature_shape(tuple(dataset.train_images.shape[1:]), spec)))
        learner.check_resources(dataset.num_train, d, noisy=not config.noise_off)
        say(_memory_estimate(learner, dataset.num_train, dataset.num_test, d), quiet)
        say(
            f"features {config.features} for {dataset.num_train} + {dataset.num_test} images",
            quiet,
        )
        # Under torchrun rank 0 extracts and caches the features, then the others read them.
        device = str(config.placement.device)
        train, test = workers.main_first(
            lambda: load_or_extract(dataset, spec, progress=not quiet, device=device)
        )
        channels = _channels(config, dataset, spec)
    return dataset, train, test, channels, source, also_public


def _memory_estimate(learner: Any, num_train: int, num_test: int, d: int) -> str:
    """One line: the run's peak memory before it starts, the features (one float32 array
    for the training rows, one for the held-out and test rows, as the preprocessing makes
    them) and the learner's own (its :class:`~dpvision.learners.memory.Footprint`).

    Privacy: from the shape (n, d, m), public."""
    features = 4.0 * d * (num_train + num_test)
    footprint = learner.footprint(num_train, d)
    own = footprint.bytes if footprint is not None else 0.0
    return (
        f"memory: about {gigabytes(features + own)} at the peak ({gigabytes(features)} of "
        f"float32 features, {gigabytes(own)} for the learner)"
    )


def _held_out(
    config: TrainConfig,
    dataset: Any,
    spec: Any,
    features: tuple[Any, Any],
    secret: SecretRandomness,
    also_public: Any,
) -> tuple[Any, np.ndarray, Any, np.ndarray]:
    """(training features, their labels, the held-out then test features, the held-out
    labels), the features as :class:`~dpvision.data.rows.Rows` views where they are parts
    of the cached arrays: each training row's side (public, validation, training) from its own keyed
    hash under ``secret``'s split key, after binding ``secret`` to the rows.

    Privacy:
      Which rows a mechanism sees does not change when another example is added or
      removed (:func:`~dpvision.runs.inputs.training_rows`); releases nothing.
    """
    train, test = features
    validation_labels = np.zeros(0, dtype=np.int64)
    train_labels = np.asarray(dataset.train_labels)
    identity = train if spec.name == "precomputed" else dataset.row_images
    # A replayable run on other rows draws other noise; the split keys stay the same.
    secret.bind_rows(lambda: (identity, train_labels))
    # Each example's side is its own keyed hash (images, or the precomputed feature rows).
    split = training_rows(
        identity,
        train_labels,
        public_fraction=config.public_fraction,
        validation_fraction=config.validation_fraction,
        key=secret.split_key(),
        also_public=also_public,
    )
    rows, kept = split.train, split.validation
    # Views, read once by the preprocessing into the one array each becomes (no copies).
    if len(kept):
        # The held-out rows go through the same (released) preprocessing as the test set.
        validation_labels = train_labels[kept]
        test = Rows.of(train, kept) + Rows.of(test)
    if len(rows) < len(train_labels):
        train, train_labels = Rows.of(train, rows), train_labels[rows]
    return train, train_labels, test, validation_labels


def _result(
    config: TrainConfig,
    dataset: Any,
    fitted: "FittedLearner",
    test: Any,
    train_labels: np.ndarray,
    scores: dict[str, Any],
    secret: SecretRandomness,
    start: float,
) -> dict[str, Any]:
    """The result dict (DESIGN.md): the test accuracy, the released ``scores``, the
    privacy figures and ledger, the config."""
    learner, train, prior = fitted.learner, fitted.train, fitted.prior
    workers = current()
    accuracy = float(learner.score(test, dataset.test_labels))
    own = learner.privacy_ledger_.entries[len(prior.entries) :] or learner.privacy_ledger_.entries
    return {
        "dataset": dataset.name,
        "method": config.method,
        "features": config.features,
        "test_accuracy": accuracy,
        **scores,
        "epsilon": learner.epsilon_,
        "delta": config.delta,
        "accountant": config.accountant or _auto_accountant(learner.privacy_ledger_),
        "noise_multiplier": learner.noise_multiplier_,
        "final_clip_norm": getattr(learner, "final_clip_norm_", None),
        "steps": learner.privacy_ledger_.total_count - prior.total_count,
        "sample_rate": own[-1].sample_rate,
        "n_train": len(train_labels),
        "n_test": int(dataset.num_test),
        "num_features": int(train.shape[1]),
        "seed": config.seed,
        "secret_randomness": secret.source,
        "wall_seconds": time.perf_counter() - start,
        "world_size": workers.world_size,
        "device": config.placement.describe(),
        "epsilon_zcdp": _zcdp_figure(learner.privacy_ledger_, config.delta),
        "privacy_ledger": learner.privacy_ledger_.to_dict()["entries"],
        "config": config.to_dict(),
    }


def _model(
    config: TrainConfig,
    dataset: Any,
    spec: Any,
    fitted: "FittedLearner",
    result: dict[str, Any],
    source: Any,
) -> TrainedModel:
    """The saved model: the learner's released coefficients and the public preprocessing."""
    learner = fitted.learner
    return TrainedModel(
        method=config.method,
        dataset=dataset.name,
        num_classes=int(dataset.num_classes),
        image_shape=None if spec.name == "precomputed" else tuple(dataset.train_images.shape[1:]),
        features=config.features,
        preprocessing=fitted.preprocessing,
        privacy=privacy_of(result),
        config=config.to_dict(),
        coef=learner.coef_,
        intercept=learner.intercept_,
        encoder_sha256=encoder_digest(source) if source is not None else None,
        class_names=getattr(dataset, "class_names", None),
    )


class FittedLearner(NamedTuple):
    """What :func:`fit_learner` returns."""

    learner: Any  # the fitted DPLinearClassifier
    train: np.ndarray  # the preprocessed training features
    test: np.ndarray  # the preprocessed held-out features
    prior: PrivacyLedger  # the ledger of the preprocessing (and planned validation counts)
    preprocessing: FittedPreprocessing
    validation: ValidationRelease


def fit_learner(
    config: TrainConfig,
    train: "np.ndarray | Rows",
    train_labels: np.ndarray,
    test: "np.ndarray | Rows",
    channels: int,
    num_classes: int,
    *,
    secret: SecretRandomness | None = None,
    validations: int = 0,
    validation: ValidationRelease | None = None,
) -> FittedLearner:
    """Private preprocessing and the feature learner of ``config``, fitted on ``train``.

    The one path from features to a fitted learner: ``dpvision train`` and ``dpvision
    audit`` both call it.

    Privacy:
      Releases the model and the preprocessing statistics (see :func:`preprocess`), all
      recorded in ``learner.privacy_ledger_``; with a target ε the learner's σ is calibrated
      so that everything together meets (ε, δ), the ``validations`` noisy validation
      counts planned in it too. ``test`` is only transformed. The noise comes from
      ``secret`` (None: from ``config.secret_seed``, else fresh OS entropy).
    """
    if secret is None:
        secret = config.secret_randomness()
    secret.bind_rows(lambda: (train, train_labels))  # a no-op when the run bound its rows
    ledger = PrivacyLedger()
    train, test, fitted = preprocess(
        config.preprocessing,
        train,
        test,
        channels,
        ledger,
        secret.noise("preprocessing"),
        noise_off=config.noise_off,
    )
    released = ValidationRelease.plan(config, validations, ledger, secret, validation)
    target = config.epsilon
    kind = LEARNERS[config.method]
    # Poisson coins that do not depend on the rows, as the DP-SGD engine's (secret.py).
    coins = {"sampling_state": secret.coin_seed("sampler")}
    learner = kind(
        target_epsilon=target,
        target_delta=config.delta,
        noise_multiplier=None if target is not None else config.noise_multiplier,
        accountant=config.accountant,
        random_state=secret.seed("learner"),
        num_classes=num_classes,
        device=str(config.placement.device),
        **(coins if "sampling_state" in kind._get_param_names() else {}),
        **config.learner,
    )
    try:
        learner.fit(train, train_labels, prior_ledger=ledger)
    except TypeError as error:  # a learner option of the wrong type
        raise DPVisionError(f"learner options for {config.method}: {error}") from None
    return FittedLearner(learner, train, test, ledger, fitted, released)


def _zcdp_figure(ledger: PrivacyLedger, delta: float) -> float | None:
    """The zCDP ε Mehta et al. report, for comparison; None for Poisson-sampled runs."""
    event = ledger.dp_event()
    if not ledger.is_private or not is_unsampled_gaussian(event):
        return None
    return zcdp_epsilon(event, delta=delta)


def _auto_accountant(ledger: PrivacyLedger) -> str:
    return default_accountant(ledger.dp_event()).value
