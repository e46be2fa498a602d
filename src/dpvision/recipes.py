"""dpvision's default recipe: what a run does with whatever the user leaves ``auto``.

``dpvision train --dataset NAME --epsilon E`` with nothing else runs Tramèr & Boneh's
ScatterNet + linear model: ScatterNet features (J = 2, L = 8), group normalisation (27 groups,
per example, free) and DP-SGD with momentum on a linear head, clip norm 0.1 (on images under
:data:`SCATTER_MIN_SIDE` pixels a side, the pixels as one normalisation group instead of
ScatterNet). Its schedule adapts to the run:

* to ε: the length of the schedule, the batch size and the learning rate come from
  :data:`LINEAR_SCHEDULES`, tuned per ε on a validation split of Fashion-MNIST's training
  set (the nearest tuned ε on a log scale is used);
* to the number of training examples N: the sample rate q = B/N stays the tuned one
  (the batch shrinks with N; it never grows past the tuned batch, so larger sets take more
  steps), and the learning rate follows the batch (:data:`LINEAR_SCHEDULES` gives it per
  512 examples, the linear scaling Tramèr & Boneh used). On digits (N = 1 150) this
  scaled schedule was the best or within 0.7 points of the best of 24 alternatives on the
  validation split at ε = 0.5, 1 and 3;
* to colour: on 3-channel images with at least :data:`COLOUR_MIN_TRAIN` training examples
  at ε ≥ :data:`COLOUR_MIN_EPSILON`, PrivDataNorm (:data:`COLOUR_PREPROCESSING`) instead of
  group-norm, and after it the schedules of :data:`COLOUR_SCHEDULES`, tuned on a validation
  split of CIFAR-10's training set (on its test set, median of 3 seeds: 65.5 % at ε = 3
  where the grey-scale recipe reaches 59.4 % and Tramèr & Boneh's CIFAR-10 config 65.0 %);
* to the image shape: ``dp-sgd``'s ``model = "auto"`` is Tramèr & Boneh's Tanh CNN for the
  two shapes it was made for (1×28×28, 3×32×32; their ScatterNet CNN on ScatterNet
  features), a WRN-16-4 (De et al.) for other images of 16 pixels or more a side, and an
  MLP with one hidden layer of 256 units for smaller ones.

The evidence (validation accuracies of the alternatives, and the recipe's test accuracy at
ε ∈ {0.5, 1, 3, 8} on Fashion-MNIST and digits) is in ``docs/guide/recipes.md``, produced by
``benchmarks/default_recipe.py``.

Privacy: every choice here reads only public facts: ε and δ, the image shape and classes
(from the dataset's registry entry or the config, never the labels) and N, the number of
training examples, which every DP-SGD accountant treats as public (the sample rate B/N).
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ADAM_LEARNING_RATE",
    "AUTO",
    "COLOUR_MIN_EPSILON",
    "COLOUR_MIN_TRAIN",
    "COLOUR_PREPROCESSING",
    "COLOUR_SCHEDULES",
    "DEEP_FIXED",
    "DEEP_LEARNING_RATE_PER_512",
    "DEEP_MAX_BATCH",
    "HEAD_LEARNING_RATE_FACTOR",
    "LINEAR_SCHEDULES",
    "LinearSchedule",
    "deep_schedule",
    "default_features",
    "default_model",
    "default_preprocessing",
    "describe",
    "is_colour",
    "linear_schedule",
    "schedule_for",
]

AUTO = "auto"
RECIPE_METHOD = "dp-sgd-linear"
"""The method of ``method = "auto"``."""

_LINEAR_FIXED = {"clip_norm": 0.1, "optimizer": "momentum", "momentum": 0.9}
_SCATTER_GROUPS = 27
_REFERENCE_N = 60_000


@dataclasses.dataclass(frozen=True)
class LinearSchedule:
    """DP-SGD's schedule on the linear head for one ε, as tuned at a reference N (60 000
    for :data:`LINEAR_SCHEDULES`, 50 000 for :data:`COLOUR_SCHEDULES`).

    Attributes:
      epsilon: the ε it was tuned at.
      batch_size: the expected batch size B at the reference N.
      epochs: the length of the run in passes over the data (steps T = epochs / q).
      learning_rate_per_512: the learning rate divided by B / 512.
    """

    epsilon: float
    batch_size: int
    epochs: float
    learning_rate_per_512: float


LINEAR_SCHEDULES: tuple[LinearSchedule, ...] = (
    LinearSchedule(0.1, 8192, 5, 0.5),
    LinearSchedule(0.5, 4096, 10, 1.0),
    LinearSchedule(1.0, 8192, 20, 1.0),
    LinearSchedule(3.0, 8192, 40, 1.0),
)
"""Tuned on the last 10 000 of Fashion-MNIST's training images
(``benchmarks/feature_learners_fmnist.py``); larger ε run the ε = 3 schedule."""


COLOUR_SCHEDULES: tuple[LinearSchedule, ...] = (
    LinearSchedule(1.0, 8192, 30, 0.25),
    LinearSchedule(3.0, 8192, 60, 0.25),
    LinearSchedule(8.0, 8192, 60, 0.25),
)
"""Schedules for colour images (:func:`is_colour`), after PrivDataNorm: Tramèr & Boneh's
CIFAR-10 schedule (B 8192 at N = 50 000, 60 epochs, lr 4) and its neighbours, chosen on a
10 % validation split of CIFAR-10's training set (``benchmarks/default_recipe.py --part
tune-colour``); a target ε takes the nearest tuned ε on a log scale."""

_COLOUR_REFERENCE_N = 50_000

COLOUR_PREPROCESSING: dict[str, Any] = {
    "kind": "private-norm",
    "noise_multiplier": 8.0,
    "mean_clip": 1.0,
    "square_clip": 1.5,
}
"""PrivDataNorm as Tramèr & Boneh ran it on CIFAR-10 (σ_norm = 8, thresholds 1.0, 1.5): two
private releases of per-channel statistics, counted in the run's ε."""

