"""dpvision: differentially private image classification.

The package is organised by differential-privacy concept:

* :mod:`dpvision.accounting` — DpEvents, accountants (RDP, PLD, exact Gaussian, classic RDP),
  calibration of noise and steps, and the privacy ledger. Pure NumPy/SciPy + dp-accounting;
  it never imports torch, so it can be used on its own as a privacy calculator.
* :mod:`dpvision.mechanisms` — the noise that is actually added to released values (torch).

Importing :mod:`dpvision` itself is cheap and imports neither torch nor dp-accounting.
"""

from typing import Any

from dpvision.errors import DPVisionError
from dpvision.version import __version__

__all__ = ["DPVisionError", "PrivacyEngine", "__version__"]


def __getattr__(name: str) -> Any:
    # PrivacyEngine needs torch; importing it lazily keeps `import dpvision` cheap.
    if name == "PrivacyEngine":
        # local import: start-up time (torch)
        from dpvision.privacy_engine import PrivacyEngine

        return PrivacyEngine
    raise AttributeError(f"module 'dpvision' has no attribute {name!r}")
