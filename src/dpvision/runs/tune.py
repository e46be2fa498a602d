"""``dpvision tune``: private hyper-parameter selection whose cost is in the ledger.

Papernot & Steinke (ICLR 2022): the mechanism Q draws one candidate uniformly at random,
trains it on the training part of a secret split of the private data and releases a noisy
count of the validation examples it classifies correctly; Q runs K times, K drawn from
:class:`~dpvision.accounting.Repetitions`, and only the run with the best noisy score is
released: its model, its candidate, its noisy score. The other runs' scores and models are
discarded, never printed.

Calibration: every candidate trains with its single-run σ for the target ε (RDP, the
accountant that accounts the selection) multiplied by one common factor s ≥ 1, the
smallest for which the whole selection — the candidates' pointwise-maximum RDP curve
(training plus the noisy score), then Papernot & Steinke's bound — stays within the target.

Privacy: Q's releases when it draws candidate c are c's Gaussian releases (its clipped
sums, sensitivity as in each learner) and the count of correct validation examples plus
N(0, σ_v²), sensitivity 1: a neighbouring dataset's extra example lands in the training or
the validation part (a keyed hash of each example under the secret split key, shared by
every run), and Q's RDP is bounded by the sum of the two. The ledger holds one
:class:`~dpvision.accounting.ledger.SelectionEntry` with every candidate's releases; the
reported ε is its RDP bound and never exceeds the target. Each run's ledger is checked
against the releases the selection was calibrated for before anything is released.

The bound holds only while K and the runs stay secret, so every coin of the search comes
from the tune's :class:`~dpvision.mechanisms.secret.SecretRandomness` (derived from
``secret_seed`` and the base config, else fresh OS entropy; in secure mode the score noise
from the CSPRNG itself), never from the public ``seed``: K and the candidates drawn (its
``"tune coins"`` stream), each run's noise, sampling and training (a child secret per run)
and each noisy score. Every run trains with the base's public seed, so the winner's config
does not tell its position. Published (the result, the model file, the log lines): the
selected candidate, its model and noisy score, and what is public before any coin is
drawn — the search, the distribution of K and its mean, the noise factor and multipliers,
σ_v, n_train, n_validation, ε and the ledger. Never published: K, which candidates ran and
in which order, any other run's score, and any timing of the search (a total wall time is
about K times one run's); the runs' own log records and warnings are withheld. Only K = 0
(a Poisson K) shows, inherently: there is no model.
"""

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpvision.accounting import Repetitions, calibrate_noise_multiplier
from dpvision.accounting.ledger import LedgerEntry, PrivacyLedger, SelectionEntry
from dpvision.accounting.selection import selection_epsilon
from dpvision.config import TrainConfig, override, parse_override, resolve, validate
from dpvision.errors import DPVisionError
from dpvision.learners import LEARNERS
from dpvision.log import say
from dpvision.mechanisms import SecureRandom
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.runs.recipe import apply_recipe, data_facts
from dpvision.runs.saved import TrainedModel, privacy_of
from dpvision.runs.train import fit
from dpvision.runs.validation import ValidationRelease

__all__ = [
    "Search",
    "TuneSettings",
    "parse_distribution",
    "parse_search",
    "release_score",
    "run_tune",
    "tune",
]

# What a search may not vary: the budget itself, and what the selection fixes.
_NOT_SEARCHABLE = (
    "epsilon",
    "delta",
    "noise_multiplier",
    "accountant",
    "seed",
    "validation_fraction",
    "public_fraction",
    "dataset",
    "data_dir",
    "num_classes",
)
MAX_CANDIDATES = 1000
DEFAULT_VALIDATION_FRACTION = 0.1
SCORE_SHARE = 0.1
"""The default score noise σ_v is the σ of one Gaussian release that alone is
(SCORE_SHARE · ε, δ)-DP: about 15 at ε = 3, δ = 1e-5 (0.25 % of accuracy on 6 000
validation examples)."""


