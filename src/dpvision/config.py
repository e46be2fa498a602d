"""Run configuration: one frozen dataclass, filled from TOML, flags and ``--set`` overrides.

A TOML file looks like::

    dataset = "fashion-mnist"
    method = "dp-sgd-linear"
    features = "scatternet"
    epsilon = 3.0
    delta = 1e-5
    seed = 0

    [preprocessing]
    kind = "group-norm"        # none | group-norm | private-norm | center
    groups = 27

    [learner]                  # keyword arguments of the learner's estimator
    clip_norm = 0.1
    batch_size = 8192
    epochs = 40
    learning_rate = 16.0

A config that reproduces a published result also carries a ``[reference]`` table: where the
number comes from, the published accuracy and its ε, the band a faithful rerun should land
in, and what the run needs that may be missing (data, hardware)::

    [reference]
    source = "Tramèr & Boneh 2021, Table 1"
    accuracy = 0.897           # the published test accuracy, as a fraction
    epsilon = 3.0              # the ε it was published at
    band = [0.875, 0.915]      # our runs at that ε are flagged outside this band
    needs = "Fashion-MNIST"    # said when the run cannot start
    points = [[2.7, 0.895]]    # more published (ε, accuracy) of the same setup, plotted

It changes nothing in the run; ``dpvision report`` reads it from the result JSONs.

``--set key=value`` overrides any field, dotted for tables (``--set learner.epochs=20``,
``--set preprocessing.kind=none``); values are parsed as TOML (``--set epsilon=inf``).
Unknown keys, wrong types and out-of-range values are one-line errors naming the field.
"""

import dataclasses
import functools
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpvision.accounting import parse_accountant
from dpvision.data.core import ImageDataset
from dpvision.data.datasets import PATH_PREFIXES, check_public_shape, dataset_info, load_dataset
from dpvision.devices import Placement, parse_device, parse_precision, placement
from dpvision.errors import DPVisionError
from dpvision.features.preprocessing import PREPROCESSING, PreprocessingConfig
from dpvision.learners import LEARNERS
from dpvision.learners.options import check_learner_options
from dpvision.mechanisms.secret import SecretRandomness, check_secret_seed
from dpvision.recipes import AUTO, RECIPE_METHOD, default_features, default_preprocessing
from dpvision.training.options import DPSGDOptions
from dpvision.training.pretrain import PretrainOptions

__all__ = ["PREPROCESSING", "PreprocessingConfig", "TrainConfig", "resolve", "validate"]

