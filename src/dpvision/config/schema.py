"""The run configuration's dataclass, :class:`TrainConfig`: its fields, their ranges (field
metadata, :mod:`dpvision.options`) and what a run derives from them.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpvision.data.core import ImageDataset
from dpvision.data.datasets import load_dataset
from dpvision.data.resize import CROP_MODES, DEFAULTS, INTERPOLATIONS, ImageGeometry
from dpvision.data.splits import SPLIT_SEED, TEST_FRACTION
from dpvision.devices import Placement, placement
from dpvision.features import parse_feature_spec
from dpvision.features.backbone import feature_source
from dpvision.features.preprocessing import PreprocessingConfig
from dpvision.features.spec import NETWORK_FEATURES
from dpvision.fileio import sha256_file
from dpvision.learners import LEARNERS
from dpvision.mechanisms.secret import SecretRandomness, canonical_context
from dpvision.options import Choice, Interval, option
from dpvision.recipes import AUTO
from dpvision.training.options import DPSGDOptions, names_before_rename

__all__ = ["DEEP_METHODS", "METHODS", "TrainConfig"]

DEEP_METHODS = ("dp-sgd", "dp-randp")
"""The methods that train a network (:class:`dpvision.training.options.DPSGDOptions`)."""
METHODS = (AUTO, *LEARNERS, *DEEP_METHODS)
"""``auto``, the feature learners (:data:`dpvision.learners.LEARNERS`), the deep methods."""


ADDED_DEFAULTS = {
    **DEFAULTS,
    "test_fraction": TEST_FRACTION,
    "leave_out_rows_of": [],
    "split_seed": SPLIT_SEED,
}
"""Options added after runs were published: at their defaults they stay out of the secret
randomness's context, so a ``secret_seed`` replays those runs' noise exactly."""


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
      image_size: the size every image is brought to as it is loaded, in training,
        ``predict``, ``evaluate`` and the feature cache's key (:mod:`dpvision.data.resize`):
        a whole number (square) or ``[H, W]``; ``None`` (the default): the images' own size
        (array datasets); required for ``imagefolder:`` (the images' own sizes are private
        rows: the input size is never read off them). For ``learner.model = "timm:NAME"``
        of a model with a fixed input size (ViTs), ``None`` becomes timm's ``pretrained_cfg``
        (``input_size``, ``crop_pct``, ``crop_mode``, ``interpolation``), or
        ``learner.model_args.img_size`` when given; the resolved config records it.
      crop_mode: ``center`` (the default), ``squash`` or ``border``, timm's ``crop_mode``.
      crop_pct: in (0, 1], timm's: resize towards ``image_size / crop_pct``, then keep the
        centre ``image_size`` (1, the default: resize straight to the size).
      interpolation: ``bilinear`` (the default), ``bicubic``, ``nearest`` or ``lanczos``.
      test_fraction: ``imagefolder:ROOT`` whose classes are directly under ``ROOT`` (no
        ``train/`` and ``test/``): each image's chance of landing in the test split (0.2, the
        default), from its own bytes and ``split_seed``
        (:func:`dpvision.data.splits.tree_split`).
      split_seed: the same tree: the public key of its test split (0, the default), apart
        from ``seed``, so that runs over several seeds (``dpvision sweep --seeds``) share one
        test side; the test images are released exactly (``n_test``, the test accuracy), so
        every run published on the tree should keep the same ``split_seed`` and
        ``test_fraction``.
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
      leave_out_rows_of: weight files whose training rows this run leaves out as public,
        as it does for its own ``learner.init`` (copies of their declared-public rows),
        without loading them; ``dpvision tune`` gives every candidate the files of all of
        them, so that every candidate trains and validates on the same rows
        (:mod:`dpvision.runs.weight_rows`).
      preprocessing: see :class:`PreprocessingConfig`.
      learner: keyword arguments of the learner's estimator (validated against it).
      pretrain: ``dp-randp``: Phase I options, used when ``learner.encoder`` is unset
        (:class:`dpvision.training.pretrain_options.PretrainOptions`; the model, groups and image
        shape come from the run).
      reference: the published result this config reproduces (see the module docstring);
        not used by the run.
    """

    dataset: str = "digits"
    data_dir: str | None = None
    num_classes: int | None = None
    image_channels: int | None = None
    image_size: int | tuple[int, int] | None = None
    crop_mode: str = option(DEFAULTS["crop_mode"], Choice(CROP_MODES))
    crop_pct: float = option(DEFAULTS["crop_pct"], Interval(0, 1, closed="right"))
    interpolation: str = option(DEFAULTS["interpolation"], Choice(INTERPOLATIONS))
    test_fraction: float = option(TEST_FRACTION, Interval(0, 1))
    split_seed: int = option(SPLIT_SEED, Interval(0, 2**63, closed="left", kind="a whole number"))
    method: str = option(AUTO, Choice(METHODS))
    features: str = "auto"
    epsilon: float | None = option(3.0, Interval(0, None, note="or inf for no noise"))
    delta: float = option(1e-5, Interval(0, 1))
    noise_multiplier: float | None = option(None, Interval(0, math.inf, closed="left"))
    accountant: str | None = None
    seed: int = option(0, Interval(0, 2**63, closed="left", kind="a whole number"))
    secret_seed: int | None = dataclasses.field(default=None, repr=False)
    device: str = "auto"
    precision: str = "fp32"
    validation_fraction: float = option(0.0, Interval(0, 1, closed="left"))
    validation: str = option("private", Choice(("private", "public")))
    validation_noise: float | None = option(None, Interval(0, math.inf))
    public_fraction: float = option(0.0, Interval(0, 1, closed="left"))
    leave_out_rows_of: tuple[str, ...] = ()
    preprocessing: PreprocessingConfig = field(default_factory=PreprocessingConfig)
    learner: dict[str, Any] = field(default_factory=dict)
    pretrain: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A list (what JSON and TOML give back) and a tuple name the same files.
        object.__setattr__(self, "leave_out_rows_of", tuple(self.leave_out_rows_of))

    def to_dict(self) -> dict[str, Any]:
        """The config as published (result JSON, model file): without ``secret_seed``."""
        data = dataclasses.asdict(self)
        del data["secret_seed"]
        data["leave_out_rows_of"] = list(self.leave_out_rows_of)  # as JSON reads it back
        return data

    def secret_randomness(self, **more: Any) -> SecretRandomness:
        """This run's secret randomness (:mod:`dpvision.mechanisms.secret`): fresh OS bits,
        or derived from ``secret_seed`` *and this config* — with the contents of the weight
        files it names and ``more`` (``tune``: its search and settings) — so runs of other
        configs, other weights or other searches never share their noise with it."""
        if self.secret_seed is None:
            return SecretRandomness(None, secure=self.secure_mode)
        # Where the data and the computation are is not what the run is; nor what its
        # options are called: a run given their former names replays under the new ones.
        context = {k: v for k, v in self.to_dict().items() if k not in ("data_dir", "device")}
        context["learner"] = names_before_rename(context["learner"])
        for key, default in ADDED_DEFAULTS.items():  # runs from before these options replay
            if context.get(key) == default:
                del context[key]
        # What changed meaning with issue 40 changes the noise too, so that a secret_seed
        # never gives an old run's noise to a computation on other inputs or rows: a resized
        # run's splits read the rows at their own size, and learner.init brings the file's
        # input statistics and (for other classes) a zero head.
        if self.image_size is not None:
            context["row_identity"] = "native"
        if self.learner.get("init"):
            context["init_recipe"] = 2
        # A weight file replaced at the same path is another run (issue 48's review).
        weights = {path: _file_digest(path) for path in self._weight_files()}
        if weights:
            context["weight_files"] = weights
        if more:
            context["more"] = more
        return SecretRandomness(
            self.secret_seed, secure=self.secure_mode, context=canonical_context(context)
        )

    def _weight_files(self) -> list[str]:
        """The weight files the run reads: ``learner.init``, ``learner.encoder``, the
        features' ``encoder:path=``/``backbone:weights=`` and ``leave_out_rows_of``."""
        files = [self.learner.get("init"), self.learner.get("encoder"), *self.leave_out_rows_of]
        if self.features != "auto":
            spec = parse_feature_spec(self.features)
            files.append(feature_source(spec) if spec.name in NETWORK_FEATURES else None)
        return [str(f) for f in dict.fromkeys(files) if isinstance(f, str) and f]

    @property
    def validation_is_public(self) -> bool:
        """Whether the held-out rows are declared public (exact accuracies released)."""
        return self.validation == "public"

    @property
    def geometry(self) -> ImageGeometry | None:
        """The size every image is brought to (``None``: the images' own size)."""
        return ImageGeometry.from_config(self.to_dict())

    def load_dataset(self) -> ImageDataset:
        """The dataset of this run, its classes and channels fixed by the config or the
        registry (never read off the private labels), its images brought to
        :attr:`geometry`."""
        return load_dataset(
            self.dataset,
            self.data_dir,
            num_classes=self.num_classes,
            channels=self.image_channels,
            geometry=self.geometry,
            split_seed=self.split_seed,
            test_fraction=self.test_fraction,
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


def _file_digest(path: str) -> str:
    """The sha256 of a file's bytes, or ``"missing"`` (the run refuses it elsewhere)."""
    try:
        return sha256_file(Path(path).expanduser())
    except OSError:
        return "missing"
