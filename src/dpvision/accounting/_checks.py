"""Validation of privacy parameters, shared by events, accountants, calibration and ledger.

Each check raises :class:`~dpvision.errors.DPVisionError` with a one-line message that names
the parameter, the value received and the range allowed.
"""

import math

from dpvision.errors import DPVisionError


def _finite(name: str, value: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise DPVisionError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(value):
        raise DPVisionError(f"{name} must be finite, got {value}")
    return value


def check_noise_multiplier(noise_multiplier: float) -> float:
    """Returns σ as a float; σ must be finite and > 0 (σ = 0 would release data unnoised)."""
    value = _finite("noise_multiplier", noise_multiplier)
    if value <= 0:
        raise DPVisionError(f"noise_multiplier must be > 0, got {value}")
    return value


def check_sample_rate(sample_rate: float) -> float:
    """Returns q as a float; q must lie in (0, 1], and q = 1 means full batch."""
    value = _finite("sample_rate", sample_rate)
    if not 0 < value <= 1:
        raise DPVisionError(f"sample_rate must be in (0, 1] (1 = full batch), got {value}")
    return value


def check_delta(delta: float, name: str = "delta") -> float:
    """Returns δ as a float; δ must lie in the open interval (0, 1)."""
    value = _finite(name, delta)
    if not 0 < value < 1:
        raise DPVisionError(f"{name} must be in (0, 1), got {value}")
    return value


def check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    """Returns ε as a float; ε must be finite and > 0."""
    value = _finite(name, epsilon)
    if value <= 0:
        raise DPVisionError(f"{name} must be > 0, got {value}")
    return value


def check_steps(steps: float, name: str = "steps") -> int:
    """Returns the number of steps as an int; it must be a whole number >= 1."""
    if isinstance(steps, bool) or not isinstance(steps, int | float):
        raise DPVisionError(f"{name} must be a whole number >= 1, got {steps!r}")
    if not float(steps).is_integer():
        raise DPVisionError(f"{name} must be a whole number >= 1, got {steps}")
    value = int(steps)
    if value < 1:
        raise DPVisionError(f"{name} must be >= 1, got {value}")
    return value