COLOUR_MIN_TRAIN = 5_000
"""The fewest training examples at which colour images take :data:`COLOUR_PREPROCESSING`:
PrivDataNorm's noise on a channel's mean is σ_norm·τ_m/N, and at N ≥ 40·σ_norm·√K ≈ 5 000
(K = 243 ScatterNet channels of an RGB image) it is at most 1/40 of a channel's share
τ_m/√K of the clipped mean vector; on fewer examples the free per-example group-norm and
the grey-scale schedules are used (a rule of thumb, not a measurement)."""


COLOUR_MIN_EPSILON = 1.0
"""The smallest target ε at which colour images take :data:`COLOUR_PREPROCESSING`: its two
releases at σ_norm = 8 alone cost ε ≈ 0.63 at δ = 1e-5 (PLD), so below 1 they would leave
the gradient steps almost nothing (or no σ at all), and 1 is the smallest ε the colour
schedules were tuned at; below it the free group-norm and the grey-scale schedules."""


def is_colour(channels: int | None, num_train: int | None, epsilon: float | None = None) -> bool:
    """Whether the colour-image recipe applies: 3-channel images, at least
    :data:`COLOUR_MIN_TRAIN` training examples, and a target ε of at least
    :data:`COLOUR_MIN_EPSILON` (``None``: a fixed noise multiplier, no target). Public facts
    only: the shape, N and the config's ε."""
    large_enough = num_train is not None and num_train >= COLOUR_MIN_TRAIN
    budget = epsilon is None or epsilon >= COLOUR_MIN_EPSILON
    return channels == 3 and large_enough and budget


def schedule_for(epsilon: float | None, colour: bool = False) -> LinearSchedule:
    """The tuned schedule nearest to ``epsilon`` on a log scale (grey-scale: ε = 8 and ∞
    take the one tuned at ε = 3; colour: ∞ takes the largest tuned ε); a fixed noise
    multiplier (``None``) takes the one tuned at ε = 3."""
    schedules = COLOUR_SCHEDULES if colour else LINEAR_SCHEDULES
    if epsilon is None:
        return next(s for s in schedules if s.epsilon == 3.0)
    if math.isinf(epsilon):
        return schedules[-1]
    return min(schedules, key=lambda s: abs(math.log(s.epsilon / epsilon)))


