"""A model spec, parsed once: what ``learner.model`` (and encoder files, ``dpvision
pretrain``, backbone features) name.

``tanh-cnn``, ``scatter-cnn``, ``wrn-DEPTH-WIDTH`` and ``mlp-HIDDEN`` are dpvision's own
models; ``timm:NAME``, ``torchvision:NAME`` and ``python:MODULE:CALLABLE`` come from
elsewhere (:mod:`dpvision.models.sources`). :meth:`ModelSpec.parse` checks the syntax (not
whether an external source can build the name: :func:`dpvision.models.registry.check_model`
asks the source) and every function of :mod:`dpvision.models.registry` takes its result or
the text.

>>> spec = ModelSpec.parse("wrn-16-4")
>>> spec.kind, spec.sizes(), str(spec)
('wrn', {'depth': 16, 'width': 4}, 'wrn-16-4')
>>> ModelSpec.parse("timm:resnet18").source, ModelSpec.parse("timm:resnet18").name
('timm', 'resnet18')

Arguments for the constructor of an external model (``learner.model_args``) ride on the
spec, so every build of the model (training, the forward check, a saved model's rebuild)
gets them:

>>> ModelSpec.parse("timm:vit_tiny_patch16_224").with_args({"img_size": 32}).kwargs
{'img_size': 32}
"""

import dataclasses
import keyword
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpvision.errors import DPVisionError
from dpvision.models.sources import EXTERNAL_HELP, SOURCES, split_spec

__all__ = ["MODELS_HELP", "ModelSpec"]

_WRN = re.compile(r"^wrn-(\d+)-(\d+)$")
_MLP = re.compile(r"^mlp-(\d+)$")
MODELS_HELP = (
    "tanh-cnn, scatter-cnn, wrn-DEPTH-WIDTH (e.g. wrn-16-4), mlp-HIDDEN (e.g. mlp-32), "
    + EXTERNAL_HELP
)
"""The model specs, for messages and help texts."""

