"""What to extract: the :class:`FeatureSpec` and its text form ``name:key=value,...``.

A spec names a data-independent extractor and the data-independent reductions applied after
it. Its fields are the whole description of the features, so they also form the cache key
(:mod:`dpvision.features.cache`).

>>> spec = parse_feature_spec("scatternet:pool=2")
>>> spec.name, spec.pool, spec.flatten, (spec.scales, spec.angles, spec.max_order)
('scatternet', 2, True, (2, 8, 2))
>>> format_feature_spec(parse_feature_spec("pixels:projection_dim=256,projection_seed=1"))
'pixels:projection_dim=256,projection_seed=1'
>>> spec = parse_feature_spec("encoder:path=/tmp/enc.pt,layers=blocks,grid=2,norm=50")
>>> spec.path, spec.layers, spec.grid, spec.norm
('/tmp/enc.pt', 'blocks', 2, 50.0)
>>> parse_feature_spec("precomputed:path=features/cifar10/vit-b16-i21k").path
'features/cifar10/vit-b16-i21k'
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from dpvision.errors import DPVisionError

__all__ = ["FEATURE_NAMES", "FeatureSpec", "format_feature_spec", "parse_feature_spec"]

FEATURE_NAMES: tuple[str, ...] = ("pixels", "scatternet", "encoder", "backbone", "precomputed")
"""The extractors that :class:`FeatureSpec` can name (``precomputed``: vectors read from
files, :mod:`dpvision.features.precomputed`)."""

NETWORK_FEATURES = ("encoder", "backbone")
"""The extractors that run a network (:mod:`dpvision.features.backbone`)."""

_SCATTERNET_ONLY = ("scales", "angles", "max_order")
ENCODER_ONLY = ("path", "layers", "grid", "norm", "model", "weights", "tokens")
"""The fields that apply to ``encoder`` and ``backbone`` features only (see
:mod:`dpvision.features.backbone`)."""
TOKEN_POOLS = ("mean", "first")


@dataclass(frozen=True)
class FeatureSpec:
    """A data-independent feature extractor followed by data-independent reductions.

    The pipeline is: extractor -> spatial average pooling (``pool``) -> flatten ->
    Gaussian random projection (``projection_dim``). Feature maps are channels-first
    ``(K, h, w)``; flattening keeps that order (for ``pixels``, ``K`` is the image's ``C``).

    Privacy:
        Every stage is a fixed function of one image (and, for the projection, of the public
        ``projection_seed``); none looks at any statistic of the dataset. Extracting features
        therefore releases nothing and costs no privacy budget; the features are exactly as
        private as the images they come from. For ``encoder`` this needs an encoder trained
        without the private data (on synthetic or public images, as its file's metadata
        records); an encoder fitted on the private data is a release of its own.

    For ``encoder`` (a pre-trained body, :mod:`dpvision.features.backbone`) the extractor
    returns vectors, laid out as ``(D, 1, 1)`` maps (every feature is a channel); ``pool``
    does not apply (``grid`` pools each layer's maps instead) and ``norm`` rescales the final
    vector (after any projection). ``precomputed`` (vectors made elsewhere, read from the
    folder ``path``) takes ``path`` alone: nothing is extracted or reduced.

    Attributes:
        name: ``"pixels"`` (``[0, 1]`` pixels), ``"scatternet"`` (2-D scattering transform),
            ``"encoder"`` (the embeddings of a pre-trained encoder file) or ``"precomputed"``
            (feature vectors read from ``.npy`` files).
        pool: Window (and stride) of the spatial average pooling; 1 means no pooling. Windows
            that overhang the border average the positions they cover.
        projection_dim: If set, project the flattened features to this many dimensions with
            a seeded Gaussian matrix (see :func:`dpvision.features.projection_matrix`).
        projection_seed: Seed of the projection matrix (public, chosen before seeing data).
        flatten: Return ``(N, D)`` vectors (``True``) or ``(N, K, h, w)`` maps (``False``).
        scales: ScatterNet only: number of scales ``J``; the maps are ``H / 2**J`` wide.
        angles: ScatterNet only: number of orientations ``L``.
        max_order: ScatterNet only: scattering order, 1 or 2.
        path: Encoder and precomputed only (required): the encoder file (``dpvision
            pretrain``), or the folder of ``x_train.npy``, ``y_train.npy``, ``x_test.npy``
            and ``y_test.npy``; no commas.
        layers: Encoder only: ``"embedding"`` (the input of the head), ``"blocks"`` (every
            block of the body, DP-RandP App. G) or module names joined by ``+``.
        grid: Encoder only: each layer's 4-d output is average-pooled to ``grid × grid``.
        norm: Encoder only: rescale each example's vector to this L2 norm (``None``: keep).
        model: Backbone only (required): a model spec (``timm:NAME``, ``torchvision:NAME``,
            ``python:…``, a dpvision name; :mod:`dpvision.models.sources`); its head is
            replaced by the identity.
        weights: Backbone only: the weights (:mod:`dpvision.models.weights`); unset: the
            initialisation (random features).
        tokens: Encoder and backbone: how a 3-d output ``(N, T, D)`` of a transformer
            layer becomes a vector: ``mean`` over the tokens or the ``first`` (class) token.
    """

    name: str
    pool: int = 1
    projection_dim: int | None = None
    projection_seed: int = 0
    flatten: bool = True
    scales: int = 2
    angles: int = 8
    max_order: int = 2
    path: str | None = None
    layers: str = "embedding"
    grid: int = 1
    norm: float | None = None
    model: str | None = None
    weights: str | None = None
    tokens: str = "mean"

    def __post_init__(self) -> None:
        """Validates the fields.

        Raises:
            DPVisionError: If a field is out of range or does not apply to the extractor.
        """
        if self.name not in FEATURE_NAMES:
            raise DPVisionError(
                f"unknown features {self.name!r}; choose one of: {', '.join(FEATURE_NAMES)}"
            )
        _check_int("pool", self.pool, minimum=1)
        if self.projection_dim is not None:
            _check_int("projection_dim", self.projection_dim, minimum=1)
            if not self.flatten:
                raise DPVisionError(
                    "projection_dim needs flatten=True (a projection returns vectors); "
                    "drop one of the two"
                )
        _check_int("projection_seed", self.projection_seed, minimum=0)
        if not isinstance(self.flatten, bool):
            raise DPVisionError(f"flatten must be true or false, got {self.flatten!r}")
        _check_int("scales", self.scales, minimum=1)
        _check_int("angles", self.angles, minimum=1)
        _check_int("max_order", self.max_order, minimum=1, maximum=2)
        if self.name != "scatternet":
            defaults = FeatureSpec("scatternet")
            for key in _SCATTERNET_ONLY:
                if getattr(self, key) != getattr(defaults, key):
                    raise DPVisionError(
                        f"{key} applies to scatternet features only; remove it from the "
                        f"{self.name} spec"
                    )
        if self.name == "precomputed":
            self._check_precomputed_fields()
        else:
            self._check_encoder_fields()

    def _check_precomputed_fields(self) -> None:
        """``precomputed`` takes ``path`` (required) and nothing else (one-line errors)."""
        defaults = _defaults()
        for key in _field_types():
            if key != "path" and getattr(self, key) != defaults[key]:
                raise DPVisionError(
                    f"{key} does not apply to precomputed features (they are read as they "
                    "are); write precomputed:path=DIR alone"
                )
        if not isinstance(self.path, str) or not self.path.strip():
            raise DPVisionError(
                "precomputed features need their folder: write precomputed:path=DIR (DIR holds "
                "x_train.npy, y_train.npy, x_test.npy, y_test.npy)"
            )

    def _check_encoder_fields(self) -> None:
        """Validates ``path``/``model``/``weights``, ``layers``, ``grid``, ``norm`` and
        ``tokens`` (one-line errors)."""
        defaults = _defaults()
        if self.name not in NETWORK_FEATURES:
            for key in ENCODER_ONLY:
                if getattr(self, key) != defaults[key]:
                    raise DPVisionError(
                        f"{key} applies to encoder and backbone features only; remove it from "
                        f"the {self.name} spec"
                    )
            return
        if self.name == "encoder":
            for key in ("model", "weights"):
                if getattr(self, key) is not None:
                    raise DPVisionError(
                        f"{key} is for backbone features; an encoder file names its model"
                    )
            if not isinstance(self.path, str) or not self.path.strip():
                raise DPVisionError(
                    "encoder features need an encoder file: write encoder:path=ENCODER.pt "
                    "(make one with `dpvision pretrain`)"
                )
        else:
            if self.path is not None:
                raise DPVisionError("backbone features take model= and weights=, not path=")
            if not isinstance(self.model, str) or not self.model.strip():
                raise DPVisionError(
                    "backbone features need a model: write backbone:model=timm:NAME,"
                    "weights=FILE (or torchvision:NAME, python:MODULE:CALLABLE, tanh-cnn, …)"
                )
        if self.tokens not in TOKEN_POOLS:
            raise DPVisionError(
                f"tokens must be one of {', '.join(TOKEN_POOLS)}, got {self.tokens!r}"
            )
        if not isinstance(self.layers, str) or not self.layers.strip():
            raise DPVisionError(
                f"layers must be embedding, blocks or module names joined by '+', "
                f"got {self.layers!r}"
            )
        names = self.layers.split("+")
        if any(not name.strip() or name != name.strip() for name in names):
            raise DPVisionError(f"layers {self.layers!r} has an empty or padded name")
        if len(set(names)) != len(names):
            raise DPVisionError(f"layers {self.layers!r} names a layer twice; keep one")
        if "blocks" in names and len(names) > 1:
            raise DPVisionError("layers=blocks takes every block already; give it alone")
        _check_int("grid", self.grid, minimum=1)
        if self.norm is not None:
            if isinstance(self.norm, bool) or not isinstance(self.norm, int | float):
                raise DPVisionError(f"norm must be a number, got {self.norm!r}")
            if not (math.isfinite(self.norm) and self.norm > 0):
                raise DPVisionError(f"norm must be a positive finite number, got {self.norm}")
            object.__setattr__(self, "norm", float(self.norm))
        if self.pool != 1:
            raise DPVisionError(
                f"pool does not apply to {self.name} features; use grid=G (each layer's maps "
                "are averaged to G × G) or tokens=mean|first"
            )

    def to_dict(self) -> dict[str, Any]:
        """All fields as a JSON-compatible dict (the form stored in cache metadata)."""
        return dataclasses.asdict(self)


def _check_int(key: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    """Raises a one-line :class:`DPVisionError` unless ``minimum <= value <= maximum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise DPVisionError(f"{key} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise DPVisionError(f"{key} must be {allowed}, got {value}")


def _defaults() -> dict[str, Any]:
    """The default value of every field of :class:`FeatureSpec` but ``name``."""
    return {
        field.name: field.default
        for field in dataclasses.fields(FeatureSpec)
        if field.default is not dataclasses.MISSING
    }


def _field_types() -> dict[str, str]:
    """Maps each settable field of :class:`FeatureSpec` to its kind: ``"int"``, ``"int?"``,
    ``"bool"``, ``"str"``, ``"str?"`` or ``"float?"``."""
    return {
        "pool": "int",
        "projection_dim": "int?",
        "projection_seed": "int",
        "flatten": "bool",
        "scales": "int",
        "angles": "int",
        "max_order": "int",
        "path": "str?",
        "layers": "str",
        "grid": "int",
        "norm": "float?",
        "model": "str?",
        "weights": "str?",
        "tokens": "str",
    }


def _parse_value(key: str, kind: str, text: str) -> int | float | bool | str | None:
    """Parses ``text`` as the value of field ``key`` of type ``kind``."""
    if kind.startswith("str"):
        return text.strip()
    lowered = text.strip().lower()
    if kind == "bool":
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise DPVisionError(f"{key} must be true or false, got {text!r}")
    if kind.endswith("?") and lowered in ("none", ""):
        return None
    if kind == "float?":
        try:
            return float(lowered)
        except ValueError:
            raise DPVisionError(f"{key} must be a number, got {text!r}") from None
    try:
        return int(lowered)
    except ValueError:
        raise DPVisionError(f"{key} must be an integer, got {text!r}") from None


def parse_feature_spec(text: str) -> FeatureSpec:
    """Parses ``"name"`` or ``"name:key=value,key=value"`` into a :class:`FeatureSpec`.

    Examples: ``"scatternet"``, ``"pixels"``, ``"scatternet:pool=2"``,
    ``"pixels:projection_dim=256,projection_seed=1"``, ``"scatternet:flatten=false"``,
    ``"encoder:path=/tmp/enc.pt,layers=blocks,grid=2,norm=50"``,
    ``"backbone:model=timm:resnet18,weights=r18.safetensors,layer=layer3"`` (``layer`` is
    ``layers``).

    Args:
        text: The spec, e.g. from ``--features``.

    Returns:
        The validated spec.

    Raises:
        DPVisionError: For an unknown name or key (the message lists the choices), a
            repeated key, or a value of the wrong type or out of range.
    """
    if not isinstance(text, str):
        raise DPVisionError(f"a feature spec must be a string, got {type(text).__name__}")
    name, _, options = text.strip().partition(":")
    name = name.strip()
    if name not in FEATURE_NAMES:
        raise DPVisionError(
            f"unknown features {name!r} in {text!r}; choose one of: {', '.join(FEATURE_NAMES)}"
        )
    types = _field_types()
    values: dict[str, Any] = {}
    for item in options.split(",") if options.strip() else []:
        key, sep, value = item.partition("=")
        key = {"layer": "layers"}.get(key.strip(), key.strip())
        if not sep or key not in types:
            raise DPVisionError(
                f"bad feature option {item.strip()!r} in {text!r}; write key=value with key one "
                f"of: {', '.join(types)}"
            )
        if key in values:
            raise DPVisionError(f"feature option {key!r} is given twice in {text!r}; keep one")
        values[key] = _parse_value(key, types[key], value)
    return FeatureSpec(name, **values)


def format_feature_spec(spec: FeatureSpec) -> str:
    """The shortest text that :func:`parse_feature_spec` turns back into ``spec``.

    Args:
        spec: A feature spec.

    Returns:
        ``name`` followed by ``:key=value,...`` for each field that differs from its default.
    """
    defaults = _defaults()
    changed = [
        f"{key}={_format_value(getattr(spec, key))}"
        for key in _field_types()
        if getattr(spec, key) != defaults[key]
    ]
    return spec.name + (":" + ",".join(changed) if changed else "")


def _format_value(value: object) -> str:
    """The text of a field value: booleans in lower case, everything else as ``str``."""
    return str(value).lower() if isinstance(value, bool) else str(value)
