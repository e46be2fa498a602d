"""The ``[learner]`` table of ``--method dp-sgd``: one frozen dataclass, validated on load.

Names follow Opacus and jax_privacy: ``max_grad_norm`` (C), ``batch_size`` (the *expected*
logical batch size; the Poisson rate is q = batch_size / N), ``physical_batch_size`` (a
memory knob: examples per micro-batch, never changes the noise), ``augmult`` (K views per
example), ``ema_decay`` (μ; 0 turns the average off).

The knobs that change speed, memory or logging but never the trained model nor its privacy
form their own typed group, :class:`PerformanceOptions` (jax_privacy's
``PerformanceFlags``); the ``[learner]`` table keeps them flat. A checkpoint is tied to the
other options only (:meth:`DPSGDOptions.run_settings`), so a run may be resumed with a
smaller physical batch after running out of memory.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

from dpvision.data.augment import PADDING_MODES
from dpvision.errors import DPVisionError
from dpvision.models.finetune import FINETUNE_MODES
from dpvision.models.registry import BATCHNORM_MODES, check_model
from dpvision.per_example import CLIPPING_METHODS

OPTIMIZERS = ("sgd", "adam")
NORMALIZATIONS = ("none", "dataset")


@dataclass(frozen=True)
class PerformanceOptions:
    """How a DP-SGD run is executed: the same trained model and the same privacy whatever
    their values.

    Attributes:
      physical_batch_size: examples per micro-batch (each with its K views); memory only.
      clipping: ``auto``, ``bookkeeping`` or ``vmap`` (the same clipped sum, another speed).
      eval_every: evaluate on the test set every this many steps (0: only at the end).
      checkpoint_every: write the checkpoint every this many steps (with ``--checkpoint``).
      eval_batch_size: examples per evaluation batch.
      compile: run the network's forward (and so its backward) through
        :func:`torch.compile` (``nn.Module.compile``: parameter names, hooks and saved
        weights unchanged). Off by default: the fused kernels round differently, so the
        model is the same only up to float rounding (measured 6e-8 on the clipped sum of a
        small CNN), the first steps pay seconds of compilation per micro-batch shape, and
        on the CPU it was slower (1.8 ms against 1.3 ms a step on that CNN). Privacy does
        not rest on it: book-keeping upcasts what the layers recorded and clips with the
        norm of the very contribution it sums.
    """

    physical_batch_size: int = 256
    clipping: str = "auto"
    eval_every: int = 0
    checkpoint_every: int = 100
    eval_batch_size: int = 1024
    compile: bool = False


_PERFORMANCE = tuple(f.name for f in dataclasses.fields(PerformanceOptions))


CLIPPING_MODES = ("flat", "per-layer", "adaptive")


@dataclass(frozen=True)
class DPSGDOptions:
    """Hyper-parameters of one DP-SGD run (De et al. 2022; Tramèr & Boneh 2021).

    Attributes:
      model: ``auto`` (the default; :func:`dpvision.recipes.default_model`: the Tanh CNN
        for 1×28×28 and 3×32×32 images, ``scatter-cnn`` on ScatterNet features, a WRN-16-4
        for other images of 16 pixels a side or more, ``mlp-256`` below), ``tanh-cnn``
        (pixels, 1×28×28 or 3×32×32), ``scatter-cnn`` (ScatterNet
        features), ``wrn-D-K`` (Wide-ResNet with GroupNorm and WS convolutions),
        ``mlp-H`` (tanh MLP with H hidden units on flattened inputs of any size; ``mlp-0``
        is logistic regression), ``timm:NAME``, ``torchvision:NAME`` or
        ``python:MODULE:CALLABLE`` (:mod:`dpvision.models.sources`).
      init: weights to start from (:mod:`dpvision.models.weights`: a state dict ``.pt`` or
        ``.safetensors``, a ``dpvision pretrain`` file, a dpvision checkpoint or model); the
        head starts fresh when the file's does not fit the task.
      finetune: what trains (:mod:`dpvision.models.finetune`): ``all``, ``head``,
        ``norms+head`` or ``bias+head``; the rest is frozen, never clipped nor noised.
      batchnorm: BatchNorm of timm/torchvision/python models: ``freeze`` (running
        statistics kept), ``group-norm`` (fresh GroupNorm), ``auto`` (freeze with ``init``,
        GroupNorm without). Never trained on private batches.
      init_allow_same_dataset: start from weights whose file says they were trained on the
        run's own dataset (refused by default: that training's privacy cost is not in this
        run's ledger). Weights pre-trained on its public slice (``public_fraction``) need
        no such permission.
      batch_size: expected logical batch size B; Poisson sampling at q = B/N.
      steps: logical steps T; if unset, ``epochs``.
      epochs: T = ceil(epochs / q) when ``steps`` is unset.
      learning_rate, momentum, optimizer (``sgd`` or ``adam``), weight_decay: the optimizer
        on the privatised gradient (weight decay acts on the parameters only, no data).
      nesterov: Nesterov momentum for ``sgd``.
      max_grad_norm: C, the per-example clipping norm.
      clipping_mode: ``flat`` (each example's whole gradient clipped to C), ``per-layer``
        (Opacus' ``per_layer``: each of the G layers' part clipped to C/√G; the sensitivity,
        hence the noise, stays C; :mod:`dpvision.per_example.groups`) or ``adaptive``
        (the clip norm, starting at C, follows a quantile of the per-example norms,
        estimated privately each step; :mod:`dpvision.mechanisms.adaptive_clipping`).
        ``dp-sgd`` only.
      target_unclipped_quantile: ``adaptive`` only (Opacus' names from here on): γ, the
        share of examples meant to stay unclipped.
      clipbound_learning_rate: η, the step of the geometric update of C.
      unclipped_num_std: σ_b, the noise on the unclipped count (unset: the expected batch
        size over 20, as Andrew et al. suggest).
      min_clipbound, max_clipbound: the bounds on C.
      normalize_update: divide the noisy sum by C too (jax_privacy ``rescale_to_unit_norm``).
      secure_mode: draw the noise and the Poisson batches from the operating system's
        CSPRNG (:mod:`dpvision.mechanisms.secure`; Opacus' ``secure_mode``): slower, not
        reproducible, no checkpoints; the ledger marks each step ``noise_source = "secure"``.
      augmult: K augmented views per example (0: no augmentation).
      crop_padding, flip, padding_mode: the views' random crop and flip.
      ema_decay: μ of the parameter EMA (0: off); reported accuracy is then the EMA's.
      groups: input GroupNorm groups of ``scatter-cnn`` (0: none, e.g. after private-norm);
        GroupNorm groups of ``wrn``.
      normalization: ``dataset`` (published per-dataset mean/std, public constants) or
        ``none`` (pixels in [0, 1]).
      encoder: ``--method dp-randp`` only: the Phase I encoder file (``dpvision pretrain``);
        unset, Phase I runs first with the ``[pretrain]`` options (cached by them).
      phase2_steps: ``dp-randp``: N₁, the first steps, which train only the head (Phase
        II); the remaining steps train all parameters (Phase III). Unset: 96 (Tang et al.)
        unless ``phase2_fraction`` is given. 0: Phase III only (a warm start).
      phase2_fraction: ``dp-randp``: instead of N₁, the share ε₁/ε of the budget for Phase
        II; N₁ is the most steps whose ε stays within it (1: linear probing only).
      phase2_learning_rate: ``dp-randp``: the Phase II learning rate (unset: learning_rate).
      performance: :class:`PerformanceOptions` (given flat in the ``[learner]`` table).
    """

    model: str = "auto"
    init: str | None = None
    finetune: str = "all"
    batchnorm: str = "auto"
    init_allow_same_dataset: bool = False
    batch_size: int = 256
    steps: int | None = None
    epochs: float | None = 10.0
    learning_rate: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False
    optimizer: str = "sgd"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clipping_mode: str = "flat"
    target_unclipped_quantile: float = 0.5
    clipbound_learning_rate: float = 0.2
    unclipped_num_std: float | None = None
    min_clipbound: float = 1e-6
    max_clipbound: float = 1e6
    normalize_update: bool = False
    secure_mode: bool = False
    augmult: int = 0
    crop_padding: int = 4
    flip: bool = True
    padding_mode: str = "reflect"
    ema_decay: float = 0.0
    groups: int = 27
    normalization: str = "none"
    encoder: str | None = None
    phase2_steps: int | None = None
    phase2_fraction: float | None = None
    phase2_learning_rate: float | None = None
    performance: PerformanceOptions = dataclasses.field(default_factory=PerformanceOptions)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DPSGDOptions":
        """Builds and validates the options; unknown keys and bad values are one-line errors."""
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "performance"}
        fields.update({f.name: f for f in dataclasses.fields(PerformanceOptions)})
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in fields:
                raise DPVisionError(
                    f"unknown learner option {key!r} for dp-sgd; valid: {', '.join(sorted(fields))}"
                )
            values[key] = coerce_option(key, value, _type_name(fields[key].type))
        if "steps" in values and values["steps"] is not None and "epochs" not in values:
            values["epochs"] = None
        performance = PerformanceOptions(
            **{key: values.pop(key) for key in _PERFORMANCE if key in values}
        )
        return cls(**values, performance=performance).validated()

    def to_dict(self) -> dict[str, Any]:
        """The options as the flat ``[learner]`` table."""
        out = dataclasses.asdict(self)
        return {**out, **out.pop("performance")}

    def run_settings(self) -> dict[str, Any]:
        """The options that change the trained model or its privacy (all but
        :class:`PerformanceOptions`): what a checkpoint is tied to."""
        out = dataclasses.asdict(self)
        del out["performance"]
        return out

    def validated(self) -> "DPSGDOptions":
        if self.model != "auto":  # resolved from the image shape when the run starts
            check_model(self.model)
        performance = self.performance
        positive = {
            "batch_size": self.batch_size,
            "physical_batch_size": performance.physical_batch_size,
            "learning_rate": self.learning_rate,
            "max_grad_norm": self.max_grad_norm,
            "eval_batch_size": performance.eval_batch_size,
        }
        for name, value in positive.items():
            if not value > 0:
                raise DPVisionError(f"learner.{name} must be > 0, got {value}")
        if self.clipping_mode not in CLIPPING_MODES:
            raise DPVisionError(
                f"learner.clipping_mode must be one of {', '.join(CLIPPING_MODES)}, got "
                f"{self.clipping_mode!r}"
            )
        if not 0 < self.target_unclipped_quantile < 1:
            raise DPVisionError(
                "learner.target_unclipped_quantile must be in (0, 1), got "
                f"{self.target_unclipped_quantile}"
            )
        bounds = (self.clipbound_learning_rate, self.min_clipbound, self.max_clipbound)
        if not all(value > 0 for value in bounds) or not (
            self.unclipped_num_std is None or self.unclipped_num_std > 0
        ):
            raise DPVisionError(
                "learner.clipbound_learning_rate, unclipped_num_std, min_clipbound and "
                "max_clipbound must be > 0"
            )
        if self.steps is None and self.epochs is None:
            raise DPVisionError("give learner.steps or learner.epochs")
        if self.steps is not None and self.epochs is not None:
            raise DPVisionError("give only one of learner.steps and learner.epochs")
        if self.steps is not None and self.steps < 1:
            raise DPVisionError(f"learner.steps must be >= 1, got {self.steps}")
        if self.epochs is not None and not self.epochs > 0:
            raise DPVisionError(f"learner.epochs must be > 0, got {self.epochs}")
        for name in ("momentum", "weight_decay", "augmult", "crop_padding", "groups"):
            if getattr(self, name) < 0:
                raise DPVisionError(f"learner.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(performance, name) < 0:
                raise DPVisionError(
                    f"learner.{name} must be >= 0, got {getattr(performance, name)}"
                )
        if self.phase2_steps is not None and self.phase2_steps < 0:
            raise DPVisionError(f"learner.phase2_steps must be >= 0, got {self.phase2_steps}")
        if self.phase2_fraction is not None and not 0 <= self.phase2_fraction <= 1:
            raise DPVisionError(
                f"learner.phase2_fraction must be in [0, 1], got {self.phase2_fraction}"
            )
        if self.phase2_steps is not None and self.phase2_fraction is not None:
            raise DPVisionError("give only one of learner.phase2_steps and learner.phase2_fraction")
        if self.phase2_learning_rate is not None and not self.phase2_learning_rate > 0:
            raise DPVisionError(
                f"learner.phase2_learning_rate must be > 0, got {self.phase2_learning_rate}"
            )
        if not 0 <= self.ema_decay < 1:
            raise DPVisionError(f"learner.ema_decay must be in [0, 1), got {self.ema_decay}")
        choices = {
            "optimizer": (self.optimizer, OPTIMIZERS),
            "normalization": (self.normalization, NORMALIZATIONS),
            "padding_mode": (self.padding_mode, PADDING_MODES),
            "clipping": (performance.clipping, CLIPPING_METHODS),
            "finetune": (self.finetune, FINETUNE_MODES),
            "batchnorm": (self.batchnorm, BATCHNORM_MODES),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise DPVisionError(
                    f"unknown learner.{name} {value!r}; choose one of {', '.join(allowed)}"
                )
        return self

    @property
    def batchnorm_mode(self) -> str:
        """``freeze`` or ``group-norm``: what ``auto`` means for this run."""
        if self.batchnorm != "auto":
            return self.batchnorm
        return "freeze" if self.init is not None else "group-norm"

    @property
    def is_transfer(self) -> bool:
        """Whether any DP-RandP option (encoder, Phase II) is set."""
        return any(
            value is not None
            for value in (
                self.encoder,
                self.phase2_steps,
                self.phase2_fraction,
                self.phase2_learning_rate,
            )
        )


def _type_name(kind: Any) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind)


def coerce_option(name: str, value: Any, kind: str, table: str = "learner") -> Any:
    """``value`` as the option ``table.name`` of type ``kind`` (``int``, ``float | None``,
    …): one-line errors naming it."""
    where = f"{table}.{name}"
    optional = "None" in kind
    if value is None and not optional:
        raise DPVisionError(f"{where} cannot be empty")
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        return None
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise DPVisionError(f"{where} must be true or false, got {value!r}")
        return value
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DPVisionError(f"{where} must be a whole number, got {value!r}")
        return value
    if kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise DPVisionError(f"{where} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise DPVisionError(f"{where} must be a string, got {value!r}")
    return value
