"""Validation of a :class:`~dpvision.config.schema.TrainConfig`: the ranges of its fields
(declared in their metadata), the checks that relate several, the learner's options and
the ``[reference]`` table; what is ``auto`` and needs no data is resolved on the way.
"""

import dataclasses
import math
from pathlib import Path
from typing import Any

from dpvision.accounting import parse_accountant
from dpvision.config.schema import DEEP_METHODS, TrainConfig
from dpvision.data.datasets import (
    PATH_PREFIXES,
    check_image_size,
    check_public_shape,
    check_test_fraction,
    dataset_info,
)
from dpvision.data.inputs import dataset_statistics
from dpvision.data.resize import DEFAULTS as GEOMETRY_DEFAULTS
from dpvision.data.resize import parse_image_size
from dpvision.devices import parse_device, parse_precision
from dpvision.errors import DPVisionError
from dpvision.features.preprocessing import PREPROCESSING
from dpvision.learners import LEARNERS
from dpvision.learners.base import DPLinearClassifier
from dpvision.learners.options import check_learner_options
from dpvision.mechanisms.secret import check_secret_seed
from dpvision.options import Interval, check, check_known
from dpvision.recipes import AUTO, RECIPE_METHOD, default_features, default_preprocessing
from dpvision.training.options import current_names, renamed_option
from dpvision.training.pretrain_options import PretrainOptions

__all__ = ["REFERENCE_KEYS", "check_reference", "validate"]

# Phase I options that ``dp-randp`` takes from the run itself rather than from [pretrain].
_PRETRAIN_FROM_RUN = ("model", "groups", "size", "channels")


def _check_public_shape(config: TrainConfig) -> None:
    """The classes and channels come from the registry or the config, never the data."""
    name = config.dataset
    is_path = name.strip().lower().startswith(PATH_PREFIXES)
    if config.features.startswith("precomputed") and not is_path:
        if dataset_info(name) is None and config.num_classes is None:
            raise DPVisionError(
                f"precomputed features of {name!r}, a dataset dpvision does not know, need "
                "num_classes (e.g. --set num_classes=1000); it is not read off the labels, "
                "which are private"
            )
        if config.num_classes is not None and config.num_classes < 2:
            raise DPVisionError(f"num_classes must be >= 2, got {config.num_classes}")
        return
    check_public_shape(name, config.num_classes, config.image_channels)


def _resolve_geometry(config: TrainConfig) -> TrainConfig:
    """The image size checked, and for ``learner.model = "timm:NAME"`` without one, timm's
    (:func:`dpvision.models.sources.timm_models.default_geometry`: ``pretrained_cfg`` of a
    model with a fixed input size, or ``learner.model_args.img_size``), each crop option the
    config left at its default taken from it; resolved here so that the result and the model
    file record the geometry the run used."""
    check_test_fraction(config.dataset, config.test_fraction, config.split_seed)
    model = config.learner.get("model") if config.method in DEEP_METHODS else None
    if config.image_size is None and isinstance(model, str) and model.startswith("timm:"):
        # local import: optional dependency (timm, read only for a timm model)
        from dpvision.models.sources.timm_models import default_geometry

        args = config.learner.get("model_args")
        found = default_geometry(model[len("timm:") :], args if isinstance(args, dict) else None)
        given = config.to_dict()
        changes = {k: v for k, v in found.items() if given[k] == GEOMETRY_DEFAULTS[k]}
        if "image_size" in changes:
            size = parse_image_size(changes["image_size"])
            changes["image_size"] = size[0] if size and size[0] == size[1] else size
            config = dataclasses.replace(config, **changes)
    if config.image_size is not None and config.features.strip().startswith("precomputed"):
        raise DPVisionError(
            "image_size resizes images; precomputed features have none: leave image_size unset"
        )
    if not config.features.strip().startswith("precomputed"):
        check_image_size(config.dataset, config.image_size)  # by the config, before any row
    config.geometry  # noqa: B018 (a bad size, or crop options without one, are refused here)
    return config