def linear_schedule(
    num_train: int, epsilon: float | None, batch_size: int | None = None, *, colour: bool = False
) -> dict[str, Any]:
    """The learner options of ``method = "auto"`` for ``num_train`` training examples at
    target ``epsilon`` (``None``: a fixed σ was given): the tuned sample rate (batch at
    most the tuned batch), the tuned epochs, the learning rate scaled with the batch
    (``batch_size``: the user's, when set); ``colour``: from :data:`COLOUR_SCHEDULES`::

        >>> linear_schedule(60_000, 3.0)["batch_size"], linear_schedule(1_000, 3.0)["batch_size"]
        (8192, 137)
    """
    tuned = schedule_for(epsilon, colour)
    reference = _COLOUR_REFERENCE_N if colour else _REFERENCE_N
    batch = max(1, min(tuned.batch_size, round(tuned.batch_size * num_train / reference)))
    batch = batch_size or batch  # the user's batch: the learning rate follows it
    return {
        **_LINEAR_FIXED,
        "batch_size": batch,
        "epochs": tuned.epochs,
        "learning_rate": tuned.learning_rate_per_512 * batch / 512,
    }


DEEP_FIXED: dict[str, Any] = {"max_grad_norm": 0.1, "optimizer": "sgd", "momentum": 0.9}
"""``dp-sgd``'s clip norm and optimizer: Tramèr & Boneh's for their end-to-end CNNs."""
DEEP_LEARNING_RATE_PER_512 = 0.5
"""``dp-sgd``'s learning rate per 512 examples of batch (Tramèr & Boneh's CNNs on MNIST and
CIFAR-10: lr 0.5 at B 512, lr 1 at B 1024); on 240 images it was the best of
{0.25, 0.5, 1, 2} (``benchmarks/small_folders.py``)."""
DEEP_MAX_BATCH = 1024
"""``dp-sgd``'s batch: half the training set (q = 1/2, the better of q ∈ {0.14, 0.5, 1} on
240 images), at most Tramèr & Boneh's 1024 on CIFAR-10 (larger sets take more steps)."""
HEAD_LEARNING_RATE_FACTOR = 4.0
"""``finetune = "head"`` (the classifier alone) trains at this multiple of the learning rate
of the whole model: measured (issue 40) best at 4× the rate of full fine-tuning on
Fashion-MNIST's public slice (16 against 4, validation accuracy 85.74 % against 85.11 %;
``benchmarks/results/finetune_fmnist.md``)."""
ADAM_LEARNING_RATE = 1e-3
"""The learning rate of ``optimizer = "adam"`` when the user leaves it (torch's default)."""


