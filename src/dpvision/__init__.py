"""dpvision: differentially private image classification.

The package is organised by differential-privacy concept:

* :mod:`dpvision.accounting` — DpEvents, accountants (RDP, PLD, exact Gaussian, classic RDP),
  calibration of noise and steps, and the privacy ledger. Pure NumPy/SciPy + dp-accounting;
  it never imports torch, so it can be used on its own as a privacy calculator.
* :mod:`dpvision.mechanisms` — the noise that is actually added to released values (torch).

From Python, :func:`train` runs ``dpvision train`` and returns its result and model,
:func:`tune` runs ``dpvision tune`` (private hyper-parameter selection),
:func:`load_model` reads a saved model, and :class:`PrivacyEngine` makes your own model and
training loop private::

    import dpvision
    run = dpvision.train(dataset="digits", method="dp-ls", epsilon=3.0, save="model.safetensors")
    model = dpvision.load_model("model.safetensors")

Importing :mod:`dpvision` itself is cheap and imports neither torch nor dp-accounting.
"""

import importlib
from typing import Any

from dpvision.errors import DPVisionError
from dpvision.version import __version__

__all__ = [
    "DPVisionError",
    "PrivacyEngine",
    "TrainedModel",
    "TrainingRun",
    "__version__",
    "load_model",
    "train",
    "tune",
]

# name → module; these need torch, so they are imported on first use (``import dpvision``
# stays cheap).
_LAZY = {
    "PrivacyEngine": "dpvision.privacy_engine",
    "train": "dpvision.runs.train",
    "tune": "dpvision.runs.tune",
    "TrainingRun": "dpvision.runs.train",
    "load_model": "dpvision.runs.saved",
    "TrainedModel": "dpvision.runs.saved",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dpvision' has no attribute {name!r}")