@dataclasses.dataclass(frozen=True)
class Search:
    """The candidates: every combination of the values of each searched key."""

    keys: tuple[str, ...]
    values: tuple[tuple[Any, ...], ...]

    def candidates(self) -> list[dict[str, Any]]:
        return [
            dict(zip(self.keys, combo, strict=True)) for combo in itertools.product(*self.values)
        ]


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


@dataclasses.dataclass(frozen=True)
class _Candidate:
    index: int
    setting: dict[str, Any]
    config: TrainConfig
    count: int  # Gaussian releases of one training run
    sample_rate: float
    single_sigma: float  # σ of one run at the target ε alone
    recipe: dict[str, Any]  # what the default recipe filled in, and why


def _set_items(setting: dict[str, Any]) -> list[str]:
    return [f"{key}={_toml(value)}" for key, value in setting.items()]


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _planned_releases(config: TrainConfig, num_train: int) -> tuple[int, float]:
    """(count, q) of the Gaussian releases one training run of ``config`` makes."""
    if config.method == "dp-sgd":
        options = config.dpsgd
        q = options.batch_size / num_train
        steps = options.steps if options.steps is not None else math.ceil(options.epochs / q)
        return int(steps), float(q)
    params = {k: v for k, v in config.learner.items() if k != "device"}
    learner = LEARNERS[config.method](**params)
    # No learner's count depends on the feature dimension or the classes (0 here); each
    # run's ledger is checked against this plan before anything is released.
    count, rate = learner._releases(num_train, 0, 0)
    return int(count), float(rate)


def _check_candidate(config: TrainConfig, setting: dict[str, Any]) -> None:
    where = ", ".join(_set_items(setting)) or "the base config"
    if config.method == "dp-randp":
        raise DPVisionError(
            f"{where}: dp-randp spends its budget in two phases; tune the dp-sgd or feature "
            "learners' runs"
        )
    if config.preprocessing.kind in ("private-norm", "center"):
        raise DPVisionError(
            f"{where}: preprocessing.kind = {config.preprocessing.kind} makes releases of its "
            "own, which tune does not calibrate; use group-norm or none"
        )


def _candidates(
    base: TrainConfig, search: Search, secret: SecretRandomness
) -> tuple[list[_Candidate], int, int]:
    """Every candidate validated and planned before any training; (candidates, N, n_val).
    ``secret``: the tune's, whose validation split every run shares."""
    out: list[_Candidate] = []
    sizes: set[tuple[int, int]] = set()
    for index, setting in enumerate(search.candidates()):
        config, recipe = apply_recipe(override(base, _set_items(setting)), secret)
        _check_candidate(config, setting)
        facts = data_facts(config, secret)
        sizes.add((facts.num_train, facts.num_validation))
        count, rate = _planned_releases(config, facts.num_train)
        assert config.epsilon is not None  # checked by run_tune
        sigma = calibrate_noise_multiplier(
            target_epsilon=config.epsilon,
            target_delta=config.delta,
            sample_rate=rate,
            steps=count,
            accountant="rdp",
        )
        out.append(_Candidate(index, setting, config, count, rate, sigma, recipe))
    if len(sizes) != 1:
        raise DPVisionError("every candidate must train on the same split; search no split key")
    ((num_train, num_validation),) = sizes
    return out, num_train, num_validation


def _releases(candidate: _Candidate, sigma: float, score_noise: float) -> tuple[LedgerEntry, ...]:
    return (
        LedgerEntry(
            noise_multiplier=sigma,
            sample_rate=candidate.sample_rate,
            count=candidate.count,
            released=f"candidate {candidate.index}: training releases",
        ),
        LedgerEntry(
            noise_multiplier=score_noise,
            sample_rate=1.0,
            count=1,
            released="noisy count of correct validation examples",
            l2_sensitivity=1.0,
        ),
    )


