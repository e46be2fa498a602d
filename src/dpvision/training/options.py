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

Two options carry Opacus' names: ``clipping`` is the clip policy
(``flat``, ``per_layer``, ``adaptive``; formerly ``clipping_mode``) and ``grad_sample_mode``
how the per-example gradients are computed (``auto``, ``bookkeeping``, ``vmap``; formerly
``clipping``). :func:`current_names` still reads the old names, with a one-line deprecation
warning; :func:`names_before_rename` gives them back where a run's identity is derived from
its options (its secret randomness, its checkpoint's fingerprint), so that a run replays and
resumes across the rename.
"""

import dataclasses
import functools
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpvision.data.augment import PADDING_MODES
from dpvision.errors import DPVisionError
from dpvision.mechanisms.clip_policy import CLIP_POLICIES
from dpvision.models.finetune import FINETUNE_MODES
from dpvision.models.registry import BATCHNORM_MODES, check_model
from dpvision.models.spec import ModelSpec
from dpvision.models.weights import HEAD_INITS
from dpvision.options import Choice, Interval, check, check_known, coerce, option, option_hints
from dpvision.per_example import CLIPPING_METHODS

_log = logging.getLogger(__name__)

OPTIMIZERS = ("sgd", "adam")
NORMALIZATIONS = ("auto", "none", "dataset", "init")
# Finite: an infinite learning rate, clip norm or weight decay is refused with the config.
_POSITIVE = Interval(0, math.inf)
_NON_NEGATIVE = Interval(0, math.inf, closed="left")


@dataclass(frozen=True)
class PerformanceOptions:
    """How a DP-SGD run is executed: the same trained model and the same privacy whatever
    their values.

    Attributes:
      physical_batch_size: examples per micro-batch (each with its K views); memory only.
      grad_sample_mode: ``auto``, ``bookkeeping`` or ``vmap``: how the per-example
        gradients are computed (the same clipped sum, another speed; Opacus' name).
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

    physical_batch_size: int = option(256, _POSITIVE)
    grad_sample_mode: str = option("auto", Choice(CLIPPING_METHODS))
    eval_every: int = option(0, _NON_NEGATIVE)
    checkpoint_every: int = option(100, _NON_NEGATIVE)
    eval_batch_size: int = option(1024, _POSITIVE)
    compile: bool = False


_PERFORMANCE = tuple(f.name for f in dataclasses.fields(PerformanceOptions))


@dataclass(frozen=True)
class DPSGDOptions:
    """Hyper-parameters of one DP-SGD run (De et al. 2022; Tramèr & Boneh 2021).

    The defaults below are this class's; a run of ``method = "dp-sgd"`` (``dpvision
    train``, ``dpvision.train``) first fills the batch, length, learning rate, clip norm and
    optimizer it was not given from the dp-sgd recipe
    (:func:`dpvision.recipes.deep_schedule`: N and ε only).

    Attributes:
      model: ``auto`` (the default; :func:`dpvision.recipes.default_model`: the Tanh CNN
        for 1×28×28 and 3×32×32 images, ``scatter-cnn`` on ScatterNet features, a WRN-16-4
        for other images of 16 pixels a side or more, ``mlp-256`` below), ``tanh-cnn``
        (pixels, 1×28×28 or 3×32×32), ``scatter-cnn`` (ScatterNet
        features), ``wrn-D-K`` (Wide-ResNet with GroupNorm and WS convolutions),
        ``mlp-H`` (tanh MLP with H hidden units on flattened inputs of any size; ``mlp-0``
        is logistic regression), ``timm:NAME``, ``torchvision:NAME`` or
        ``python:MODULE:CALLABLE`` (:mod:`dpvision.models.sources`).
      model_args: keyword arguments for an external model's constructor (a table, e.g.
        ``{img_size = 32}`` for a timm ViT on 32×32 images); recorded in the model file.
      init: weights to start from (:mod:`dpvision.models.weights`: a state dict ``.pt`` or
        ``.safetensors``, a ``dpvision pretrain`` file, a dpvision checkpoint or model); the
        head as ``head_init`` says. ``""`` means none (how ``tune --transfer`` spells
        its scratch candidate).
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
      clipping: the clip policy, as Opacus names it: ``flat`` (each example's whole
        gradient clipped to C), ``per_layer`` (``per-layer`` is read as ``per_layer``: each
        of the G layers' part clipped to C/√G; the sensitivity, hence the noise, stays C;
        :mod:`dpvision.per_example.groups`) or ``adaptive``
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
      normalization: ``dataset`` (published per-dataset mean/std, public constants),
        ``none`` (pixels in [0, 1]), ``init`` (the statistics ``learner.init`` was trained
        with: the ones its file records, else timm's ``pretrained_cfg`` mean/std), or
        ``auto`` (the default): ``init`` when ``learner.init`` is set, else ``none``
        (:func:`dpvision.runs.network.pixel_statistics`).
      head_init: how the classifier starts when ``learner.init`` is set: ``keep`` (the
        file's head when it fits), ``zero`` or ``random`` (the model's own
        initialisation); ``auto`` (the default) keeps the file's head when the file was
        trained on this run's dataset (its classes mean the same) and zeroes it otherwise
        (:func:`dpvision.runs.network.head_init_for`).
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
    model_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    init: str | None = None
    finetune: str = option("all", Choice(FINETUNE_MODES))
    head_init: str = option("auto", Choice(HEAD_INITS))
    batchnorm: str = option("auto", Choice(BATCHNORM_MODES))
    init_allow_same_dataset: bool = False
    batch_size: int = option(256, _POSITIVE)
    steps: int | None = option(None, Interval(1, None, closed="left"))
    epochs: float | None = option(10.0, _POSITIVE)
    learning_rate: float = option(1.0, _POSITIVE)
    momentum: float = option(0.0, _NON_NEGATIVE)
    nesterov: bool = False
    optimizer: str = option("sgd", Choice(OPTIMIZERS))
    weight_decay: float = option(0.0, _NON_NEGATIVE)
    max_grad_norm: float = option(1.0, _POSITIVE)
    clipping: str = option("flat", Choice(CLIP_POLICIES))
    target_unclipped_quantile: float = option(0.5, Interval(0, 1))
    clipbound_learning_rate: float = option(0.2, _POSITIVE)
    unclipped_num_std: float | None = option(None, _POSITIVE)
    min_clipbound: float = option(1e-6, _POSITIVE)
    max_clipbound: float = option(1e6, _POSITIVE)
    normalize_update: bool = False
    secure_mode: bool = False
    augmult: int = option(0, _NON_NEGATIVE)
    crop_padding: int = option(4, _NON_NEGATIVE)
    flip: bool = True
    padding_mode: str = option("reflect", Choice(PADDING_MODES))
    ema_decay: float = option(0.0, Interval(0, 1, closed="left"))
    groups: int = option(27, _NON_NEGATIVE)
    normalization: str = option("auto", Choice(NORMALIZATIONS))
    encoder: str | None = None
    phase2_steps: int | None = option(None, _NON_NEGATIVE)
    phase2_fraction: float | None = option(None, Interval(0, 1, closed="both"))
    phase2_learning_rate: float | None = option(None, _POSITIVE)
    performance: PerformanceOptions = dataclasses.field(default_factory=PerformanceOptions)

    def __post_init__(self) -> None:
        # ``per-layer`` (dpvision's former spelling) is Opacus' ``per_layer``.
        if isinstance(self.clipping, str):
            object.__setattr__(self, "clipping", _policy_name(self.clipping))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DPSGDOptions":
        """Builds and validates the options; unknown keys and bad values are one-line errors.
        The old names of ``clipping`` and ``grad_sample_mode`` are read too
        (:func:`current_names`)."""
        raw = current_names(raw)
        hints = {k: v for k, v in option_hints(cls).items() if k != "performance"}
        hints.update(option_hints(PerformanceOptions))
        check_known(raw, sorted(hints), "unknown learner option {key!r} for dp-sgd; valid: {valid}")
        values = {key: coerce(f"learner.{key}", value, hints[key]) for key, value in raw.items()}
        if values.get("init") == "":  # no weights: how a search spells "from scratch"
            values["init"] = None
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
        if not out["model_args"]:  # as before the option existed: old checkpoints resume
            del out["model_args"]
        if out["head_init"] == "auto":
            del out["head_init"]
        if out["normalization"] == "auto" and self.init is None:  # what "auto" was before
            out["normalization"] = "none"
        return out

    @functools.cached_property
    def spec(self) -> ModelSpec:
        """``model`` parsed once (:class:`~dpvision.models.ModelSpec`; after ``auto`` is
        resolved), for every use in a run."""
        return check_model(self.model).with_args(self.model_args)

    def validated(self) -> "DPSGDOptions":
        """The options if each is in its range (:func:`dpvision.options.check`) and they
        agree with each other; else a one-line error naming the first that does not."""
        if self.model != "auto":  # resolved from the image shape when the run starts
            _ = self.spec
        elif self.model_args:
            raise DPVisionError(
                "learner.model_args is for timm:, torchvision: and python: models: set "
                "learner.model too (e.g. timm:vit_tiny_patch16_224)"
            )
        check(self, prefix="learner.")
        check(self.performance, prefix="learner.")
        if self.steps is None and self.epochs is None:
            raise DPVisionError("give learner.steps or learner.epochs")
        if self.steps is not None and self.epochs is not None:
            raise DPVisionError("give only one of learner.steps and learner.epochs")
        if self.phase2_steps is not None and self.phase2_fraction is not None:
            raise DPVisionError("give only one of learner.phase2_steps and learner.phase2_fraction")
        if self.init is None and (self.normalization == "init" or self.head_init != "auto"):
            key = "normalization = 'init'" if self.normalization == "init" else "head_init"
            raise DPVisionError(f"learner.{key} is about learner.init's weights: set learner.init")
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


def _policy_name(clipping: Any) -> Any:
    """``per-layer`` as Opacus spells it, ``per_layer``; any other name unchanged."""
    return "per_layer" if clipping == "per-layer" else clipping


def _rename(options: dict[str, Any], old: str, new: str, why: str = "") -> None:
    """Moves ``options[old]`` to ``options[new]``, with a one-line deprecation warning."""
    value = options.pop(old)
    if new in options and _policy_name(options[new]) != _policy_name(value):
        raise DPVisionError(
            f"learner.{old} is the old name of learner.{new}, and the two differ "
            f"({value!r}, {options[new]!r}): give only learner.{new}"
        )
    options[new] = value
    shown = json.dumps(_policy_name(value)) if isinstance(value, str) else repr(value)
    _log.warning("learner.%s is deprecated%s: write learner.%s = %s", old, why, new, shown)


def renamed_option(options: Mapping[str, Any], old: str, new: str) -> dict[str, Any]:
    """``options`` (a ``[learner]`` table) with the key ``old`` renamed ``new``, with a
    one-line deprecation warning if it was there; an error if both are given and differ.

    >>> renamed_option({"clipping_mode": "adaptive"}, "clipping_mode", "clipping")
    {'clipping': 'adaptive'}
    """
    out = dict(options)
    if old in out:
        _rename(out, old, new)
    return out


def current_names(options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[learner]`` table of ``dp-sgd``/``dp-randp`` under today's names: ``clipping``
    given as ``auto``, ``bookkeeping`` or ``vmap`` (its old meaning) becomes
    ``grad_sample_mode``, ``clipping_mode`` becomes ``clipping``, each with a one-line
    deprecation warning, and ``clipping = "per-layer"`` is spelt ``per_layer``.

    >>> current_names({"clipping": "vmap", "clipping_mode": "per-layer", "epochs": 2})
    {'epochs': 2, 'grad_sample_mode': 'vmap', 'clipping': 'per_layer'}
    """
    out = dict(options)
    if out.get("clipping") in CLIPPING_METHODS:
        why = (
            " for auto, bookkeeping or vmap (it is now the clip policy: flat, per_layer, adaptive)"
        )
        _rename(out, "clipping", "grad_sample_mode", why)
    if "clipping_mode" in out:
        _rename(out, "clipping_mode", "clipping")
    if isinstance(out.get("clipping"), str):
        out["clipping"] = _policy_name(out["clipping"])
    return out


def names_before_rename(options: Mapping[str, Any]) -> dict[str, Any]:
    """A ``[learner]`` table under its former names and spellings:
    ``clipping`` (the clip policy, ``per_layer`` spelt ``per-layer``) as ``clipping_mode``,
    ``grad_sample_mode`` as ``clipping``.

    What a run's identity is derived from (its secret randomness, its checkpoint's
    fingerprint) goes through this, so that renaming the options changes neither: a run
    given the new names replays (same ``secret_seed``) and resumes (same checkpoint) a run
    given the old ones. A ``clipping`` of its old meaning (``auto``, ``bookkeeping``,
    ``vmap``) is kept.

    >>> names_before_rename({"clipping": "per_layer", "grad_sample_mode": "vmap"})
    {'clipping_mode': 'per-layer', 'clipping': 'vmap'}
    """
    out = dict(options)
    if "clipping" in out and out["clipping"] not in CLIPPING_METHODS:
        policy = out.pop("clipping")
        out["clipping_mode"] = "per-layer" if policy == "per_layer" else policy
    if "grad_sample_mode" in out:
        out["clipping"] = out.pop("grad_sample_mode")
    return out