METHODS = ("auto", "dp-ls", "dp-newton", "dp-fc", "dp-sgd-linear", "dp-sgd", "dp-randp")
# Phase I options that ``dp-randp`` takes from the run itself rather than from [pretrain].
_PRETRAIN_FROM_RUN = ("model", "groups", "size", "channels")


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``dpvision train`` needs; the resolved copy is written into the result JSON.

    Attributes:
      dataset: a dataset name (``digits``, ``fashion-mnist``, …, ``npz:PATH``).
      data_dir: where its files are (``None``: the standard lookup order).
      num_classes: the number of classes, for datasets whose labels dpvision cannot know
        (``npz:``, ``npy:``, precomputed features of an unlisted dataset). It fixes the
        model's output shape, so it is never read off the private labels.
      image_channels: ``imagefolder:`` datasets: 3 (RGB, the default) or 1 (grayscale).
      method: ``dp-ls``, ``dp-newton``, ``dp-fc``, ``dp-sgd-linear`` (on features),
        ``dp-sgd`` (deep models, see :class:`dpvision.training.options.DPSGDOptions`),
        ``dp-randp`` (DP-SGD in Phases II and III from a Phase I encoder) or ``auto`` (the
        default): the default recipe (:mod:`dpvision.recipes`), ``dp-sgd-linear`` with a
        schedule fitted to ε and to the number of training examples when the run starts.
      features: a feature spec (``pixels``, ``scatternet``, ``scatternet:pool=2``, …) or
        ``auto`` (the default): for ``auto`` and ``dp-sgd-linear``, ``scatternet`` on images
        of 8 pixels a side or more and ``pixels`` below; ``pixels`` for the other methods
        (:func:`dpvision.recipes.default_features`).
      epsilon: the target ε of the whole run (``inf``: no noise); or give noise_multiplier.
      delta: the target δ.
      noise_multiplier: σ instead of a target ε (``0``: no noise).
      accountant: ``pld``, ``rdp``, ``gaussian``, ``classic-rdp`` or ``None`` (tightest valid).
      seed: the *public* seed (published with the config): weight initialisation,
        augmentation draws, synthetic images, data order. Never the noise, the sampling or
        the splits' coins (``docs/guarantees.md``).
      secret_seed: makes the secret randomness (noise, Poisson sampling, the validation
        split's coins, tune's draws) replayable, for research; ``None`` (the default): 256
        bits of fresh OS entropy every run (:mod:`dpvision.mechanisms.secret`). Never
        written to any output; a guessable secret seed protects nothing.
      device: where the run computes: ``auto`` (the default: CUDA when torch sees it, else
        the CPU), ``cpu``, ``cuda`` or ``cuda:N`` (:mod:`dpvision.devices`).
      precision: ``fp32`` (the default) or ``bf16``: the forward and backward passes of
        ``dp-sgd``/``dp-randp`` under autocast, the norms, clipping and noise in float32.
      validation_fraction: the share of the training examples held out as a validation
        split (a secret keyed hash of each example; :mod:`dpvision.data.splits`):
        ``eval_every`` and the result's ``validation_accuracy`` use it and the test set is
        evaluated once, at the end. 0 (the default, as in the papers): train on all of them.
      validation: ``private`` (the default): validation accuracies are noisy counts of
        correct held-out examples (sensitivity 1), in the ledger and within the target ε;
        ``public``: the held-out rows are declared public and their exact accuracies are
        released (the result says so).
      validation_noise: σ_v, the std of the noise on each validation count; ``None``: all
        of the run's validation counts together cost a tenth of the target ε
        (:mod:`dpvision.runs.validation`).
      public_fraction: the share of the training examples declared public and left out of
        the private run (:mod:`dpvision.data.splits`: a fixed, published keyed hash of each
        example, the one ``dpvision pretrain --public-fraction`` trains on); 0 (the
        default): all are private.
      preprocessing: see :class:`PreprocessingConfig`.
      learner: keyword arguments of the learner's estimator (validated against it).
      pretrain: ``dp-randp``: Phase I options, used when ``learner.encoder`` is unset
        (:class:`dpvision.training.pretrain.PretrainOptions`; the model, groups and image
        shape come from the run).
      reference: the published result this config reproduces (see the module docstring);
        not used by the run.
    """

    dataset: str = "digits"
    data_dir: str | None = None
    num_classes: int | None = None
    image_channels: int | None = None
    method: str = "auto"
    features: str = "auto"
    epsilon: float | None = 3.0
    delta: float = 1e-5
    noise_multiplier: float | None = None
    accountant: str | None = None
    seed: int = 0
    secret_seed: int | None = dataclasses.field(default=None, repr=False)
    device: str = "auto"
    precision: str = "fp32"
    validation_fraction: float = 0.0
    validation: str = "private"
    validation_noise: float | None = None
    public_fraction: float = 0.0
    preprocessing: PreprocessingConfig = field(default_factory=PreprocessingConfig)
    learner: dict[str, Any] = field(default_factory=dict)
    pretrain: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The config as published (result JSON, model file): without ``secret_seed``."""
        data = dataclasses.asdict(self)
        del data["secret_seed"]
        return data

    def secret_randomness(self) -> SecretRandomness:
        """This run's secret randomness (:mod:`dpvision.mechanisms.secret`): fresh OS bits,
        or derived from ``secret_seed`` *and this config*, so runs of other configs never
        share their noise with it."""
        # Where the data and the computation are is not what the run is.
        context = {k: v for k, v in self.to_dict().items() if k not in ("data_dir", "device")}
        return SecretRandomness(
            self.secret_seed,
            secure=self.secure_mode,
            context=json.dumps(context, sort_keys=True, default=str),
        )

    @property
    def validation_is_public(self) -> bool:
        """Whether the held-out rows are declared public (exact accuracies released)."""
        return self.validation == "public"

    def load_dataset(self) -> ImageDataset:
        """The dataset of this run, its classes and channels fixed by the config or the
        registry (never read off the private labels)."""
        return load_dataset(
            self.dataset,
            self.data_dir,
            num_classes=self.num_classes,
            channels=self.image_channels,
        )

    @property
    def noise_off(self) -> bool:
        """Whether the run adds no noise (ε = ∞ or σ = 0): a non-private baseline."""
        return (self.epsilon is not None and math.isinf(self.epsilon)) or (
            self.noise_multiplier == 0
        )

    @property
    def secure_mode(self) -> bool:
        """``learner.secure_mode``: every noisy release (and Poisson sampling) draws from the
        operating system's CSPRNG (:mod:`dpvision.mechanisms.secure`)."""
        return self.learner.get("secure_mode", False) is True

    @functools.cached_property
    def placement(self) -> Placement:
        """The device and precision of this run, resolved on this machine."""
        return placement(self.device, self.precision)

    @functools.cached_property
    def dpsgd(self) -> DPSGDOptions:
        """``dp-sgd``/``dp-randp``: the ``[learner]`` table, parsed once and typed."""
        return DPSGDOptions.from_dict(self.learner)