def _calibrate_scale(
    candidates: list[_Candidate],
    repetitions: Repetitions,
    score_noise: float,
    epsilon: float,
    delta: float,
) -> tuple[float, float]:
    """(s, ε of the selection): the smallest common factor s ≥ 1 on the single-run σ's
    whose selection stays within ``epsilon`` (to 0.1 % below it)."""

    def total(scale: float) -> float:
        events = [
            SelectionEntry(
                candidates=(_releases(c, scale * c.single_sigma, score_noise),),
                mean=repetitions.mean,
                shape=repetitions.shape,
                released="",
            ).candidate_events()[0]
            for c in candidates
        ]
        return selection_epsilon(events, repetitions, delta=delta)

    high = 2.0
    while total(high) > epsilon:
        high *= 2
        if high > 1e4:
            raise DPVisionError(
                f"no noise reaches ε = {epsilon:g} for this selection: the noisy score alone "
                "costs too much; raise --score-noise or lower --mean-runs"
            )
    low = 1.0
    if total(low) <= epsilon:  # cannot happen for K ≥ 1 on average, kept for safety
        return low, total(low)
    while high / low > 1 + 1e-4:
        middle = math.sqrt(low * high)
        if total(middle) > epsilon:
            low = middle
        else:
            high = middle
    return high, total(high)


