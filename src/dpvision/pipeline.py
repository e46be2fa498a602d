"""``dpvision train``: dataset → features → (private) preprocessing → learner → result.

The whole path is one function, :func:`run_training`, so the command line, the benchmarks
and the tests run exactly the same code. Its result is the result JSON of DESIGN.md.
"""

import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np

from dpvision.accounting import PrivacyLedger
from dpvision.config import TrainConfig
from dpvision.errors import DPVisionError


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[dpvision] {message}", file=sys.stderr, flush=True)


def _seeds(seed: int) -> tuple[int, int]:
    """Independent seeds for the preprocessing noise and the learner, derived from one seed."""
    a, b = np.random.SeedSequence(seed).generate_state(2, dtype=np.uint64)
    return int(a) % 2**63, int(b) % 2**63


def _noise_off(config: TrainConfig) -> bool:
    return (config.epsilon is not None and math.isinf(config.epsilon)) or (
        config.noise_multiplier == 0
    )


def _channels(config: TrainConfig, dataset: Any, spec: Any) -> int:
    from dataclasses import replace

    from dpvision.features import feature_shape

    if config.preprocessing.channels is not None:
        return config.preprocessing.channels
    if spec.projection_dim is not None:
        return 1  # a random projection has no channel structure
    image_shape = tuple(dataset.train_images.shape[1:])
    return int(feature_shape(image_shape, replace(spec, flatten=False))[0])