def _field_types(cls: type) -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(cls)}


_NUMBER_FIELDS = {
    "validation_fraction",
    "public_fraction",
    "epsilon",
    "delta",
    "noise_multiplier",
    "validation_noise",
    "mean_clip",
    "square_clip",
    "clip_norm",
}
_INT_FIELDS = {"seed", "secret_seed", "groups", "channels", "num_classes", "image_channels"}
_OPTIONAL = {
    "data_dir",
    "secret_seed",
    "validation_noise",
    "epsilon",
    "noise_multiplier",
    "accountant",
    "channels",
    "num_classes",
    "image_channels",
}


def _coerce(name: str, value: Any, where: str) -> Any:
    if value is None and name not in _OPTIONAL:
        raise DPVisionError(f"{where}: {name} cannot be empty")
    if value is None or (
        name in _OPTIONAL and isinstance(value, str) and value.lower() in ("none", "null")
    ):
        return None
    if name in _NUMBER_FIELDS:
        if isinstance(value, bool):
            raise DPVisionError(f"{where}: {name} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise DPVisionError(f"{where}: {name} must be a number, got {value!r}") from None
    if name in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int):
            shown = "" if name == "secret_seed" else f", got {value!r}"  # never echo a secret
            raise DPVisionError(f"{where}: {name} must be a whole number{shown}")
        return value
    if not isinstance(value, str):
        raise DPVisionError(f"{where}: {name} must be a string, got {value!r}")
    return value


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    known = _field_types(cls)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise DPVisionError(
                f"{where}: unknown key {key!r}; valid keys: {', '.join(sorted(known))}"
            )
        if key == "preprocessing":
            if not isinstance(value, dict):
                raise DPVisionError(f"{where}: [preprocessing] must be a table")
            values[key] = _build(PreprocessingConfig, value, f"{where} [preprocessing]")
        elif key in ("learner", "pretrain", "reference"):
            if not isinstance(value, dict):
                raise DPVisionError(f"{where}: [{key}] must be a table")
            values[key] = dict(value)
        else:
            values[key] = _coerce(key, value, where)
    return cls(**values)


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