def run_tune(
    base: TrainConfig,
    search: Search,
    settings: TuneSettings = TuneSettings(),
    *,
    quiet: bool = False,
) -> tuple[dict[str, Any], TrainedModel | None]:
    """Runs the private selection; returns the result (the best run's, with ``tuning``
    and the selection's ledger and ε) and its model — or no model when K = 0 was drawn
    (Poisson), in which case nothing about the data is released.

    Privacy: see the module docstring; the reported ε covers every run and the selection.
    K, the candidates drawn and every run but the best stay secret: the result, the model
    and the log say nothing of them.
    """
    if base.epsilon is None or not math.isfinite(base.epsilon):
        raise DPVisionError("dpvision tune needs a finite target ε: the budget of the whole search")
    if not base.validation_fraction:
        base = dataclasses.replace(base, validation_fraction=DEFAULT_VALIDATION_FRACTION)
    secret = base.secret_randomness()  # secret_seed and this config, else fresh OS bits
    plan = _plan(base, search, settings, secret)
    say(
        f"tune: {len(plan.candidates)} candidates, a secret number of runs K "
        f"({plan.repetitions.describe()}), σ × {plan.scale:.4g} over one run's, score noise "
        f"σ_v = {plan.score_noise:.4g} on {plan.num_validation} validation examples; "
        f"ε = {plan.epsilon:.4f} for the whole search",
        quiet,
    )
    tuning = {
        "search": {
            key: list(values) for key, values in zip(search.keys, search.values, strict=True)
        },
        "candidates": [c.setting for c in plan.candidates],
        "distribution": plan.repetitions.describe(),
        "mean_runs": plan.repetitions.mean,
        "shape": plan.repetitions.shape if math.isfinite(plan.repetitions.shape) else "inf",
        "noise_scale": plan.scale,
        "noise_multipliers": [plan.scale * c.single_sigma for c in plan.candidates],
        "score_noise": plan.score_noise,
        "n_validation": plan.num_validation,
        "n_train": plan.num_train,
    }
    privacy = {
        "epsilon": plan.epsilon,
        "delta": base.delta,
        "accountant": "rdp",
        "privacy_ledger": plan.ledger.to_dict()["entries"],
        "secret_randomness": secret.source,
    }
    best = _hidden_runs(base, plan, secret)
    if best is None:
        say("tune: no run was drawn (K = 0, which a Poisson K allows): nothing released", quiet)
        result = {
            "dataset": plan.candidates[0].config.dataset,
            "method": "tune",
            "selected": None,
            **privacy,
            "noise_multiplier": None,
            "tuning": tuning,
        }
        return result, None
    score, index, result, model = best
    chosen = plan.candidates[index]
    released = {k: v for k, v in result.items() if not _withheld_key(k)}
    released.update(privacy)
    released.update(
        tuning=tuning,
        selected={"candidate": index, "setting": chosen.setting},
        # Post-processing of the noisy count: an accuracy outside [0, 1] says nothing more.
        validation_score_noisy=min(max(score / plan.num_validation, 0.0), 1.0),
        recipe={
            **chosen.recipe,
            "summary": f"{chosen.recipe['summary']}; selected privately from "
            f"{len(plan.candidates)} candidates ({', '.join(_set_items(chosen.setting))})",
        },
    )
    say(
        f"tune: selected candidate {index} "
        f"({', '.join(_set_items(chosen.setting)) or 'the base config'}), noisy validation "
        f"accuracy {100 * min(max(score / plan.num_validation, 0.0), 1.0):.2f} %",
        quiet,
    )
    model = dataclasses.replace(model, privacy=privacy_of(released))
    return released, model


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The calibrated selection, fixed before any training: all of it public."""

    candidates: list[_Candidate]
    repetitions: Repetitions
    score_noise: float
    scale: float  # the common factor s on every candidate's single-run σ
    epsilon: float
    ledger: PrivacyLedger
    num_train: int
    num_validation: int


def _plan(
    base: TrainConfig, search: Search, settings: TuneSettings, secret: SecretRandomness
) -> _Plan:
    """Every candidate checked and planned, the noise calibrated and the ledger written."""
    assert base.epsilon is not None  # checked by run_tune
    candidates, num_train, num_validation = _candidates(base, search, secret)
    repetitions = settings.repetitions(len(candidates))
    score_noise = settings.score_noise
    if score_noise is None:
        score_noise = calibrate_noise_multiplier(
            target_epsilon=SCORE_SHARE * base.epsilon,
            target_delta=base.delta,
            sample_rate=1.0,
            steps=1,
            accountant="rdp",
        )
    if not (math.isfinite(score_noise) and score_noise > 0):
        raise DPVisionError(f"--score-noise must be > 0, got {score_noise}")
    scale, _ = _calibrate_scale(candidates, repetitions, score_noise, base.epsilon, base.delta)
    selection = SelectionEntry(
        candidates=tuple(_releases(c, scale * c.single_sigma, score_noise) for c in candidates),
        mean=repetitions.mean,
        shape=repetitions.shape,
        released="the best of K runs: its model, candidate and noisy validation score",
    )
    ledger = PrivacyLedger()
    ledger.record_selection(selection)
    epsilon = ledger.epsilon(base.delta, "rdp")
    if epsilon > base.epsilon:
        raise DPVisionError(
            f"the selection would spend ε = {epsilon:.6g}, more than its target "
            f"{base.epsilon:g}: this is a bug in dpvision, please report it"
        )
    return _Plan(
        candidates, repetitions, score_noise, scale, epsilon, ledger, num_train, num_validation
    )


def _hidden_runs(
    base: TrainConfig, plan: _Plan, secret: SecretRandomness
) -> tuple[float, int, dict[str, Any], TrainedModel] | None:
    """The K runs, K and their candidates drawn from ``secret``; the best run's (noisy
    score, candidate, result, model), or None when K = 0.

    Privacy: each run trains under its own child of ``secret`` with the base's public seed
    (a seed per run would tell the winner's position), releases nothing about the
    validation rows, and only its exact count of correct validation examples plus secret
    N(0, σ_v²) leaves it; the runs' log records and warnings are withheld.
    """
    coins = secret.numpy("tune coins")
    runs = plan.repetitions.sample(coins)
    drawn = [int(coins.integers(len(plan.candidates))) for _ in range(runs)]
    best: tuple[float, int, dict[str, Any], TrainedModel] | None = None
    for number, index in enumerate(drawn, 1):
        candidate = plan.candidates[index]
        sigma = plan.scale * candidate.single_sigma
        config = dataclasses.replace(candidate.config, epsilon=None, noise_multiplier=sigma)
        selection = ValidationRelease.for_selection()
        with _withheld_output():
            result, model = fit(
                validate(config),
                quiet=True,
                secret=secret.child(f"run {number}"),
                validation=selection,
            )
        _check_ran_as_planned(result, candidate, sigma)
        noise = SecureRandom() if secret.secure else secret.numpy(f"score {number}")
        score = release_score(selection.exact[-1], plan.score_noise, noise)
        if best is None or score > best[0]:
            best = (score, index, result, model)
        del result, model, selection  # the exact count is never kept or shown
    return best


@contextlib.contextmanager
def _withheld_output() -> Iterator[None]:
    """Withholds every log record and Python warning while a run trains: a run is quiet,
    but a warning (e.g. the feature cache's) would still be printed once per run of some
    candidates, and their number and kind would tell K and the candidates drawn."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(record=True):  # recorded, then dropped with the run
            yield
    finally:
        logging.disable(previous)


def tune(
    search: Sequence[str],
    config: str | Path | None = None,
    *,
    distribution: str = "geometric",
    mean_runs: float | None = None,
    score_noise: float | None = None,
    save: str | Path | None = None,
    quiet: bool = True,
    **fields: Any,
) -> tuple[dict[str, Any], TrainedModel | None]:
    """``dpvision tune`` from Python: the result (the best run's, with ``tuning`` and the
    selection's ε) and the selected model (``None`` when K = 0 runs were drawn)::

        result, model = dpvision.tune(["learner.epochs=20,40"], dataset="digits", epsilon=3.0)
        result["epsilon"], result["selected"], model.predict(images)

    ``config`` and ``fields`` build the base run as :func:`dpvision.train` does; bad values
    and bad search specs raise :class:`~dpvision.errors.DPVisionError` before any training.

    Privacy: the result's ε covers every run and the selection, within the target ε.
    """
    parsed = parse_search(search)
    settings = TuneSettings(distribution, mean_runs, score_noise)
    settings.repetitions(len(parsed.candidates()))
    result, model = run_tune(resolve(config, fields), parsed, settings, quiet=quiet)
    if save is not None and model is not None:
        model.save(save)
    return result, model


def release_score(
    correct: int, score_noise: float, rng: np.random.Generator | SecureRandom
) -> float:
    """The released score of one run: the number of correct validation examples plus
    N(0, σ_v²) (from the CSPRNG when ``rng`` is a :class:`SecureRandom`).

    Privacy: adding or removing one validation example changes the count by at most 1
    (L2 sensitivity 1) for a given model; ``score_noise`` is σ_v itself (0 only in tests).
    """
    if not (math.isfinite(score_noise) and score_noise >= 0):
        raise DPVisionError(f"the score noise must be >= 0, got {score_noise}")
    if not score_noise:
        return float(correct)
    if isinstance(rng, SecureRandom):
        return float(correct) + score_noise * float(rng.standard_normal(1)[0])
    return float(correct) + float(rng.normal(0.0, score_noise))


def _withheld_key(key: str) -> bool:
    """Keys of the best run's result that the tune result leaves out: exact statistics of the
    validation examples, and what would tell the run's place among the K (its timings, its
    per-step history; a total wall time would be about K times one run's)."""
    return key.startswith("validation_") or key in (
        "history",
        "epsilon_zcdp",
        "wall_seconds",
        "train_seconds",
    )


def _check_ran_as_planned(result: dict[str, Any], candidate: _Candidate, sigma: float) -> None:
    """The run made exactly the releases the selection was calibrated for."""
    entries = result["privacy_ledger"]
    ok = (
        sum(e["count"] for e in entries) == candidate.count
        and all(math.isclose(e["noise_multiplier"], sigma, rel_tol=1e-12) for e in entries)
        and all(e["sample_rate"] == candidate.sample_rate for e in entries)
    )
    if not ok:
        raise DPVisionError(
            f"candidate {candidate.index} made releases other than the {candidate.count} at "
            f"q = {candidate.sample_rate:g}, σ = {sigma:.6g} it was calibrated for: this is a "
            "bug in dpvision, please report it; nothing was released"
        )
