"""Learner options as a config gives them (TOML values), checked before any data is read:
each value against the type annotation of the estimator's ``__init__``
(:func:`dpvision.options.coerce`), then the estimator's own range checks
(:meth:`~dpvision.learners.base.DPLinearClassifier.check_params`).
"""

from typing import Any

from dpvision.errors import DPVisionError
from dpvision.learners.base import DPLinearClassifier
from dpvision.options import coerce, option_hints

__all__ = ["check_learner_options"]


def check_learner_options(
    learner: type[DPLinearClassifier], options: dict[str, Any]
) -> dict[str, Any]:
    """The options, checked: one-line errors naming ``learner.KEY`` for a value of the
    wrong type or range.

    Returns the options as given, but for text that :func:`~dpvision.options.coerce` reads
    as a value (``--set learner.clip_norm=.5``, ``--set learner.steps=none``, which are not
    TOML): that is replaced by its value. TOML values are kept as written (a whole number
    stays one), so the published config is the file's.

    >>> from dpvision.learners import DPLeastSquares
    >>> check_learner_options(DPLeastSquares, {"clip_norm": "abc"})
    Traceback (most recent call last):
    ...
    dpvision.errors.DPVisionError: learner.clip_norm must be a number, got 'abc'
    >>> check_learner_options(DPLeastSquares, {"clip_norm": 2, "alpha": "0.5"})
    {'clip_norm': 2, 'alpha': 0.5}
    """
    hints = option_hints(learner)
    checked = dict(options)
    for key, value in options.items():
        if key in hints:
            coerced = coerce(f"learner.{key}", value, hints[key])
            if isinstance(value, str):
                checked[key] = coerced
    try:
        learner(**checked).check_params()
    except DPVisionError as error:
        raise DPVisionError(f"learner.{error}") from None
    return checked
