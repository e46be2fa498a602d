"""Learner options as a config gives them (TOML values), checked before any data is read:
each value against the type annotation of the estimator's ``__init__``, then the
estimator's own range checks (:meth:`~dpvision.learners.base.DPLinearClassifier.check_params`).
"""

import types
import typing
from typing import Any

from dpvision.errors import DPVisionError
from dpvision.learners.base import DPLinearClassifier

__all__ = ["check_learner_options"]


def check_learner_options(learner: type[DPLinearClassifier], options: dict[str, Any]) -> None:
    """One-line errors naming ``learner.KEY`` for a value of the wrong type or range.

    >>> from dpvision.learners import DPLeastSquares
    >>> check_learner_options(DPLeastSquares, {"clip_norm": "abc"})
    Traceback (most recent call last):
    ...
    dpvision.errors.DPVisionError: learner.clip_norm must be a number, got 'abc'
    """
    hints = typing.get_type_hints(learner.__init__)
    for key, value in options.items():
        if key in hints and not _matches(value, hints[key]):
            raise DPVisionError(f"learner.{key} must be {_describe(hints[key])}, got {value!r}")
    try:
        learner(**options).check_params()
    except DPVisionError as error:
        raise DPVisionError(f"learner.{error}") from None


def _matches(value: Any, hint: Any) -> bool:
    """Whether a TOML value fits a type annotation (whole numbers count as floats)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return any(_matches(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) is tuple:
        return (
            isinstance(value, list | tuple)
            and len(value) == len(args)
            and all(_matches(v, a) for v, a in zip(value, args, strict=True))
        )
    return True


def _describe(hint: Any) -> str:
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join(
            "none" if arg is type(None) else _describe(arg) for arg in typing.get_args(hint)
        )
    if typing.get_origin(hint) is tuple:
        return f"a list of {len(typing.get_args(hint))} numbers"
    return names.get(hint, str(hint))