def validate(config: TrainConfig) -> TrainConfig:
    """Range checks with one-line messages naming the field and what is allowed."""
    if config.method not in METHODS:
        raise DPVisionError(
            f"unknown method {config.method!r}; choose one of: {', '.join(METHODS)}"
        )
    if config.epsilon is not None and not (config.epsilon > 0):
        raise DPVisionError(f"epsilon must be > 0 (or inf for no noise), got {config.epsilon}")
    if config.epsilon is None and config.noise_multiplier is None:
        raise DPVisionError("give epsilon (a target) or noise_multiplier")
    if config.epsilon is not None and config.noise_multiplier is not None:
        raise DPVisionError("give only one of epsilon and noise_multiplier")
    if config.noise_multiplier is not None and not (
        config.noise_multiplier >= 0 and math.isfinite(config.noise_multiplier)
    ):
        raise DPVisionError(f"noise_multiplier must be >= 0, got {config.noise_multiplier}")
    if not 0 < config.delta < 1:
        raise DPVisionError(f"delta must be in (0, 1), got {config.delta}")
    if not 0 <= config.validation_fraction < 1:
        raise DPVisionError(
            f"validation_fraction must be in [0, 1), got {config.validation_fraction}"
        )
    if not 0 <= config.public_fraction < 1:
        raise DPVisionError(f"public_fraction must be in [0, 1), got {config.public_fraction}")
    if not 0 <= config.seed < 2**63:
        raise DPVisionError(f"seed must be a whole number in [0, 2**63), got {config.seed}")
    check_secret_seed(config.secret_seed)
    if config.secret_seed is not None and config.secure_mode:
        raise DPVisionError(
            "secret_seed replays a run, learner.secure_mode draws from the OS CSPRNG and cannot "
            "be replayed: give one of them"
        )
    if config.validation not in ("private", "public"):
        raise DPVisionError(
            f"validation must be 'private' (noisy accuracies) or 'public' (the held-out rows "
            f"are declared public), got {config.validation!r}"
        )
    if config.validation_noise is not None and not (
        math.isfinite(config.validation_noise) and config.validation_noise > 0
    ):
        raise DPVisionError(f"validation_noise must be > 0, got {config.validation_noise}")
    config = _resolve_auto(
        dataclasses.replace(
            config, device=parse_device(config.device), precision=parse_precision(config.precision)
        )
    )
    if config.precision != "fp32" and config.method not in ("dp-sgd", "dp-randp"):
        raise DPVisionError(
            f"precision {config.precision} is for dp-sgd and dp-randp; {config.method} solves "
            "in float64 (leave precision = fp32)"
        )
    config.placement  # noqa: B018 (a device that is not there is refused before any work)
    _check_public_shape(config)
    if config.preprocessing.kind not in (*PREPROCESSING, AUTO):
        raise DPVisionError(
            f"unknown preprocessing.kind {config.preprocessing.kind!r}; choose one of: "
            f"{', '.join(PREPROCESSING)}"
        )
    if config.accountant is not None:
        parse_accountant(config.accountant)
    if config.reference:
        check_reference(config.reference)
    if config.pretrain and config.method != "dp-randp":
        raise DPVisionError("a [pretrain] table is for --method dp-randp only")
    if config.method in ("dp-sgd", "dp-randp"):
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
            if options.normalization != "none":
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
        if options.init is not None and not Path(options.init).expanduser().is_file():
            raise DPVisionError(
                f"learner.init: {options.init} not found (weights are never downloaded at run "
                "time: save them to this file first)"
            )
        return config
    learner = LEARNERS[RECIPE_METHOD if config.method == AUTO else config.method]
    allowed = set(learner().get_params()) - {
        "target_epsilon",
        "target_delta",
        "noise_multiplier",
        "accountant",
        "random_state",
        "device",  # the run's own device (top-level ``device``)
    }
    learner_name = (
        f"{RECIPE_METHOD} (the method of the default recipe)"
        if config.method == AUTO
        else config.method
    )
    for key in config.learner:
        if key not in allowed:
            raise DPVisionError(
                f"unknown learner option {key!r} for {learner_name}; valid: "
                f"{', '.join(sorted(allowed))}"
            )
    check_learner_options(learner, config.learner)
    return config


