"""Loading a :class:`~dpvision.config.schema.TrainConfig`: defaults < TOML file < flags <
``--set`` items, each value read by its field's type hint (:func:`dpvision.options.coerce`),
then validated (:func:`dpvision.config.validation.validate`).
"""

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any

from dpvision.config.schema import TrainConfig
from dpvision.config.validation import validate
from dpvision.errors import DPVisionError
from dpvision.options import check_known, coerce, option_hints

__all__ = ["load_toml", "override", "parse_override", "resolve"]


def load_toml(path: str | Path) -> dict[str, Any]:
    """Reads a TOML file; a missing or malformed file is a one-line error."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise DPVisionError(f"config file {path} not found") from None
    except IsADirectoryError:
        raise DPVisionError(f"config file {path} is a folder; give a .toml file") from None
    except OSError as error:
        raise DPVisionError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise DPVisionError(f"{path} is not valid TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise DPVisionError(f"{path} is not valid TOML: {error}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` → (["a", "b"], value parsed as TOML, or the raw string)."""
    if "=" not in text:
        raise DPVisionError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise DPVisionError(f"--set expects key=value, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.split("."), value


def resolve(
    file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    sets: list[str] | None = None,
) -> TrainConfig:
    """Builds the config: defaults < TOML file < flags (``overrides``; a dict value sets
    keys of that table) < ``--set`` items."""
    raw: dict[str, Any] = load_toml(file) if file is not None else {}
    where = str(file) if file is not None else "config"
    if "noise_multiplier" in raw and "epsilon" not in raw:
        raw["epsilon"] = None  # the file chose a fixed σ over the default target
    given: dict[str, str] = {}  # privacy parameters set on the command line, and how
    for key, value in (overrides or {}).items():
        if isinstance(value, dict):  # a table given as a dict (the Python API)
            for name, item in value.items():
                _assign(raw, [key, name], item, f"{key}.{name}")
        elif value is not None:
            source = f"--{key.replace('_', '-')} {value:g}" if key in _ALTERNATIVE else ""
            _assign(raw, [key], value, source or f"--{key.replace('_', '-')}")
            if source:
                given[key] = source
    for item in sets or []:
        path, value = parse_override(item)
        _assign(raw, path, value, f"--set {item}")
        if len(path) == 1 and path[0] in _ALTERNATIVE:
            given[path[0]] = f"--set {item}"
    if len(given) > 1:
        raise DPVisionError(
            f"{given['epsilon']} and {given['noise_multiplier']} conflict: give a target ε or a "
            "fixed noise multiplier, not both"
        )
    return validate(_build(TrainConfig, raw, where))


def override(config: TrainConfig, items: list[str]) -> TrainConfig:
    """A copy of ``config`` with ``--set``-style ``key=value`` items applied, validated
    (the secret seed carried over, never through the published dict)."""
    raw = config.to_dict()
    for item in items:
        path, value = parse_override(item)
        _assign(raw, path, value, f"--set {item}")
    built = dataclasses.replace(_build(TrainConfig, raw, "config"), secret_seed=config.secret_seed)
    return validate(built)


# A target ε and a fixed σ exclude each other: one given on the command line replaces the
# file's choice; both given on the command line are an error.
_ALTERNATIVE = {"epsilon": "noise_multiplier", "noise_multiplier": "epsilon"}


def _assign(raw: dict[str, Any], path: list[str], value: Any, source: str) -> None:
    node = raw
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise DPVisionError(f"{source}: {part} is not a table")
    node[path[-1]] = value
    if len(path) == 1 and path[0] in _ALTERNATIVE:
        raw[_ALTERNATIVE[path[0]]] = None


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    """An instance of dataclass ``cls`` from the table ``raw``: nested dataclasses from
    sub-tables, ``dict`` fields kept as tables, every other value by its type hint."""
    hints = option_hints(cls)
    secret = {f.name for f in dataclasses.fields(cls) if not f.repr}  # never echoed
    shown = where.replace("{", "{{").replace("}", "}}")
    check_known(raw, sorted(hints), f"{shown}: unknown key {{key!r}}; valid keys: {{valid}}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        hint = hints[key]
        table = dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict
        if table and not isinstance(value, dict):
            raise DPVisionError(f"{where}: [{key}] must be a table")
        if dataclasses.is_dataclass(hint):
            values[key] = _build(hint, value, f"{where} [{key}]")  # type: ignore[arg-type]
        elif table:
            values[key] = dict(value)
        else:
            values[key] = coerce(f"{where}: {key}", value, hint, secret=key in secret)
    return cls(**values)
