"""The options of ``dpvision pretrain``: one frozen dataclass per objective.

* :class:`PretrainOptions` — ``--objective contrastive`` (DP-RandP's Phase I on synthetic
  images, :mod:`dpvision.training.pretrain`);
* :class:`SupervisedOptions` — ``--objective supervised`` (cross-entropy on a public
  dataset, :mod:`dpvision.training.supervised`).

Both are built from the ``[pretrain]`` table of a config or the command's flags by
``from_dict``, which refuses unknown keys and values of the wrong type with one-line
errors naming the option, then ``validated``; ``settings`` is what a checkpoint is tied to.
"""

import dataclasses
from typing import Any

from dpvision.data.augment import PADDING_MODES
from dpvision.data.synthetic import SYNTHETIC_KINDS
from dpvision.errors import DPVisionError
from dpvision.fileio import settings_fingerprint
from dpvision.models.registry import check_model, parse_model
from dpvision.options import coerce, option_hints

SCHEDULES = ("constant", "step", "cosine")


@dataclasses.dataclass(frozen=True)
class PretrainOptions:
    """Hyper-parameters of Phase I (the ``[pretrain]`` table, or ``dpvision pretrain`` flags).

    Attributes:
      model: the model whose body is pre-trained (``DPSGDOptions.model`` names).
      groups: GroupNorm groups of the model (WRNs).
      synthetic: the generator (:data:`dpvision.data.synthetic.SYNTHETIC_KINDS`).
      size, channels: the images' side and channels (those of the private data).
      num_images: images generated once and reused each epoch (0: fresh images every step).
      batch_size: images per step (two views each).
      steps: optimisation steps.
      learning_rate: SGD learning rate (0.12·B/256 in the paper), ÷10 at the milestones.
      momentum, weight_decay: SGD's.
      projection_hidden, projection_dim: widths of the projection MLP.
      seed: seeds the generator stream, the initialisation and the views.
      checkpoint_every: steps between checkpoints (with a checkpoint path).
    """

    model: str = "tanh-cnn"
    groups: int = 16
    synthetic: str = "dead-leaves-mixed"
    size: int = 28
    channels: int = 1
    num_images: int = 100_000
    batch_size: int = 256
    steps: int = 2000
    learning_rate: float = 0.12
    momentum: float = 0.9
    weight_decay: float = 1e-4
    projection_hidden: int = 512
    projection_dim: int = 128
    seed: int = 0
    checkpoint_every: int = 500

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "PretrainOptions":
        """Builds and validates the options; unknown keys and bad values are one-line errors."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in fields:
                raise DPVisionError(
                    f"unknown pretrain option {key!r}; valid: {', '.join(sorted(fields))}"
                )
            kind = fields[key].type
            name = kind.__name__ if isinstance(kind, type) else str(kind)
            if isinstance(value, bool) or (name == "int" and not isinstance(value, int)):
                raise DPVisionError(f"pretrain.{key} must be a whole number, got {value!r}")
            if name == "float":
                if not isinstance(value, int | float):
                    raise DPVisionError(f"pretrain.{key} must be a number, got {value!r}")
                value = float(value)
            if name == "str" and not isinstance(value, str):
                raise DPVisionError(f"pretrain.{key} must be a string, got {value!r}")
            values[key] = value
        return cls(**values).validated()

    def validated(self) -> "PretrainOptions":
        parse_model(self.model)
        if self.synthetic not in SYNTHETIC_KINDS:
            raise DPVisionError(
                f"unknown synthetic generator {self.synthetic!r}; choose one of "
                f"{', '.join(SYNTHETIC_KINDS)}"
            )
        if self.channels not in (1, 3):
            raise DPVisionError(f"pretrain.channels must be 1 or 3, got {self.channels}")
        for name in ("size", "batch_size", "steps", "projection_hidden", "projection_dim"):
            if getattr(self, name) < 1:
                raise DPVisionError(f"pretrain.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size < 2:
            raise DPVisionError("pretrain.batch_size must be >= 2 (the loss compares images)")
        if not 0 <= self.seed < 2**63:
            raise DPVisionError(
                f"pretrain.seed must be a whole number in [0, 2**63), got {self.seed}"
            )
        for name in ("num_images", "momentum", "weight_decay", "checkpoint_every", "groups"):
            if getattr(self, name) < 0:
                raise DPVisionError(f"pretrain.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_images and self.num_images < self.batch_size:
            raise DPVisionError(
                f"pretrain.num_images ({self.num_images}) must be >= batch_size "
                f"({self.batch_size}), or 0 for fresh images every step"
            )
        if not self.learning_rate > 0:
            raise DPVisionError(f"pretrain.learning_rate must be > 0, got {self.learning_rate}")
        return self

    def settings(self) -> dict[str, Any]:
        """Every option that changes the encoder (all but ``checkpoint_every``)."""
        data = dataclasses.asdict(self)
        data.pop("checkpoint_every")
        return data

    def fingerprint(self) -> str:
        """A hash of :meth:`settings`."""
        return settings_fingerprint(self.settings())


@dataclasses.dataclass(frozen=True)
class SupervisedOptions:
    """Hyper-parameters of supervised pre-training (``dpvision pretrain --objective
    supervised``; the ``[pretrain]`` table of such a config).

    Attributes:
      dataset: the public dataset (a dpvision dataset name or path spec).
      data_dir: where its files are (``None``: the standard lookup).
      num_classes, image_channels: for path datasets (``npz:``, ``imagefolder:``, …), as
        in ``dpvision train``.
      public_fraction: 0: the whole training set is public; f in (0, 1): only its public
        slice (:func:`dpvision.data.splits.public_split`), the rest left to a private run.
      model: a model spec (:mod:`dpvision.models.sources`).
      groups: GroupNorm groups of dpvision's WRNs.
      steps: optimisation steps; if unset, ``epochs`` over the public images.
      epochs: used when ``steps`` is unset.
      batch_size, learning_rate, momentum, nesterov, weight_decay: SGD's.
      schedule: ``constant``, ``step`` (÷10 at each of ``milestones``, fractions of the
        steps) or ``cosine`` (to 0), after ``warmup_steps`` of linear warm-up.
      label_smoothing: of the cross-entropy.
      crop_padding, flip, padding_mode: the random crop and flip (0 and false: none).
      normalization: ``none`` (pixels in [0, 1]) or ``dataset`` (published statistics);
        recorded in the file — fine-tune with the same ``learner.normalization``.
      seed: seeds the initialisation, the order and the augmentation.
      checkpoint_every: steps between checkpoints (with a checkpoint path).
    """

    dataset: str = ""
    data_dir: str | None = None
    num_classes: int | None = None
    image_channels: int | None = None
    public_fraction: float = 0.0
    model: str = "tanh-cnn"
    groups: int = 16
    steps: int | None = None
    epochs: float | None = 10.0
    batch_size: int = 128
    learning_rate: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    schedule: str = "constant"
    milestones: tuple[float, ...] = (0.5, 0.75)
    warmup_steps: int = 0
    label_smoothing: float = 0.0
    crop_padding: int = 4
    flip: bool = True
    padding_mode: str = "reflect"
    normalization: str = "none"
    seed: int = 0
    checkpoint_every: int = 500

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SupervisedOptions":
        """Builds and validates the options; unknown keys and bad values are one-line errors."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in fields:
                raise DPVisionError(
                    f"unknown pretrain option {key!r} for --objective supervised; valid: "
                    f"{', '.join(sorted(fields))}"
                )
            values[key] = coerce(f"pretrain.{key}", value, option_hints(cls)[key])
        if values.get("steps") is not None and "epochs" not in values:
            values["epochs"] = None
        return cls(**values).validated()

    def validated(self) -> "SupervisedOptions":
        if not self.dataset:
            raise DPVisionError("supervised pre-training needs --dataset (the public dataset)")
        check_model(self.model)
        if (self.steps is None) == (self.epochs is None):
            raise DPVisionError("give exactly one of pretrain steps and epochs")
        if self.steps is not None and self.steps < 1:
            raise DPVisionError(f"pretrain.steps must be >= 1, got {self.steps}")
        if self.epochs is not None and not self.epochs > 0:
            raise DPVisionError(f"pretrain.epochs must be > 0, got {self.epochs}")
        if not 0 <= self.public_fraction < 1:
            raise DPVisionError(
                f"pretrain.public_fraction must be in [0, 1), got {self.public_fraction}"
            )
        for name in ("batch_size", "learning_rate"):
            if not getattr(self, name) > 0:
                raise DPVisionError(f"pretrain.{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "momentum",
            "weight_decay",
            "warmup_steps",
            "crop_padding",
            "groups",
            "checkpoint_every",
        ):
            if getattr(self, name) < 0:
                raise DPVisionError(f"pretrain.{name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise DPVisionError(
                f"pretrain.checkpoint_every must be >= 0, got {self.checkpoint_every}"
            )
        if not 0 <= self.label_smoothing < 1:
            raise DPVisionError(
                f"pretrain.label_smoothing must be in [0, 1), got {self.label_smoothing}"
            )
        if any(not 0 < m < 1 for m in self.milestones):
            raise DPVisionError("pretrain.milestones must be fractions of the steps in (0, 1)")
        if not 0 <= self.seed < 2**63:
            raise DPVisionError(f"pretrain.seed must be in [0, 2**63), got {self.seed}")
        choices = {
            "schedule": (self.schedule, SCHEDULES),
            "padding_mode": (self.padding_mode, PADDING_MODES),
            "normalization": (self.normalization, ("none", "dataset")),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise DPVisionError(
                    f"unknown pretrain.{name} {value!r}; choose one of {', '.join(allowed)}"
                )
        return self

    def settings(self) -> dict[str, Any]:
        """Every option that changes the weights (all but where the data are and how often
        to checkpoint)."""
        data = dataclasses.asdict(self)
        data.pop("checkpoint_every")
        data.pop("data_dir")
        return data
