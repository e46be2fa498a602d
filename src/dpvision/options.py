"""Options as a config gives them, read into frozen dataclasses: one coercion by type hint,
declarative constraints in field metadata, one check of them.

A TOML file or a ``--set key=value`` item gives plain values (``3``, ``"sgd"``, ``true``,
``[0.5, 0.75]``, or the raw text when it is not TOML). :func:`coerce` converts one of them to
the type hint of the field it is for (``int``, ``float | None``, ``tuple[float, ...]``,
``Literal["a", "b"]``, …) or raises a one-line :class:`~dpvision.errors.DPVisionError` naming
the option and what it must be. The allowed range of a field is data, not code, as in
scikit-learn's ``_parameter_constraints``: :func:`option` puts :class:`Interval` and
:class:`Choice` constraints in the field's metadata and :func:`check` tests every field of an
instance against them, with messages in jax_privacy's style (``learner.ema_decay must be in
[0, 1), got 1.0``). Checks that relate several fields stay code next to the dataclass.

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True)
... class Options:
...     rate: float = option(0.5, Interval(0, 1, closed="right"))
...     kind: str = option("sgd", Choice(("sgd", "adam")))
>>> hints = option_hints(Options)
>>> check(Options(rate=coerce("rate", 1, hints["rate"])))
Options(rate=1.0, kind='sgd')
>>> check(Options(rate=2.0), prefix="learner.")
Traceback (most recent call last):
...
dpvision.errors.DPVisionError: learner.rate must be in (0, 1], got 2.0
"""

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Collection, Iterable, Mapping
from typing import Any, TypeVar

from dpvision.errors import DPVisionError

__all__ = [
    "Choice",
    "Interval",
    "check",
    "check_known",
    "coerce",
    "option",
    "option_hints",
]

T = TypeVar("T")

CONSTRAINTS = "dpvision.constraints"
"""The key of a field's metadata that holds its constraints."""

_NONE_WORDS = ("none", "null")  # how ``--set key=none`` spells None for an optional option
_MISMATCH = object()