def _resolve_auto(config: TrainConfig) -> TrainConfig:
    """``features`` and ``preprocessing.kind`` left ``auto``, resolved from the method
    (:mod:`dpvision.recipes`) where it does not need the data; ``method = "auto"`` and the
    features of ``auto`` and ``dp-sgd-linear`` are resolved when the run starts, where the
    number of training examples and the image shape are known
    (:func:`dpvision.runs.recipe.apply_recipe`)."""
    features = config.features
    if features == AUTO and config.method not in (AUTO, RECIPE_METHOD):
        features = default_features(config.method)
    pre = config.preprocessing
    recipe_pixels = features == "pixels" and config.method in (AUTO, RECIPE_METHOD)
    if pre.kind == AUTO and features != AUTO and not recipe_pixels:  # pixels: needs C
        pre = dataclasses.replace(pre, **default_preprocessing(config.method, features))
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


def load_toml(path: str | Path) -> dict[str, Any]:
    """Reads a TOML file; a missing or malformed file is a one-line error."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise DPVisionError(f"config file {path} not found") from None
    except IsADirectoryError:
        raise DPVisionError(f"config file {path} is a folder; give a .toml file") from None
    except OSError as error:
        raise DPVisionError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise DPVisionError(f"{path} is not valid TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise DPVisionError(f"{path} is not valid TOML: {error}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` → (["a", "b"], value parsed as TOML, or the raw string)."""
    if "=" not in text:
        raise DPVisionError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise DPVisionError(f"--set expects key=value, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.split("."), value


def resolve(
    file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    sets: list[str] | None = None,
) -> TrainConfig:
    """Builds the config: defaults < TOML file < flags (``overrides``; a dict value sets
    keys of that table) < ``--set`` items."""
    raw: dict[str, Any] = load_toml(file) if file is not None else {}
    where = str(file) if file is not None else "config"
    if "noise_multiplier" in raw and "epsilon" not in raw:
        raw["epsilon"] = None  # the file chose a fixed σ over the default target
    given: dict[str, str] = {}  # privacy parameters set on the command line, and how
    for key, value in (overrides or {}).items():
        if isinstance(value, dict):  # a table given as a dict (the Python API)
            for name, item in value.items():
                _assign(raw, [key, name], item, f"{key}.{name}")
        elif value is not None:
            source = f"--{key.replace('_', '-')} {value:g}" if key in _ALTERNATIVE else ""
            _assign(raw, [key], value, source or f"--{key.replace('_', '-')}")
            if source:
                given[key] = source
    for item in sets or []:
        path, value = parse_override(item)
        _assign(raw, path, value, f"--set {item}")
        if len(path) == 1 and path[0] in _ALTERNATIVE:
            given[path[0]] = f"--set {item}"
    if len(given) > 1:
        raise DPVisionError(
            f"{given['epsilon']} and {given['noise_multiplier']} conflict: give a target ε or a "
            "fixed noise multiplier, not both"
        )
    return validate(_build(TrainConfig, raw, where))


def override(config: TrainConfig, items: list[str]) -> TrainConfig:
    """A copy of ``config`` with ``--set``-style ``key=value`` items applied, validated
    (the secret seed carried over, never through the published dict)."""
    raw = config.to_dict()
    for item in items:
        path, value = parse_override(item)
        _assign(raw, path, value, f"--set {item}")
    built = dataclasses.replace(_build(TrainConfig, raw, "config"), secret_seed=config.secret_seed)
    return validate(built)


# A target ε and a fixed σ exclude each other: one given on the command line replaces the
# file's choice; both given on the command line are an error.
_ALTERNATIVE = {"epsilon": "noise_multiplier", "noise_multiplier": "epsilon"}


def _assign(raw: dict[str, Any], path: list[str], value: Any, source: str) -> None:
    node = raw
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise DPVisionError(f"{source}: {part} is not a table")
    node[path[-1]] = value
    if len(path) == 1 and path[0] in _ALTERNATIVE:
        raw[_ALTERNATIVE[path[0]]] = None
