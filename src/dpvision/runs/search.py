"""What ``dpvision tune`` searches: the candidates (every combination of the values given
for each searched key, :func:`parse_search`), the distribution of the secret number of runs
K (:func:`parse_distribution`, :class:`TuneSettings`) and the default score noise.

Privacy: all of it is public, fixed before any data is read.
"""

import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from typing import Any

from dpvision.accounting import Repetitions
from dpvision.config import parse_override
from dpvision.errors import DPVisionError
from dpvision.recipes import HEAD_LEARNING_RATE_FACTOR

# What a search may not vary: the budget itself, and what the selection fixes.
_NOT_SEARCHABLE = (
    "epsilon",
    "delta",
    "noise_multiplier",
    "accountant",
    "seed",
    "validation_fraction",
    "public_fraction",
    "split_seed",
    "test_fraction",
    "dataset",
    "data_dir",
    "num_classes",
)
MAX_CANDIDATES = 1000
SCORE_SHARE = 0.1
"""The default score noise σ_v is the σ of one Gaussian release that alone is
(SCORE_SHARE · ε, δ)-DP: about 15 at ε = 3, δ = 1e-5 (0.25 % of accuracy on 6 000
validation examples)."""


@dataclasses.dataclass(frozen=True)
class Search:
    """The candidates: every combination of the values of each searched key, or the
    settings listed in ``rows`` (:func:`transfer_search`; ``keys`` and ``values`` then say
    which values each key takes somewhere)."""

    keys: tuple[str, ...]
    values: tuple[tuple[Any, ...], ...]
    rows: tuple[dict[str, Any], ...] | None = None

    def candidates(self) -> list[dict[str, Any]]:
        if self.rows is not None:
            return [dict(row) for row in self.rows]
        return [
            dict(zip(self.keys, combo, strict=True)) for combo in itertools.product(*self.values)
        ]


def transfer_search(init: str, learning_rate: float | None, extra: Search | None = None) -> Search:
    """``dpvision tune --transfer``: the choice between training from scratch and
    fine-tuning ``learner.init`` — all of it, or the classifier only (linear probing, at
    :data:`HEAD_LEARNING_RATE_FACTOR` × the learning rate) — crossed with the other
    searched keys (``extra``; a searched ``learner.learning_rate`` is scaled for the
    probing candidate too). Scratch is ``learner.init = ""`` (no weights).
    ``learning_rate``: the config's, or None where it leaves it to the dp-sgd recipe, which
    gives the probing candidate the same factor (:func:`dpvision.recipes.deep_schedule`).

    Privacy: public, fixed before any data is read (the config and the flags only).
    """
    for key in ("learner.init", "learner.finetune"):
        if extra is not None and key in extra.keys:
            raise DPVisionError(f"--transfer chooses {key} itself; do not --search it too")
    rows: list[dict[str, Any]] = []
    for setting in extra.candidates() if extra is not None else [{}]:
        rate = setting.get("learner.learning_rate", learning_rate)
        rows.append({**setting, "learner.init": "", "learner.finetune": "all"})
        rows.append({**setting, "learner.init": init, "learner.finetune": "all"})
        probe = {**setting, "learner.init": init, "learner.finetune": "head"}
        if rate is not None:
            probe["learner.learning_rate"] = HEAD_LEARNING_RATE_FACTOR * float(rate)
        rows.append(probe)
    keys = tuple(dict.fromkeys(key for row in rows for key in row))
    values = tuple(
        tuple({repr(row[key]): row[key] for row in rows if key in row}.values()) for key in keys
    )
    return Search(keys, values, tuple(rows))


def parse_search(items: Sequence[str]) -> Search:
    """``["learner.learning_rate=4,8,16", "learner.epochs=20,40"]`` → a :class:`Search`;
    values are parsed as TOML (as ``--set``). Malformed items are one-line errors."""
    if not items:
        raise DPVisionError("give at least one --search KEY=V1,V2,...")
    keys, values = [], []
    for item in items:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise DPVisionError(f"--search expects KEY=V1,V2,..., got {item!r}")
        path, _ = parse_override(item)
        key = ".".join(path)
        if key in keys:
            raise DPVisionError(f"--search {item}: {key} is searched twice; give its values once")
        if key in _NOT_SEARCHABLE:
            raise DPVisionError(
                f"--search {item}: {key} is fixed by the selection, not a hyper-parameter"
            )
        raw = [part.strip() for part in item.split("=", 1)[1].split(",")]
        if not any(raw) or not all(raw):
            raise DPVisionError(f"--search {item}: give values separated by commas, none empty")
        parsed = tuple(parse_override(f"v={part}")[1] for part in raw)
        if len(set(map(repr, parsed))) != len(parsed):
            raise DPVisionError(f"--search {item}: a value is listed twice")
        keys.append(key)
        values.append(parsed)
    search = Search(tuple(keys), tuple(values))
    count = math.prod(len(v) for v in values)
    if count > MAX_CANDIDATES:
        raise DPVisionError(f"the search has {count} candidates; at most {MAX_CANDIDATES}")
    return search


def parse_distribution(text: str, mean: float) -> Repetitions:
    """``geometric`` (η = 1), ``logarithmic`` (η = 0), ``poisson`` or ``tnb:ETA``."""
    name = text.strip().lower()
    shapes = {"geometric": 1.0, "logarithmic": 0.0, "poisson": math.inf}
    if name in shapes:
        return Repetitions(mean, shapes[name])
    if name.startswith("tnb:"):
        try:
            shape = float(name[4:])
        except ValueError:
            shape = math.nan
        if math.isfinite(shape) and shape >= 0:
            return Repetitions(mean, shape)
    raise DPVisionError(
        f"unknown distribution {text!r}; choose geometric, logarithmic, poisson or tnb:ETA "
        "(ETA >= 0)"
    )


@dataclasses.dataclass(frozen=True)
class TuneSettings:
    """How the selection runs.

    Attributes:
      distribution: ``geometric``, ``logarithmic``, ``poisson`` or ``tnb:ETA``: of K.
      mean_runs: E[K]; ``None``: the number of candidates.
      score_noise: σ_v, the std of the noise on the count of correct validation examples
        (sensitivity 1); ``None``: see :data:`SCORE_SHARE`.
    """

    distribution: str = "geometric"
    mean_runs: float | None = None
    score_noise: float | None = None

    def repetitions(self, candidates: int) -> Repetitions:
        mean = float(candidates) if self.mean_runs is None else self.mean_runs
        return parse_distribution(self.distribution, mean)


def set_items(setting: dict[str, Any]) -> list[str]:
    """A candidate's setting as ``--set`` items: ``["learner.epochs=20"]``."""
    return [f"{key}={_toml(value)}" for key, value in setting.items()]


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
