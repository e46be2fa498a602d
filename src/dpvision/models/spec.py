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
"""

import dataclasses
import re

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
    """

    text: str
    kind: str
    name: str
    depth: int | None = None
    width: int | None = None
    hidden: int | None = None

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