def validate(config: TrainConfig) -> TrainConfig:
    """The config, checked and with what is ``auto`` resolved where the data are not needed:
    each field against its range (:func:`dpvision.options.check`), then the checks that
    relate fields, with one-line messages naming the field and what is allowed."""
    check(config)
    config = _current_names(config)
    if config.epsilon is None and config.noise_multiplier is None:
        raise DPVisionError("give epsilon (a target) or noise_multiplier")
    if config.epsilon is not None and config.noise_multiplier is not None:
        raise DPVisionError("give only one of epsilon and noise_multiplier")
    check_secret_seed(config.secret_seed)
    if config.secret_seed is not None and config.secure_mode:
        raise DPVisionError(
            "secret_seed replays a run, learner.secure_mode draws from the OS CSPRNG and cannot "
            "be replayed: give one of them"
        )
    config = _resolve_auto(
        dataclasses.replace(
            config, device=parse_device(config.device), precision=parse_precision(config.precision)
        )
    )
    if config.precision != "fp32" and config.method not in DEEP_METHODS:
        raise DPVisionError(
            f"precision {config.precision} is for dp-sgd and dp-randp; {config.method} solves "
            "in float64 (leave precision = fp32)"
        )
    config.placement  # noqa: B018 (a device that is not there is refused before any work)
    _check_public_shape(config)
    if config.method == "dp-sgd" and config.learner.get("normalization") == "dataset":
        info = dataset_info(config.dataset)  # published statistics: refused before any file
        dataset_statistics(info.name if info is not None else config.dataset.strip())
    config = _resolve_geometry(config)
    if config.preprocessing.kind not in (*PREPROCESSING, AUTO):
        raise DPVisionError(
            f"unknown preprocessing.kind {config.preprocessing.kind!r}; choose one of: "
            f"{', '.join(PREPROCESSING)}"
        )
    _check_preprocessing_ranges(config.preprocessing)
    if config.accountant is not None:
        parse_accountant(config.accountant)
    if config.reference:
        check_reference(config.reference)
    if config.pretrain and config.method != "dp-randp":
        raise DPVisionError("a [pretrain] table is for --method dp-randp only")
    if config.method in DEEP_METHODS:
        if config.features.strip().startswith("precomputed"):
            raise DPVisionError(
                f"{config.method} trains on images or their feature maps; precomputed "
                "feature vectors serve dp-ls, dp-newton, dp-fc and dp-sgd-linear"
            )

        options = config.dpsgd
        if config.method == "dp-sgd" and options.is_transfer:
            raise DPVisionError(
                "learner.encoder and learner.phase2_* belong to --method dp-randp (a warm "
                "start from an encoder is dp-randp with learner.phase2_steps = 0)"
            )
        if config.method == "dp-randp":
            if options.init is not None or options.finetune != "all":
                raise DPVisionError(
                    "dp-randp's phases choose what trains and start from learner.encoder; "
                    "learner.init and learner.finetune belong to --method dp-sgd"
                )
            if options.normalization not in ("auto", "none"):
                raise DPVisionError(
                    "dp-randp normalises pixels with the encoder's (public) statistics; "
                    "leave learner.normalization unset"
                )
            taken = sorted(set(config.pretrain) & set(_PRETRAIN_FROM_RUN))
            if taken:
                raise DPVisionError(
                    f"pretrain.{taken[0]} comes from the run (learner.model, learner.groups, "
                    "the dataset's image shape); remove it from [pretrain]"
                )
            PretrainOptions.from_dict(config.pretrain)
        missing = [p for p in config.leave_out_rows_of if not Path(p).expanduser().is_file()]
        if missing:
            raise DPVisionError(f"leave_out_rows_of: {missing[0]} not found")
        if options.init is not None and not Path(options.init).expanduser().is_file():
            raise DPVisionError(
                f"learner.init: {options.init} not found (weights are never downloaded at run "
                "time: save them to this file first)"
            )
        if options.encoder is not None and not Path(options.encoder).expanduser().is_file():
            raise DPVisionError(
                f"learner.encoder: {options.encoder} not found; make one with `dpvision "
                f"pretrain --out {options.encoder}`"
            )
        return config
    learner = _learner(config)
    allowed = set(learner().get_params()) - {
        "clipping_mode",  # DPSGDLinear's former name of clipping, renamed above
        "target_epsilon",
        "target_delta",
        "noise_multiplier",
        "accountant",
        "random_state",
        "sampling_state",  # the run's secret coins (DPSGDLinear), never the config's
        "device",  # the run's own device (top-level ``device``)
    }
    learner_name = (
        f"{RECIPE_METHOD} (the method of the default recipe)"
        if config.method == AUTO
        else config.method
    )
    message = f"unknown learner option {{key!r}} for {learner_name}; valid: {{valid}}"
    check_known(config.learner, sorted(allowed), message)
    checked = check_learner_options(learner, config.learner)
    return config if checked == config.learner else dataclasses.replace(config, learner=checked)


