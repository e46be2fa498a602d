"""dpvision: differentially private image classification.

The package is organised by differential-privacy concept:

* :mod:`dpvision.accounting` — DpEvents, accountants (RDP, PLD, exact Gaussian, classic RDP),
  calibration of noise and steps, and the privacy ledger. Pure NumPy/SciPy + dp-accounting;
  it never imports torch, so it can be used on its own as a privacy calculator.
* :mod:`dpvision.mechanisms` — the noise that is actually added to released values (torch).

Importing :mod:`dpvision` itself is cheap and imports neither torch nor dp-accounting.
"""

from dpvision.errors import DPVisionError

__version__ = "0.1.0"

__all__ = ["DPVisionError", "__version__"]
