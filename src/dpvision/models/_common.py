"""Argument checks shared by the model constructors.

Every check raises :class:`~dpvision.errors.DPVisionError` with a one-line message that says
what to pass instead.
"""

from collections.abc import Sequence

from dpvision.errors import DPVisionError


def check_num_classes(num_classes: int) -> int:
    """Returns ``num_classes`` if it is an integer of at least 2, else raises.

    Raises:
        DPVisionError: ``num_classes`` is not an integer ≥ 2.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise DPVisionError(f"num_classes must be an integer of at least 2, got {num_classes!r}")
    return num_classes


def check_shape(shape: Sequence[int], name: str) -> tuple[int, int, int]:
    """Returns ``shape`` as a tuple of three positive integers (C, H, W), else raises.

    Raises:
        DPVisionError: ``shape`` is not three positive integers.
    """
    try:
        dims = tuple(int(size) for size in shape)
    except (TypeError, ValueError):
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise DPVisionError(f"{name} must be three positive integers (C, H, W), got {shape!r}")
    return dims[0], dims[1], dims[2]