@dataclasses.dataclass(frozen=True)
class Interval:
    """A number between ``low`` and ``high`` (``None``: unbounded on that side).

    ``closed`` says which ends belong to it: ``both``, ``left``, ``right`` or ``neither``.
    NaN is never in an interval. ``kind`` is said before the range (``a whole number``);
    ``note`` after it, in parentheses.

    >>> Interval(0, 1, closed="left").describe()
    'in [0, 1)'
    >>> Interval(0, math.inf, closed="neither").describe()
    '> 0'
    >>> Interval(0, 2**63, closed="left", kind="a whole number").describe()
    'a whole number in [0, 2**63)'
    """

    low: float | None = None
    high: float | None = None
    closed: str = "neither"
    kind: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.closed not in ("both", "left", "right", "neither"):
            raise ValueError(f"closed must be both, left, right or neither, got {self.closed!r}")

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` lies in the interval (written so that NaN never does)."""
        left = self.closed in ("both", "left")
        right = self.closed in ("both", "right")
        if self.low is not None and not (value >= self.low if left else value > self.low):
            return False
        return self.high is None or bool(value <= self.high if right else value < self.high)

    def describe(self) -> str:
        """What the interval allows, as said after ``must be``."""
        left = self.closed in ("both", "left")
        right = self.closed in ("both", "right")
        high = None if self.high is not None and math.isinf(self.high) and not right else self.high
        if self.low is not None and high is not None:
            opening, closing = "[" if left else "(", "]" if right else ")"
            text = f"in {opening}{_bound(self.low)}, {_bound(high)}{closing}"
        elif self.low is not None:
            text = f"{'>=' if left else '>'} {_bound(self.low)}"
        elif high is not None:
            text = f"{'<=' if right else '<'} {_bound(high)}"
        else:
            text = "a number"
        text = f"{self.kind} {text}" if self.kind else text
        return f"{text} ({self.note})" if self.note else text

    def message(self, name: str, value: Any) -> str:
        """The one-line error for ``value`` outside the interval."""
        return f"{name} must be {self.describe()}, got {value}"


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of a fixed set of values.

    >>> Choice(("sgd", "adam")).message("learner.optimizer", "lbfgs")
    "unknown learner.optimizer 'lbfgs'; choose one of: sgd, adam"
    """

    values: tuple[Any, ...]

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is one of the choices."""
        return value in self.values

    def message(self, name: str, value: Any) -> str:
        """The one-line error for a value not among the choices."""
        return f"unknown {name} {value!r}; choose one of: {', '.join(map(str, self.values))}"


Constraint = Interval | Choice


def option(default: Any = dataclasses.MISSING, *constraints: Constraint, **kwargs: Any) -> Any:
    """A dataclass field with ``constraints`` in its metadata (checked by :func:`check`);
    ``kwargs`` go to :func:`dataclasses.field`."""
    return dataclasses.field(default=default, metadata={CONSTRAINTS: constraints}, **kwargs)


def constraints_of(cls: type) -> dict[str, tuple[Constraint, ...]]:
    """Each constrained field of dataclass ``cls`` and its constraints."""
    return {
        f.name: f.metadata[CONSTRAINTS]
        for f in dataclasses.fields(cls)
        if f.metadata.get(CONSTRAINTS)
    }


def check(instance: T, *, prefix: str = "") -> T:
    """``instance`` itself if every field meets its constraints (``None`` meets all: it is
    the unset value of an optional option); else a one-line error naming ``prefix + name``."""
    for name, constraints in constraints_of(type(instance)).items():
        value = getattr(instance, name)
        for constraint in constraints:
            if value is not None and not constraint.accepts(value):
                raise DPVisionError(constraint.message(f"{prefix}{name}", value))
    return instance


def option_hints(cls: type) -> Mapping[str, Any]:
    """The option table of dataclass or class ``cls``: each field (or ``__init__`` keyword)
    and its type hint, resolved (:func:`typing.get_type_hints`)."""
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        return types.MappingProxyType({f.name: hints[f.name] for f in dataclasses.fields(cls)})
    hints = typing.get_type_hints(cls.__init__)  # type: ignore[misc]
    return types.MappingProxyType({k: v for k, v in hints.items() if k != "return"})


ELSEWHERE = {
    "pretrained": "pre-trained weights come from learner.init = FILE: nothing is downloaded, "
    "see docs/guide/finetune.md",
    "weights": "weights come from learner.init = FILE, see docs/guide/finetune.md",
    "lr": "the learning rate is learning_rate",
    "max_norm": "the clipping norm is max_grad_norm (dp-sgd) or clip_norm (feature learners)",
    "noise_multiplier": "σ is top-level noise_multiplier, or calibrated from epsilon",
    "sigma": "σ is top-level noise_multiplier, or calibrated from epsilon",
    "epsilon": "ε is top-level epsilon (--epsilon)",
    "delta": "δ is top-level delta (--delta)",
}
"""Names users bring from timm, Opacus or PyTorch, and where dpvision keeps that setting."""


def check_known(given: Iterable[str], valid: Collection[str], message: str) -> None:
    """A one-line error for the first of ``given`` not in ``valid``. ``message`` is formatted
    with ``key`` (the unknown one) and ``valid`` (the valid ones, joined in their order); a
    name of another library's (:data:`ELSEWHERE`) or a close spelling of a valid one is
    named first:

    >>> check_known(["epoch"], sorted(["epochs", "steps"]),
    ...             "unknown learner option {key!r} for dp-sgd; valid: {valid}")
    Traceback (most recent call last):
    ...
    dpvision.errors.DPVisionError: unknown learner option 'epoch' for dp-sgd (did you mean epochs?); valid: epochs, steps
    """  # noqa: E501 (a doctest's output is one line)
    for key in given:
        if key not in valid:
            text = message.format(key=key, valid=", ".join(valid))
            close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.8)
            hint = ELSEWHERE.get(key) or (f"did you mean {close[0]}?" if close else None)
            if hint and f"{key!r}" in text:
                head, _, tail = text.partition(";")  # the hint before the list of names
                text = f"{head} ({hint});{tail}" if tail else f"{head} ({hint})"
            raise DPVisionError(text)


def coerce(name: str, value: Any, hint: Any, *, secret: bool = False) -> Any:
    """``value`` (from TOML or ``--set``) as the option ``name`` of type ``hint``.

    Whole numbers count as floats (``3`` → ``3.0``) and so does the text of a number
    (``--set epsilon=.5``, which is not TOML); booleans are never numbers; a list is a tuple
    of its elements' type; ``none``/``null`` (any case) is ``None`` for an optional option.
    Hints this function does not know (``Any``, ``dict``) take the value as it is.

    Raises:
      DPVisionError: a one-line message, ``NAME must be WHAT, got VALUE`` (without the
        value when ``secret``: a secret seed is never echoed).

    >>> coerce("learner.epochs", 3, float | None)
    3.0
    >>> coerce("learner.steps", "none", int | None) is None
    True
    >>> coerce("pretrain.milestones", [0.5, 1], tuple[float, ...])
    (0.5, 1.0)
    >>> coerce("learner.clip_norm", "abc", float)
    Traceback (most recent call last):
    ...
    dpvision.errors.DPVisionError: learner.clip_norm must be a number, got 'abc'
    """
    members = _members(hint)
    optional = type(None) in members
    if value is None or (optional and isinstance(value, str) and value.lower() in _NONE_WORDS):
        if optional:
            return None
        raise DPVisionError(f"{name} cannot be empty")
    for lenient in (False, True):  # an exact type first: ``float | str`` keeps "1.5" a string
        for member in members:
            converted = _convert(value, member, lenient=lenient)
            if converted is not _MISMATCH:
                return converted
    shown = "" if secret else f", got {value!r}"
    raise DPVisionError(f"{name} must be {describe(hint)}{shown}")


def describe(hint: Any) -> str:
    """What a value of type ``hint`` is, in words (``a whole number or none``)."""
    members = _members(hint)
    if len(members) > 1:
        return " or ".join("none" if m is type(None) else describe(m) for m in members)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return "a list of numbers" if args[0] in (int, float) else "a list"
        return f"a list of {len(args)} numbers"
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _bound(value: float) -> str:
    """A bound as written in a message: ``2**63`` for a large power of two."""
    if isinstance(value, int) and value >= 2**32 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return str(value) if isinstance(value, int) else f"{value:g}"


def _members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return typing.get_args(hint)
    return (hint,)


def _convert(value: Any, hint: Any, *, lenient: bool) -> Any:
    """``value`` as ``hint``, or ``_MISMATCH``; ``lenient`` also parses a number's text."""
    if hint is type(None):
        return _MISMATCH
    if hint is bool:
        return value if isinstance(value, bool) else _MISMATCH
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _MISMATCH
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if lenient and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return _MISMATCH
        return _MISMATCH
    if hint is str:
        return value if isinstance(value, str) else _MISMATCH
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return value if value in args else _MISMATCH
    if origin is tuple:
        if not isinstance(value, list | tuple):
            return _MISMATCH
        kinds = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(kinds) != len(value):
            return _MISMATCH
        items = [_convert(v, k, lenient=lenient) for v, k in zip(value, kinds, strict=True)]
        return _MISMATCH if any(item is _MISMATCH for item in items) else tuple(items)
    return value