_PREPROCESSING_RANGES = {
    "groups": Interval(1, None, closed="left", kind="a whole number"),
    "channels": Interval(1, None, closed="left", kind="a whole number"),
    "noise_multiplier": Interval(0, math.inf, kind="a number"),
    "mean_clip": Interval(0, math.inf, kind="a number"),
    "square_clip": Interval(0, math.inf, kind="a number"),
    "clip_norm": Interval(0, math.inf, kind="a number"),
}


def _check_preprocessing_ranges(preprocessing: Any) -> None:
    """One-line errors for ``[preprocessing]`` numbers out of range, before any data is read
    (they were met only when the statistics were computed, after feature extraction)."""
    for name, allowed in _PREPROCESSING_RANGES.items():
        value = getattr(preprocessing, name)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and allowed.accepts(value)):
            raise DPVisionError(allowed.message(f"preprocessing.{name}", value))


def _learner(config: TrainConfig) -> type[DPLinearClassifier]:
    """The estimator of a feature method (``auto``: the default recipe's)."""
    return LEARNERS[RECIPE_METHOD if config.method == AUTO else config.method]


def _current_names(config: TrainConfig) -> TrainConfig:
    """The config with the ``[learner]`` options given under their former names renamed,
    each with a one-line deprecation warning (:func:`dpvision.training.options.current_names`),
    so that every later reader, and the published config, sees today's names."""
    if config.method in DEEP_METHODS:
        learner = current_names(config.learner)
    elif "clipping" in _learner(config)().get_params():  # DPSGDLinear
        learner = renamed_option(config.learner, "clipping_mode", "clipping")
    else:
        return config
    return config if learner == config.learner else dataclasses.replace(config, learner=learner)


def _resolve_auto(config: TrainConfig) -> TrainConfig:
    """``features`` and ``preprocessing.kind`` left ``auto``, resolved from the method
    (:mod:`dpvision.recipes`) where it does not need the data; ``method = "auto"`` and the
    features of ``auto`` and ``dp-sgd-linear`` are resolved when the run starts, where the
    number of training examples and the image shape are known
    (:func:`dpvision.runs.auto.apply_recipe`)."""
    features = config.features
    if features == AUTO and config.method not in (AUTO, RECIPE_METHOD):
        features = default_features(config.method)
    pre = config.preprocessing
    # The recipe's own features wait for the image shape and N (pixels: C; ScatterNet of
    # colour images: PrivDataNorm), resolved when the run starts.
    kind = features.strip().split(":", 1)[0]
    recipe_features = kind in ("pixels", "scatternet") and config.method in (AUTO, RECIPE_METHOD)
    if pre.kind == AUTO and features != AUTO and not recipe_features:
        pre = pre.filled(default_preprocessing(config.method, features))
    return dataclasses.replace(config, features=features, preprocessing=pre)


REFERENCE_KEYS = ("source", "accuracy", "epsilon", "band", "needs", "points")


def check_reference(reference: dict[str, Any]) -> None:
    """One-line errors for a malformed ``[reference]`` table."""
    unknown = sorted(set(reference) - set(REFERENCE_KEYS))
    if unknown:
        raise DPVisionError(
            f"unknown key reference.{unknown[0]}; valid keys: {', '.join(REFERENCE_KEYS)}"
        )
    if not isinstance(reference.get("source"), str) or not reference["source"]:
        raise DPVisionError('[reference] needs source = "where the published number is from"')
    for key in ("needs",):
        if key in reference and not isinstance(reference[key], str):
            raise DPVisionError(f"reference.{key} must be a string")
    accuracy = reference.get("accuracy")
    if accuracy is not None and not (
        isinstance(accuracy, int | float) and not isinstance(accuracy, bool) and 0 <= accuracy <= 1
    ):
        raise DPVisionError(f"reference.accuracy must be a fraction in [0, 1], got {accuracy!r}")
    epsilon = reference.get("epsilon")
    if epsilon is not None and not (
        isinstance(epsilon, int | float) and not isinstance(epsilon, bool) and epsilon > 0
    ):
        raise DPVisionError(f"reference.epsilon must be > 0, got {epsilon!r}")
    points = reference.get("points", [])
    if not isinstance(points, list) or not all(
        isinstance(p, list)
        and len(p) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in p)
        and p[0] > 0
        and 0 <= p[1] <= 1
        for p in points
    ):
        raise DPVisionError(
            f"reference.points must be [[epsilon, accuracy], ...] with accuracy in [0, 1], "
            f"got {points!r}"
        )
    band = reference.get("band")
    if band is not None and not (
        isinstance(band, list)
        and len(band) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in band)
        and 0 <= band[0] <= band[1] <= 1
    ):
        raise DPVisionError(
            f"reference.band must be [low, high] with 0 <= low <= high <= 1, got {band!r}"
        )
