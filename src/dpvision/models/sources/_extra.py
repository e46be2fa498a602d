"""Importing the optional ``models`` extra with a one-line error naming the install command."""

import importlib
import importlib.util
from types import ModuleType

from dpvision.errors import DPVisionError

INSTALL = (
    "in an environment of its own, as docs/install.md ('The models extra') shows; "
    "pip install 'dpvision[models]' into this one would replace torch with a CUDA build "
    "of several GB"
)
"""How to install timm and torchvision: the models extra needs a newer torch than the pinned
one, so the plain ``pip install`` is the wrong advice in the main environment."""


def require(package: str, spec: str) -> ModuleType:
    """``import package``, or a one-line error saying how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise DPVisionError(
            f"learner.model = {spec} needs {package}, which is not installed or does not "
            f"import ({error}); install the models extra: {INSTALL}"
        ) from None


def is_installed(package: str) -> bool:
    """Whether ``package`` can be found, without importing it."""
    return importlib.util.find_spec(package) is not None