def preprocess(
    config: TrainConfig,
    train: np.ndarray,
    test: np.ndarray,
    channels: int,
    ledger: PrivacyLedger,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Applies ``config.preprocessing`` to train and test features, recording private steps.

    Privacy:
      ``group-norm`` is per-example (free). ``private-norm`` and ``center`` release
      statistics of the *training* features with Gaussian noise (see
      :mod:`dpvision.features.normalization`) and record them in ``ledger``; the test
      features are only transformed with those released statistics.
    """
    import torch

    from dpvision.features.normalization import (
        PrivateCentering,
        PrivateNormalizer,
        group_normalize,
    )

    pre = config.preprocessing
    sigma = 0.0 if _noise_off(config) else pre.noise_multiplier
    generator = torch.Generator().manual_seed(seed)
    if pre.kind == "none":
        return train, test
    if pre.kind == "group-norm":
        return (
            group_normalize(train, channels=channels, groups=pre.groups),
            group_normalize(test, channels=channels, groups=pre.groups),
        )
    if pre.kind == "private-norm":
        normalizer = PrivateNormalizer(
            channels=channels,
            noise_multiplier=sigma,
            mean_clip=pre.mean_clip,
            square_clip=pre.square_clip,
        )
        normalizer.fit(train, ledger=ledger, generator=generator)
        return normalizer.transform(train), normalizer.transform(test)
    centering = PrivateCentering(clip_norm=pre.clip_norm, noise_multiplier=sigma)
    centering.fit(train, ledger=ledger, generator=generator)
    return centering.transform(train), centering.transform(test)


def run_training(
    config: TrainConfig, *, quiet: bool = False, checkpoint: str | Path | None = None
) -> dict[str, Any]:
    """Trains and evaluates one configuration; returns the result dict (DESIGN.md contract).

    ``checkpoint`` (``dp-sgd``, ``dp-randp``): a file to resume from when it exists and to
    write to.
    """
    if config.method in ("dp-sgd", "dp-randp"):
        from dpvision.training.trainer import run_dpsgd

        return _within_target(config, run_dpsgd(config, quiet=quiet, checkpoint=checkpoint))
    return _within_target(config, _run_features(config, quiet=quiet, checkpoint=checkpoint))


def _within_target(config: TrainConfig, result: dict[str, Any]) -> dict[str, Any]:
    """The result, after checking that its ledger's ε does not exceed the run's target.

    Calibration guarantees this; the check makes sure no later change can report a run
    as meeting a target it missed.
    """
    target = config.epsilon
    if target is not None and math.isfinite(target) and not result["epsilon"] <= target:
        raise DPVisionError(
            f"the run spent ε = {result['epsilon']:.6g}, more than its target {target:g}: "
            "this is a bug in dpvision, please report it; no result was written"
        )
    return result


def _run_features(
    config: TrainConfig, *, quiet: bool, checkpoint: str | Path | None
) -> dict[str, Any]:
    if checkpoint is not None:
        raise DPVisionError(
            f"--checkpoint is for --method dp-sgd and dp-randp, not {config.method}"
        )
    from dpvision.data import load_dataset
    from dpvision.distributed import current
    from dpvision.features import load_or_extract, parse_feature_spec

    start = time.perf_counter()
    workers = current()
    quiet = quiet or not workers.is_main
    significant = {k: v for k, v in config.to_dict().items() if k != "data_dir"}
    workers.check_agree(significant, "the configuration")
    spec = parse_feature_spec(config.features)
    if spec.name == "precomputed":
        from dpvision.features.precomputed import load_feature_files

        assert spec.path is not None  # checked by FeatureSpec
        _say(f"reading precomputed features of {config.dataset} from {spec.path}", quiet)
        dataset: Any = load_feature_files(spec.path, config.dataset, config.num_classes)
        train, test = dataset.train, dataset.test
        channels = config.preprocessing.channels or 1  # vectors: no channel structure
    else:
        _say(f"loading dataset {config.dataset}", quiet)
        dataset = load_dataset(
            config.dataset,
            config.data_dir,
            num_classes=config.num_classes,
            channels=config.image_channels,
        )
        _say(
            f"features {config.features} for {dataset.num_train} + {dataset.num_test} images",
            quiet,
        )
        # Under torchrun rank 0 extracts and caches the features, then the others read them.
        train, test = workers.main_first(lambda: load_or_extract(dataset, spec, progress=not quiet))
        channels = _channels(config, dataset, spec)
    _say(
        f"training {config.method} on {train.shape[1]} features "
        f"(target ε = {config.epsilon if config.epsilon is not None else 'from σ'}, "
        f"δ = {config.delta:g})",
        quiet,
    )
    learner, train, test, prior = fit_learner(
        config, train, dataset.train_labels, test, channels, dataset.num_classes
    )
    accuracy = float(learner.score(test, dataset.test_labels))
    own = learner.privacy_ledger_.entries[len(prior.entries) :] or learner.privacy_ledger_.entries
    return {
        "dataset": dataset.name,
        "method": config.method,
        "features": config.features,
        "test_accuracy": accuracy,
        "epsilon": learner.epsilon_,
        "delta": config.delta,
        "accountant": config.accountant or _auto_accountant(learner.privacy_ledger_),
        "noise_multiplier": learner.noise_multiplier_,
        "steps": learner.privacy_ledger_.total_count - prior.total_count,
        "sample_rate": own[-1].sample_rate,
        "n_train": int(dataset.num_train),
        "n_test": int(dataset.num_test),
        "num_features": int(train.shape[1]),
        "seed": config.seed,
        "wall_seconds": time.perf_counter() - start,
        "world_size": workers.world_size,
        "epsilon_zcdp": _zcdp_figure(learner.privacy_ledger_, config.delta),
        "privacy_ledger": learner.privacy_ledger_.to_dict()["entries"],
        "config": config.to_dict(),
    }


def fit_learner(
    config: TrainConfig,
    train: np.ndarray,
    train_labels: np.ndarray,
    test: np.ndarray,
    channels: int,
    num_classes: int,
) -> tuple[Any, np.ndarray, np.ndarray, PrivacyLedger]:
    """Private preprocessing and the feature learner of ``config``, fitted on ``train``.

    The one path from features to a fitted learner: ``dpvision train`` and ``dpvision
    audit`` both call it. Returns (the fitted learner, the preprocessed train and test
    features, the ledger of the preprocessing alone).

    Privacy:
      Releases the model and the preprocessing statistics (see :func:`preprocess`), all
      recorded in ``learner.privacy_ledger_``; with a target ε the learner's σ is calibrated
      so that everything together meets (ε, δ). ``test`` is only transformed.
    """
    from dpvision.learners import LEARNERS

    preprocessing_seed, learner_seed = _seeds(config.seed)
    ledger = PrivacyLedger()
    train, test = preprocess(config, train, test, channels, ledger, preprocessing_seed)
    target = config.epsilon
    learner = LEARNERS[config.method](
        target_epsilon=target,
        target_delta=config.delta,
        noise_multiplier=None if target is not None else config.noise_multiplier,
        accountant=config.accountant,
        random_state=learner_seed,
        num_classes=num_classes,
        **config.learner,
    )
    try:
        learner.fit(train, train_labels, prior_ledger=ledger)
    except TypeError as error:  # a learner option of the wrong type
        raise DPVisionError(f"learner options for {config.method}: {error}") from None
    return learner, train, test, ledger


def _zcdp_figure(ledger: PrivacyLedger, delta: float) -> float | None:
    """The zCDP ε Mehta et al. report, for comparison; None for Poisson-sampled runs."""
    from dpvision.accounting import zcdp_epsilon
    from dpvision.accounting.gaussian import is_unsampled_gaussian

    event = ledger.dp_event()
    if not ledger.is_private or not is_unsampled_gaussian(event):
        return None
    return zcdp_epsilon(event, delta=delta)


def _auto_accountant(ledger: PrivacyLedger) -> str:
    from dpvision.accounting import default_accountant

    return default_accountant(ledger.dp_event()).value


@contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Opens a temporary file beside ``path`` that replaces it only when the block succeeds.

    The data are flushed and fsynced before the rename, so ``path`` is either the old file
    or the whole new one, never half-written; on any error the temporary file is removed.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise DPVisionError(f"cannot write {path}: folder {folder} does not exist")
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
    try:
        with os.fdopen(handle, mode) as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(folder, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> None:
    """Writes JSON to ``path`` through a temporary file and a rename: never half-written."""
    with atomic_open(path) as out:
        json.dump(data, out, indent=2, default=_json_default)
        out.write("\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _ema_note(result: dict[str, Any]) -> str:
    if result.get("test_accuracy_ema") is None:
        return ""
    return (
        f" (EMA of the parameters; the last parameters: {100 * result['test_accuracy_last']:.2f} %)"
    )


def _phases_note(result: dict[str, Any]) -> str:
    if "phase2_steps" not in result:
        return ""
    share = result.get("phase2_epsilon_fraction")
    budget = (
        f" (ε₁ = {result['phase2_epsilon']:.4g}, ε₁/ε = {share:.3f})" if share is not None else ""
    )
    return (
        f"phases: encoder {result['encoder']}; Phase II (head) {result['phase2_steps']} steps"
        f"{budget}, Phase III (all) {result['phase3_steps']} steps\n"
    )


def summary(result: dict[str, Any]) -> str:
    """A few readable lines about a result."""
    sigma = result["noise_multiplier"]
    model = f" ({result['model']})" if "model" in result else ""
    privacy = (
        "no noise (ε = ∞): non-private baseline"
        if sigma is None
        else f"ε = {result['epsilon']:.4f} at δ = {result['delta']:g} ({result['accountant']}), "
        f"σ = {sigma:.4g}, {result['steps']} noisy releases at sample rate "
        f"{result['sample_rate']:.4g}"
        + (
            f"; the zCDP bound of the papers gives ε = {result['epsilon_zcdp']:.4f}"
            if result.get("epsilon_zcdp") is not None
            else ""
        )
    )
    return (
        f"{result['method']}{model} on {result['dataset']} ({result['n_train']} train / "
        f"{result['n_test']} test), features {result['features']} "
        f"({result['num_features']} dims)\n"
        f"test accuracy {100 * result['test_accuracy']:.2f} %{_ema_note(result)}\n"
        f"privacy: {privacy}\n"
        f"{_phases_note(result)}"
        f"wall time {result['wall_seconds']:.1f} s"
    )