RESERVED_ARGS = ("num_classes", "in_chans", "input_shape", "pretrained", "weights")
"""Constructor arguments dpvision sets itself (from the dataset and ``learner.init``)."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A parsed model spec.

    Attributes:
      text: the spec as written (``str(spec)``), what files and messages record.
      kind: ``tanh-cnn``, ``scatter-cnn``, ``wrn``, ``mlp``, or the external source
        (``timm``, ``torchvision``, ``python``).
      name: after the source's prefix for an external spec (``resnet18`` of
        ``timm:resnet18``), else the text.
      depth, width: a WRN's (``wrn-DEPTH-WIDTH``); None for other kinds.
      hidden: an MLP's hidden width (``mlp-HIDDEN``); None for other kinds.
      args: keyword arguments for an external model's constructor (``learner.model_args``),
        as sorted (name, value) pairs, lists as tuples; see :meth:`with_args`.
    """

    text: str
    kind: str
    name: str
    depth: int | None = None
    width: int | None = None
    hidden: int | None = None
    args: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, text: "str | ModelSpec") -> "ModelSpec":
        """The spec ``text`` names (a spec given parsed is returned as it is).

        Raises:
          DPVisionError: one line: an unknown source or name, a source prefix with no name,
            a WRN of impossible depth or width, or not a string at all.
        """
        if isinstance(text, ModelSpec):
            return text
        if not isinstance(text, str):
            raise DPVisionError(f"a model spec must be a string ({MODELS_HELP}), got {text!r}")
        source, rest = split_spec(text)
        if source is not None:
            return cls(text, source, rest)
        if text in ("tanh-cnn", "scatter-cnn"):
            return cls(text, text, text)
        match = _WRN.match(text)
        if match:
            depth, width = int(match.group(1)), int(match.group(2))
            if (depth - 4) % 6 or depth < 10 or width < 1:
                raise DPVisionError(
                    f"model {text}: a WRN needs depth = 6n + 4 >= 10 and width >= 1"
                )
            return cls(text, "wrn", text, depth=depth, width=width)
        match = _MLP.match(text)
        if match:
            return cls(text, "mlp", text, hidden=int(match.group(1)))
        raise DPVisionError(f"unknown model {text!r}; choose one of: {MODELS_HELP}")

    @property
    def source(self) -> str | None:
        """The external source (``timm``, ``torchvision``, ``python``), or None for
        dpvision's own models."""
        return self.kind if self.kind in SOURCES else None

    @property
    def external(self) -> bool:
        """Whether the model comes from timm, torchvision or a Python factory."""
        return self.source is not None

    @property
    def kwargs(self) -> dict[str, Any]:
        """:attr:`args` as keyword arguments (tuples given back as lists, as TOML and JSON
        write them)."""
        return {key: _plain(value) for key, value in self.args}

    def with_args(self, args: Mapping[str, Any] | None) -> "ModelSpec":
        """This spec with the constructor arguments ``args`` (``learner.model_args``).

        Raises:
          DPVisionError: one line: ``args`` given to one of dpvision's own models (their
            sizes are in the name), a name that is not a Python keyword argument, one that
            dpvision sets itself (:data:`RESERVED_ARGS`), or a value that is not a number,
            string, boolean or list of them.
        """
        if not args:
            return dataclasses.replace(self, args=())
        if not isinstance(args, Mapping):
            raise DPVisionError(
                f"learner.model_args must be a table (e.g. {{img_size = 32}}), got {args!r}"
            )
        if not self.external:
            raise DPVisionError(
                f"learner.model_args is for timm:, torchvision: and python: models; {self.text} "
                "takes none (its sizes are in its name, e.g. wrn-16-4, mlp-64; GroupNorm groups "
                "in learner.groups)"
            )
        pairs = []
        for key, value in sorted(args.items()):
            if not (isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key)):
                raise DPVisionError(f"learner.model_args: {key!r} is not an argument name")
            if key in RESERVED_ARGS:
                raise DPVisionError(
                    f"learner.model_args.{key} is set by dpvision (num_classes and in_chans from "
                    "the dataset, weights from learner.init): remove it"
                )
            pairs.append((key, _frozen(f"learner.model_args.{key}", value)))
        return dataclasses.replace(self, args=tuple(pairs))

    def absolute(self) -> "ModelSpec":
        """This spec with a ``python:FILE.py:CALLABLE`` factory's file as an absolute path
        (resolved against the working directory now), so that a model file recording it
        can be loaded from any directory; every other spec as it is.

        >>> ModelSpec.parse("wrn-16-4").absolute().text
        'wrn-16-4'
        """
        module, colon, attribute = self.name.rpartition(":")
        if self.kind != "python" or not colon or not module.endswith(".py"):
            return self
        path = Path(module).expanduser().resolve()
        return dataclasses.replace(
            self, text=f"python:{path}:{attribute}", name=f"{path}:{attribute}"
        )

    def sizes(self) -> dict[str, int]:
        """The sizes the name carries: ``{"depth", "width"}`` of a WRN, ``{"hidden"}`` of an
        MLP, else none."""
        if self.kind == "wrn":
            assert self.depth is not None
            assert self.width is not None
            return {"depth": self.depth, "width": self.width}
        if self.kind == "mlp":
            assert self.hidden is not None
            return {"hidden": self.hidden}
        return {}

    def __str__(self) -> str:
        return self.text


def _frozen(name: str, value: Any) -> Any:
    """``value`` if it is a number, string or boolean; a list as a tuple of such values."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(name, item) for item in value)
    if isinstance(value, bool | int | str) or (isinstance(value, float) and math.isfinite(value)):
        return value
    raise DPVisionError(
        f"{name} must be a number, string, true/false or a list of them, got {value!r}"
    )


def _plain(value: Any) -> Any:
    return [_plain(item) for item in value] if isinstance(value, tuple) else value
