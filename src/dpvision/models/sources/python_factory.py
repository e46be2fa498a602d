"""``python:MODULE:CALLABLE`` or ``python:FILE.py:CALLABLE`` — any factory of an ``nn.Module``.

The factory is called with those of ``num_classes``, ``in_chans`` and ``input_shape`` that its
signature names (all of them if it takes ``**kwargs``). A model whose output does not have
``num_classes`` logits gets its last ``nn.Linear`` replaced (see
:func:`dpvision.models.registry.build_network`).

Running a factory runs the user's code, as ``--config`` files name it: only name code you
trust.
"""

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from dpvision.errors import DPVisionError


def _parts(name: str) -> tuple[str, str]:
    module, colon, attribute = name.rpartition(":")
    if not colon or not module or not attribute:
        raise DPVisionError(
            f"python:{name}: write python:MODULE:CALLABLE or python:FILE.py:CALLABLE"
        )
    return module, attribute


def _module(module: str, spec: str) -> ModuleType:
    if module.endswith(".py"):
        path = Path(module).expanduser()
        if not path.is_file():
            raise DPVisionError(f"{spec}: file {path} not found")
        key = f"dpvision_user_model_{abs(hash(str(path.resolve())))}"
        if key in sys.modules:
            return sys.modules[key]
        loader = importlib.util.spec_from_file_location(key, path)
        assert loader is not None
        assert loader.loader is not None
        loaded = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(loaded)
        except Exception as error:
            raise DPVisionError(f"{spec}: {path} fails to import: {error}") from None
        sys.modules[key] = loaded
        return loaded
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise DPVisionError(f"{spec}: cannot import {module} ({error})") from None


def factory(name: str) -> Callable[..., Any]:
    """The callable ``python:name`` names (one-line errors)."""
    module, attribute = _parts(name)
    spec = f"python:{name}"
    found: Callable[..., Any] | None = getattr(_module(module, spec), attribute, None)
    if not callable(found):
        raise DPVisionError(f"{spec}: {module} has no callable {attribute!r}")
    return found


def check(name: str) -> None:
    """The factory can be found."""
    factory(name)


def build(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    args: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Calls the factory with the arguments its signature names, and ``args``
    (``learner.model_args``), each of which it must take."""
    make = factory(name)
    offered: dict[str, Any] = {
        "num_classes": num_classes,
        "in_chans": int(input_shape[0]),
        "input_shape": tuple(input_shape),
    }
    try:
        parameters = inspect.signature(make).parameters
    except (TypeError, ValueError):
        parameters = {}  # type: ignore[assignment]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        kwargs = offered
    else:
        kwargs = {k: v for k, v in offered.items() if k in parameters}
        unknown = sorted(set(args or {}) - set(parameters))
        if unknown:
            takes = ", ".join(k for k in parameters if k not in offered) or "none"
            raise DPVisionError(
                f"python:{name} takes no argument {unknown[0]!r} (learner.model_args); "
                f"it takes: {takes}"
            )
    kwargs.update(args or {})
    try:
        model = make(**kwargs)
    except Exception as error:
        raise DPVisionError(f"python:{name} failed: {type(error).__name__}: {error}") from None
    if not isinstance(model, nn.Module):
        raise DPVisionError(f"python:{name} returned a {type(model).__name__}, not an nn.Module")
    return model
