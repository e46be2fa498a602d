"""Where a model comes from: dpvision's own names, timm, torchvision, or any Python factory.

``learner.model`` is a *model spec*:

* a dpvision name (``tanh-cnn``, ``wrn-16-4``, … :data:`dpvision.models.spec.MODELS_HELP`);
* ``timm:NAME`` — ``timm.create_model(NAME, pretrained=False, num_classes=…, in_chans=…)``;
* ``torchvision:NAME`` — ``torchvision.models.get_model(NAME, weights=None, num_classes=…)``;
* ``python:MODULE:CALLABLE`` or ``python:FILE.py:CALLABLE`` — any factory returning an
  ``nn.Module``; it is given ``num_classes``, ``in_chans`` and ``input_shape`` when its
  signature takes them.

``learner.model_args`` (a table) adds keyword arguments to each of these calls, e.g.
``{img_size = 32}`` for a timm ViT on 32×32 images, ``{drop_path_rate = 0.1}``.

Each source is one small module with ``check(name)`` (syntax and availability, before any
work starts) and ``build(name, input_shape, num_classes, args)``. No source downloads anything:
pre-trained weights come from ``learner.init`` (:mod:`dpvision.models.weights`).

timm and torchvision are the optional ``models`` extra (in an environment of its own: it needs
a newer torch; docs/install.md); the core never imports them.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models.sources import python_factory, timm_models, torchvision_models
from dpvision.models.sources._extra import INSTALL, is_installed

__all__ = ["EXTERNAL_HELP", "INSTALL", "SOURCES", "Source", "missing_package", "split_spec"]


@dataclass(frozen=True)
class Source:
    """One place models come from."""

    check: Callable[[str], None]
    build: Callable[[str, tuple[int, ...], int, Mapping[str, Any]], nn.Module]


SOURCES: dict[str, Source] = {
    "timm": Source(timm_models.check, timm_models.build),
    "torchvision": Source(torchvision_models.check, torchvision_models.build),
    "python": Source(python_factory.check, python_factory.build),
}
"""Prefix of a model spec → its source."""

EXTERNAL_HELP = "timm:NAME, torchvision:NAME, python:MODULE:CALLABLE (or python:FILE.py:CALLABLE)"


def split_spec(spec: str) -> tuple[str | None, str]:
    """``timm:resnet18`` → ("timm", "resnet18"); a dpvision name → (None, name).

    >>> split_spec("timm:resnet18"), split_spec("wrn-16-4")
    (('timm', 'resnet18'), (None, 'wrn-16-4'))
    """
    prefix, colon, rest = spec.partition(":")
    if not colon:
        return None, spec
    if prefix not in SOURCES:
        raise DPVisionError(
            f"unknown model source {prefix!r} in {spec!r}; sources: {', '.join(SOURCES)}"
        )
    if not rest:
        raise DPVisionError(f"model {spec!r} names no model after {prefix}:")
    return prefix, rest


def missing_package(source: str | None) -> str | None:
    """The package of the optional ``models`` extra that a model of ``source`` needs and
    that is not installed (``timm``, ``torchvision``), or None.

    >>> missing_package(None), missing_package("python")
    (None, None)
    """
    if source in ("timm", "torchvision") and not is_installed(source):
        return source
    return None