def deep_schedule(
    num_train: int,
    epsilon: float | None,
    optimizer: str | None = None,
    finetune: str | None = None,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """The learner options of ``dp-sgd`` for ``num_train`` training examples at target
    ``epsilon``, for any model (dpvision's, timm, torchvision, ``python:``): Tramèr &
    Boneh's end-to-end CNN recipe (C = 0.1, SGD with momentum 0.9, learning rate 0.5 per
    512 examples of batch), the batch half the set up to 1024, and the epochs of the
    linear recipe at that ε (:func:`schedule_for`). ``optimizer``: the user's, when set
    (Adam keeps its own learning rate, :data:`ADAM_LEARNING_RATE`, and has no momentum);
    ``finetune = "head"`` (SGD): :data:`HEAD_LEARNING_RATE_FACTOR` × the learning rate;
    ``batch_size``: the user's, when set, which the learning rate then follows::

        >>> deep_schedule(240, 3.0)["batch_size"], deep_schedule(50_000, 3.0)["batch_size"]
        (120, 1024)
    """
    batch = batch_size or max(1, min(DEEP_MAX_BATCH, round(num_train / 2)))
    options = {
        **DEEP_FIXED,
        "batch_size": batch,
        "epochs": schedule_for(epsilon).epochs,
        "learning_rate": DEEP_LEARNING_RATE_PER_512 * batch / 512,
    }
    if optimizer == "adam":
        options.update(optimizer="adam", learning_rate=ADAM_LEARNING_RATE)
        del options["momentum"]
    elif finetune == "head":
        options["learning_rate"] *= HEAD_LEARNING_RATE_FACTOR
    return options


SCATTER_MIN_SIDE = 8
"""The smallest image side on which ``features = "auto"`` scatters: J = 2 averages over
4×4 windows, so smaller images keep too little of their layout (a 6×6 set separable by
left/right brightness fell to chance with ScatterNet, 100 % on pixels)."""


def default_features(method: str, image_shape: Sequence[int] | None = None) -> str:
    """``features = "auto"``: ScatterNet for the linear head (the recipe) on images of
    at least :data:`SCATTER_MIN_SIDE` pixels a side (``image_shape`` = (C, H, W)), else the
    pixels; the pixels for the second-order learners (whose d×d statistics make
    ScatterNet's 3 969 dimensions slow; ``scatternet:pool=2`` is the better choice where it
    fits) and for deep models."""
    if method not in (AUTO, RECIPE_METHOD):
        return "pixels"
    if image_shape is None:
        raise ValueError("the recipe's features depend on the image shape")
    return "scatternet" if min(int(v) for v in image_shape[1:]) >= SCATTER_MIN_SIDE else "pixels"


def default_preprocessing(
    method: str, features: str, channels: int | None = None, colour: bool = False
) -> dict[str, Any]:
    """``preprocessing.kind = "auto"``: for the recipe's linear head on ScatterNet features
    of colour images (``colour``: :func:`is_colour` of the run), PrivDataNorm
    (:data:`COLOUR_PREPROCESSING`); otherwise group normalisation (per example, free) for
    the feature learners: of ScatterNet features in 27 groups; of the pixels of the recipe's
    linear head (``channels`` of them) as one group, so that its clip norm and learning rate
    see features of norm √d either way. None otherwise, and for deep models."""
    if method in ("dp-sgd", "dp-randp"):
        return {"kind": "none"}
    if features.strip().split(":", 1)[0] == "scatternet":
        if method in (AUTO, RECIPE_METHOD) and colour:
            return dict(COLOUR_PREPROCESSING)
        return {"kind": "group-norm", "groups": _SCATTER_GROUPS}
    if features == "pixels" and method in (AUTO, RECIPE_METHOD) and channels is not None:
        return {"kind": "group-norm", "groups": 1, "channels": channels}
    return {"kind": "none"}


def default_model(image_shape: Sequence[int], features: str = "pixels") -> str:
    """``learner.model = "auto"`` of ``dp-sgd`` for images of shape (C, H, W) and its
    features (ScatterNet maps: Tramèr & Boneh's ScatterNet CNN)."""
    if features.strip().split(":", 1)[0] == "scatternet":
        return "scatter-cnn"
    shape = tuple(int(v) for v in image_shape)
    if shape in ((1, 28, 28), (3, 32, 32)):
        return "tanh-cnn"
    if len(shape) == 3 and min(shape[1:]) >= 16:
        return "wrn-16-4"
    return "mlp-256"


def describe(config: dict[str, Any], recipe: dict[str, Any]) -> str:
    """One line: what a run trained and why (``recipe`` as :func:`dpvision.runs.train.fit`
    records it in the result)."""
    learner = config.get("learner", {})
    pre = config.get("preprocessing", {})
    parts = [f"{config['method']} on {config['features']}"]
    if pre.get("kind", "none") != "none":
        count = pre.get("groups")
        groups = (
            f" ({count} group{'s' if count != 1 else ''})" if pre["kind"] == "group-norm" else ""
        )
        parts.append(f"{pre['kind']}{groups}")
    if "model" in learner:
        parts.append(f"model {learner['model']}")
    schedule = [
        f"{name} {learner[key]:.4g}"
        for key, name in (
            ("batch_size", "B"),
            ("epochs", "epochs"),
            ("steps", "steps"),
            ("learning_rate", "lr"),
            ("ema_decay", "EMA"),
            ("clip_norm", "C"),
            ("max_grad_norm", "C"),
        )
        if isinstance(learner.get(key), int | float) and not isinstance(learner.get(key), bool)
    ]
    if schedule:
        parts.append(", ".join(schedule))
    return "; ".join(parts) + f" — {recipe['why']}"
