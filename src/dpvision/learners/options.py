"""Learner options as a config gives them (TOML values), checked before any data is read:
each value against the type annotation of the estimator's ``__init__``
(:func:`dpvision.options.coerce`), then against the option's allowed range, declared as
data in :data:`PARAMETER_CONSTRAINTS` (scikit-learn's ``_parameter_constraints``), then the
estimator's own checks (:meth:`~dpvision.learners.base.DPLinearClassifier.check_params`).

Every keyword of every learner in :data:`~dpvision.learners.LEARNERS` has an entry in
:data:`PARAMETER_CONSTRAINTS` (``()`` where its type says it all, e.g. a bool), and a test
holds the table to that: an option added without its range would otherwise be checked only
inside ``fit``, after the data were loaded and the features extracted.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpvision.errors import DPVisionError
from dpvision.learners.base import DPLinearClassifier
from dpvision.learners.dp_fc import DPFeatureCovariance
from dpvision.learners.dp_ls import DPLeastSquares
from dpvision.learners.dp_newton import DPNewton
from dpvision.learners.dp_sgd_linear import LOSSES, OPTIMIZERS, DPSGDLinear
from dpvision.options import Choice, Interval, coerce, option_hints

__all__ = ["PARAMETER_CONSTRAINTS", "check_learner_options"]


@dataclass(frozen=True)
class Finite:
    """Any finite number (an initial bias, which may be of either sign)."""

    def accepts(self, value: Any) -> bool:
        return _is_number(value) and math.isfinite(value)

    def describe(self) -> str:
        return "a finite number"


Allowed = Interval | Choice | Finite
"""One alternative of what an option accepts."""

_POSITIVE = Interval(0, math.inf, kind="a number")
_NON_NEGATIVE = Interval(0, math.inf, closed="left", kind="a number")
_FRACTION = Interval(0, 1, closed="left", kind="a number")
_WHOLE = Interval(1, None, closed="left", kind="a whole number")
_RIDGE = (Choice(("auto",)), _NON_NEGATIVE)

_COMMON: dict[str, tuple[Allowed, ...]] = {
    "clip_norm": (_POSITIVE,),
    "chunk_size": (_WHOLE,),
    "num_classes": (Interval(2, None, closed="left", kind="a whole number"),),
    "secure_mode": (),  # a bool: its type says it all
    # Set by the run, never in [learner] (refused by name when the config is validated):
    "target_epsilon": (),
    "target_delta": (),
    "noise_multiplier": (),
    "accountant": (),
    "random_state": (),
    "device": (),  # the run's top-level ``device``; check_params resolves it
}

PARAMETER_CONSTRAINTS: Mapping[type[DPLinearClassifier], Mapping[str, tuple[Allowed, ...]]] = {
    DPLeastSquares: {
        **_COMMON,
        "alpha": (_NON_NEGATIVE,),
        "ridge": _RIDGE,
        "max_block_bytes": (_WHOLE,),
    },
    DPNewton: {
        **_COMMON,
        "iterations": (_WHOLE,),
        "learning_rate": (_POSITIVE,),
        "ridge": _RIDGE,
    },
    DPFeatureCovariance: {
        **_COMMON,
        "bias": (Finite(),),
        "covariance_clip_norm": (_POSITIVE,),
        "epochs": (_WHOLE,),
        "learning_rate": (_POSITIVE,),
        "ridge": _RIDGE,
    },
    DPSGDLinear: {
        **_COMMON,
        "batch_size": (_WHOLE,),
        "betas": (_FRACTION,),  # each of the two
        "bias_init": (Finite(),),
        "clipbound_learning_rate": (_POSITIVE,),
        # flat or adaptive: check_params, whose message names dp-sgd for per_layer
        "clipping": (),
        "clipping_mode": (),
        "sampling_state": (),  # set by the run (secret coins), refused in [learner]
        "ema_decay": (_FRACTION,),
        "epochs": (_POSITIVE,),
        "expected_batch_size": (_POSITIVE,),
        "fit_intercept": (),
        "learning_rate": (_POSITIVE,),
        "loss": (Choice(LOSSES),),
        "max_clipbound": (_POSITIVE,),
        "min_clipbound": (_POSITIVE,),
        "momentum": (_NON_NEGATIVE,),
        "optimizer": (Choice(OPTIMIZERS),),
        "sample_rate": (Interval(0, 1, closed="right", kind="a number"),),
        "steps": (_WHOLE,),
        "target_unclipped_quantile": (Interval(0, 1, kind="a number"),),
        "unclipped_num_std": (_POSITIVE,),
    },
}
"""What each option of each learner accepts: any one of the alternatives listed (``()``:
whatever its type annotation allows). ``None`` is accepted wherever the annotation allows it:
it is the unset value of an optional option."""


def check_learner_options(
    learner: type[DPLinearClassifier], options: dict[str, Any]
) -> dict[str, Any]:
    """The options, checked: one-line errors naming ``learner.KEY`` for a value of the
    wrong type or range, or options that contradict each other.

    Returns the options as given, but for text that :func:`~dpvision.options.coerce` reads
    as a value (``--set learner.clip_norm=.5``, ``--set learner.steps=none``, which are not
    TOML): that is replaced by its value. TOML values are kept as written (a whole number
    stays one), so the published config is the file's.

    >>> from dpvision.learners import DPLeastSquares, DPSGDLinear
    >>> check_learner_options(DPLeastSquares, {"clip_norm": "abc"})
    Traceback (most recent call last):
    ...
    dpvision.errors.DPVisionError: learner.clip_norm must be a number, got 'abc'
    >>> check_learner_options(DPLeastSquares, {"clip_norm": 2, "alpha": "0.5"})
    {'clip_norm': 2, 'alpha': 0.5}
    >>> check_learner_options(DPSGDLinear, {"batch_size": -5})
    Traceback (most recent call last):
    ...
    dpvision.errors.DPVisionError: learner.batch_size must be a whole number >= 1, got -5
    """
    hints = option_hints(learner)
    constraints = PARAMETER_CONSTRAINTS.get(learner, {})
    checked = dict(options)
    for key, value in options.items():
        if key not in hints:
            continue
        coerced = coerce(f"learner.{key}", value, hints[key])
        if isinstance(value, str):
            checked[key] = coerced
        _check_range(f"learner.{key}", coerced, constraints.get(key, ()))
    estimator = learner(**checked)
    _check_together(estimator)
    try:
        estimator.check_params()
    except DPVisionError as error:
        raise DPVisionError(f"learner.{error}") from None
    return checked


def _check_range(name: str, value: Any, allowed: tuple[Allowed, ...]) -> None:
    """One-line error unless ``value`` (each element of a tuple) meets one of ``allowed``."""
    if not allowed or value is None:
        return
    for element in value if isinstance(value, tuple) else (value,):
        if not any(_accepts(constraint, element) for constraint in allowed):
            raise DPVisionError(_message(name, value, allowed))


def _accepts(constraint: Allowed, value: Any) -> bool:
    if isinstance(constraint, Interval):  # numbers only: "auto" is not below 0 nor above
        return _is_number(value) and constraint.accepts(value)
    return constraint.accepts(value)


def _message(name: str, value: Any, allowed: tuple[Allowed, ...]) -> str:
    if len(allowed) == 1 and not isinstance(allowed[0], Finite):
        return allowed[0].message(name, value)
    words = [
        " or ".join(f'"{v}"' for v in c.values) if isinstance(c, Choice) else c.describe()
        for c in allowed
    ]
    return f"{name} must be {' or '.join(words)}, got {value!r}"


def _check_together(estimator: DPLinearClassifier) -> None:
    """Options that are each in range but contradict each other (the estimator's values:
    those given, else its defaults)."""
    clipping = getattr(estimator, "clipping_mode", None) or getattr(estimator, "clipping", None)
    if clipping == "adaptive":
        low, clip, high = (
            getattr(estimator, name) for name in ("min_clipbound", "clip_norm", "max_clipbound")
        )
        if not low <= clip <= high:
            raise DPVisionError(
                "adaptive clipping needs learner.min_clipbound <= learner.clip_norm <= "
                f"learner.max_clipbound, got {low}, {clip}, {high}"
            )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
