"""The plan of ``dpvision tune``'s private selection, fixed and public before any training
(:func:`plan_selection`): every candidate checked and its Gaussian releases planned, the
noise calibrated and the selection's ledger written.

Calibration: every candidate trains with its single-run σ for the target ε (RDP, the
accountant that accounts the selection) multiplied by one common factor s ≥ 1, the
smallest for which the whole selection — the candidates' pointwise-maximum RDP curve
(training plus the noisy score), then Papernot & Steinke's bound — stays within the target.

Privacy: the plan depends on the config, the search, the target (ε, δ) and the sizes of
the secret split (published as ``n_train`` and ``n_validation``), never on a pixel or a
label. Each run's ledger is checked against the releases planned here before anything is
released (:mod:`dpvision.runs.tune`).
"""

import dataclasses
import math
from typing import Any

from dpvision.accounting import Repetitions, calibrate_noise_multiplier
from dpvision.accounting.ledger import LedgerEntry, PrivacyLedger, SelectionEntry
from dpvision.accounting.selection import selection_epsilon
from dpvision.config import TrainConfig, override
from dpvision.config.schema import DEEP_METHODS
from dpvision.errors import DPVisionError
from dpvision.features import parse_feature_spec
from dpvision.features.backbone import feature_source
from dpvision.features.spec import NETWORK_FEATURES
from dpvision.learners import LEARNERS
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.recipes import AUTO
from dpvision.runs.auto import apply_recipe, data_facts
from dpvision.runs.schedule import steps_and_rate
from dpvision.runs.search import SCORE_SHARE, Search, TuneSettings, set_items


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate of the search, validated and planned."""

    index: int
    setting: dict[str, Any]
    config: TrainConfig
    count: int  # Gaussian releases of one training run
    sample_rate: float
    single_sigma: float  # σ of one run at the target ε alone
    recipe: dict[str, Any]  # what the default recipe filled in, and why


@dataclasses.dataclass(frozen=True)
class SelectionPlan:
    """The calibrated selection, fixed before any training: all of it public."""

    candidates: list[Candidate]
    repetitions: Repetitions
    score_noise: float
    scale: float  # the common factor s on every candidate's single-run σ
    epsilon: float
    ledger: PrivacyLedger
    num_train: int
    num_validation: int


def plan_selection(
    base: TrainConfig, search: Search, settings: TuneSettings, secret: SecretRandomness
) -> SelectionPlan:
    """Every candidate checked and planned, the noise calibrated and the ledger written.

    Privacy: reads no example, only the sizes of the split every run shares (``secret``'s
    key), which the result publishes as ``n_train`` and ``n_validation``.
    """
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
    return SelectionPlan(
        candidates, repetitions, score_noise, scale, epsilon, ledger, num_train, num_validation
    )


SCORE_NOISE_WARNING = 0.02
"""Above this noise std on the validation accuracy (2 points), tune warns: the candidates
it chooses among rarely differ by much more (docs/guide/tune.md)."""


def score_noise_warning(score_noise: float, num_validation: int, num_train: int) -> str | None:
    """The warning when the score noise swamps the differences the selection must detect;
    ``None`` when it does not.

    A run's released score is its count of correct validation examples plus N(0, σ_v²),
    so the noise on its accuracy has std X = σ_v / n_val (sensitivity 1/n_val of an
    accuracy, times σ_v). Two candidates' scores differ by noise of std √2·X, so a true
    difference below about 2√2·X (two of those stds) is lost: the worse candidate wins
    more than one comparison in 40. X falls to 1 point with n_val = 100·σ_v validation
    examples, a validation fraction of about that over the n_train + n_val rows split.

    Privacy: σ_v and n_val, n_train are already published (the plan line, the result's
    ``tuning``); nothing here reads an example.

    >>> print(score_noise_warning(12.3, 45, 400))  # doctest: +NORMALIZE_WHITESPACE
    tune: the validation scores carry noise of ±27.3 points of accuracy (σ_v = 12.3 on 45
    validation examples), so candidates that differ by less than about 77 points are not
    told apart and the choice is close to random; about 1230 validation examples would bring
    it to ±1 point (more than the 445 examples split into training and validation; a
    smaller --score-noise costs more of ε)
    >>> score_noise_warning(12.3, 6000, 54000) is None
    True
    """
    noise = score_noise / num_validation
    if noise <= SCORE_NOISE_WARNING:
        return None
    needed = math.ceil(100 * score_noise)
    rows = num_train + num_validation
    fraction = math.ceil(1000 * needed / rows) / 1000  # rounded up: at least ``needed``
    how = (
        f"validation_fraction = {fraction:g}"
        if fraction <= 0.5
        else f"more than the {rows} examples split into training and validation; a smaller "
        "--score-noise costs more of ε"
    )
    return (
        f"tune: the validation scores carry noise of ±{100 * noise:.1f} points of accuracy "
        f"(σ_v = {score_noise:.3g} on {num_validation} validation examples), so candidates "
        f"that differ by less than about {200 * math.sqrt(2) * noise:.0f} points are not told "
        f"apart{' and the choice is close to random' if noise > 0.1 else ''}; about "
        f"{needed} validation examples would bring it to ±1 point ({how})"
    )


def _planned_releases(config: TrainConfig, num_train: int) -> tuple[int, float]:
    """(count, q) of the Gaussian releases one training run of ``config`` makes."""
    if config.method == "dp-sgd":
        return steps_and_rate(config.dpsgd, num_train)
    params = {k: v for k, v in config.learner.items() if k != "device"}
    learner = LEARNERS[config.method](**params)
    # No learner's count depends on the feature dimension or the classes (0 here); each
    # run's ledger is checked against this plan before anything is released.
    count, rate = learner._releases(num_train, 0, 0)
    return int(count), float(rate)


# What an image folder's rows are identified by (their pixels as decoded at image_size).
_ROW_IDENTITY_KEYS = ("image_size", "image_channels", "crop_mode", "crop_pct", "interpolation")


def _check_same_rows(base: TrainConfig, search: Search) -> None:
    """Refuses, by the config alone, a search whose candidates would identify the examples
    by other rows and so split them differently: an image folder's decoding options (its
    rows are its pixels at ``image_size``; arrays keep their own rows), or precomputed
    features beside images. Every candidate must train and validate on the same rows, and
    whether two splits happen to have the same sizes depends on the private rows (issue
    48's review: such a search ran or was refused by the data)."""
    searched = set(search.keys)
    folder = base.dataset.strip().lower().startswith("imagefolder:")
    if folder and searched & set(_ROW_IDENTITY_KEYS):
        key = sorted(searched & set(_ROW_IDENTITY_KEYS))[0]
        raise DPVisionError(
            f"--search {key}: an image folder's rows are its images as decoded at one size, "
            "and every candidate must train on the same rows; fix it with --set instead"
        )
    kinds = {
        str(setting.get("features", base.features)).startswith("precomputed")
        for setting in search.candidates()
    }
    if len(kinds) > 1:
        raise DPVisionError(
            "--search features: precomputed feature files and image features are other rows, "
            "and every candidate must train on the same rows; search one kind"
        )


def _check_candidate(config: TrainConfig, setting: dict[str, Any]) -> None:
    where = ", ".join(set_items(setting)) or "the base config"
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
) -> tuple[list[Candidate], int, int]:
    """Every candidate validated and planned before any training; (candidates, N, n_val).
    ``secret``: the tune's, whose validation split every run shares."""
    out: list[Candidate] = []
    sizes: set[tuple[int, int]] = set()
    # Every candidate's config is validated before the first reads the data, so that a bad
    # value anywhere in the search is a one-line error before any work.
    settings = search.candidates()
    configs = [override(base, set_items(setting)) for setting in settings]
    # Every candidate leaves out the rows any candidate's weights were trained on: the same
    # rows for all, whatever the private data holds (:mod:`dpvision.runs.weight_rows`).
    files = sorted({path for config in configs for path in _weight_files(config)})
    if files:
        configs = [
            dataclasses.replace(config, leave_out_rows_of=tuple(files)) for config in configs
        ]
    _check_same_rows(base, search)
    for setting, validated in zip(settings, configs, strict=True):
        _check_candidate(validated, setting)  # again below, with the recipe's preprocessing
    for index, (setting, validated) in enumerate(zip(settings, configs, strict=True)):
        config, recipe = apply_recipe(validated, secret, private_statistics=False)
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
        out.append(Candidate(index, setting, config, count, rate, sigma, recipe))
    if len(sizes) != 1:  # _check_same_rows refused every search that could get here
        raise DPVisionError(
            "every candidate must train on the same split; this is a bug in dpvision, please "
            "report it"
        )
    ((num_train, num_validation),) = sizes
    return out, num_train, num_validation


def _releases(candidate: Candidate, sigma: float, score_noise: float) -> tuple[LedgerEntry, ...]:
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
    candidates: list[Candidate],
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


def _weight_files(config: TrainConfig) -> list[str]:
    """The weight files whose rows ``config``'s run leaves out (its ``learner.init``, its
    feature source, and those it was given)."""
    files = list(config.leave_out_rows_of)
    if config.method in DEEP_METHODS and config.dpsgd.init is not None:
        files.append(config.dpsgd.init)
    elif config.features != AUTO:
        spec = parse_feature_spec(config.features)
        source = feature_source(spec) if spec.name in NETWORK_FEATURES else None
        if source is not None:
            files.append(source)
    return files
