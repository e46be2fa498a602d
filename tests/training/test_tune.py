"""``dpvision tune``: the best candidate is found, nothing exact is released, the search
itself (K, the draws, their order, timings) stays secret, bad specs are one line."""

import dataclasses
import json
import logging
import math

import numpy as np
import pytest

import dpvision
from dpvision.accounting import PrivacyLedger, Repetitions
from dpvision.cli import main
from dpvision.config import TrainConfig, resolve
from dpvision.errors import DPVisionError
from dpvision.log import configure
from dpvision.runs import tune as tune_module
from dpvision.runs.search import Search
from dpvision.runs.tune import (
    DEFAULT_VALIDATION_FRACTION,
    TuneSettings,
    parse_search,
    plan_selection,
    release_score,
    run_tune,
    tune_secret,
)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def separable(tmp_path):
    """Two classes told apart by which half of a 6×6 image is bright."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 3000)
    x = rng.random((3000, 6, 6)) * 60
    x[y == 1, :, :3] += 150
    x[y == 0, :, 3:] += 150
    path = tmp_path / "halves.npz"
    x = x.astype(np.uint8)
    np.savez(path, x_train=x[:2500], y_train=y[:2500], x_test=x[2500:], y_test=y[2500:])
    return path


def test_the_best_candidate_is_found_whenever_it_is_drawn(separable):
    """ScatterNet keeps no layout of 6×6 images (chance, measured 53 %); the pixels separate
    the halves (100 %). Whenever K's runs draw the good candidate it is the one released,
    and a candidate never drawn never is. The draws are secret: the test replays them from
    each secret seed (:func:`_secret_draws`; the secret depends on the config, so on this
    test's data path) and tunes with three secrets that draw the good candidate and one that
    draws only the other, each with at most 3 runs (speed). DP-FC trains in a fraction of
    DP-SGD's time and tells the features apart as clearly."""
    search = parse_search(["features='scatternet','pixels'"])
    sets = [f"dataset='npz:{separable}'", "num_classes=2", "method='dp-fc'"]
    chosen: dict[bool, list[TrainConfig]] = {True: [], False: []}
    for seed in range(200):
        base = resolve(sets=[*sets, f"secret_seed={seed}"])
        drawn = _secret_draws(base, search, TuneSettings(mean_runs=6.0))
        if len(drawn) <= 3 and len(chosen[1 in drawn]) < (3 if 1 in drawn else 1):
            chosen[1 in drawn].append(base)
    assert len(chosen[True]) == 3  # P(no seed of 200 qualifies) is negligible
    assert len(chosen[False]) == 1
    for good, bases in chosen.items():
        for base in bases:
            result, model = run_tune(base, search, TuneSettings(mean_runs=6.0), quiet=True)
            assert model is not None
            assert result["selected"]["candidate"] == int(good)
            if good:
                assert result["test_accuracy"] > 0.95
            assert result["epsilon"] <= 3.0


def _secret_draws(base: TrainConfig, search: Search, settings: TuneSettings) -> list[int]:
    """The candidates the tune's secret coins draw, in order (len: K), replayed from the
    base config's ``secret_seed`` (with the search, the settings and the rows) as its
    holder can and no one else."""
    if not base.validation_fraction:
        base = dataclasses.replace(base, validation_fraction=DEFAULT_VALIDATION_FRACTION)
    secret = tune_secret(base, search, settings)
    plan = plan_selection(base, search, settings, secret)  # binds the rows, as the tune
    coins = secret.coins("tune coins")
    runs = plan.repetitions.sample(coins)
    return [int(coins.integers(len(plan.candidates))) for _ in range(runs)]


def _digits(*sets: str) -> TrainConfig:
    return resolve(
        sets=["dataset='digits'", "method='dp-fc'", "features='pixels'", "learner.epochs=2", *sets]
    )


def _keys(value: object, path: str = "") -> set[str]:
    """Every key of a JSON value, nested keys dotted (list items share their list's path)."""
    if isinstance(value, dict):
        return {f"{path}{k}" for k in value} | {
            key for k, v in value.items() for key in _keys(v, f"{path}{k}.")
        }
    if isinstance(value, list):
        return {key for v in value for key in _keys(v, path)}
    return set()


HIDDEN = {"runs", "drawn", "tuning_seconds", "wall_seconds", "train_seconds", "history"}


def _hidden_keys(result: dict) -> set[str]:
    """The keys of ``result``, at any depth, that would tell K, the draws or a timing."""
    return {key for key in _keys(result) if key.rsplit(".", 1)[-1] in HIDDEN}


SECRET = 987654321987  # a distinctive secret seed: searched for in every published byte


def test_neither_k_nor_the_draws_nor_timings_are_published(tmp_path, capsys, monkeypatch):
    """The result JSON, the model file, stdout, stderr and the log file of ``dpvision tune``
    say nothing of K, the candidates drawn, their order or any run's timing, and never the
    secret seed; the winner's config has the base's public seed, not one per run."""
    search, settings = parse_search(["learner.learning_rate=0.1,0.5"]), TuneSettings(mean_runs=3.0)
    # A secret whose coins draw both candidates for this command (its config, rows, search).
    secret = next(
        seed
        for seed in range(SECRET, SECRET + 200)
        if len(set(_secret_draws(_digits("epsilon=2", "seed=7", f"secret_seed={seed}"),
                                 search, settings))) == 2
    )  # fmt: skip
    drawn, original_fit = [], tune_module.fit

    def counting_fit(config, **kwargs):
        drawn.append(config.learner["learning_rate"])
        return original_fit(config, **kwargs)

    monkeypatch.setattr(tune_module, "fit", counting_fit)
    out, saved, log = tmp_path / "tuned.json", tmp_path / "m.safetensors", tmp_path / "log.txt"
    argv = [
        "tune", "--dataset", "digits", "--method", "dp-fc", "--set", "features='pixels'",
        "--set", "learner.epochs=2", "--search", "learner.learning_rate=0.1,0.5",
        "--mean-runs", "3", "--epsilon", "2", "--seed", "7", "--secret-seed", str(secret),
        "--json", str(out), "--save", str(saved), "--log-file", str(log),
    ]  # fmt: skip
    try:
        assert main(argv) == 0
    finally:
        configure()  # closes the log file: later tests log to the console only
    printed = capsys.readouterr()
    assert len(drawn) >= 2  # the test has something to hide
    assert set(drawn) == {0.1, 0.5}
    text = out.read_text()
    result = json.loads(text)
    assert not _hidden_keys(result)
    assert result["seed"] == result["config"]["seed"] == 7
    assert dpvision.load_model(saved).config["seed"] == 7
    assert str(secret) not in text
    assert str(secret) not in log.read_text()
    blob = saved.read_bytes()
    assert str(secret).encode() not in blob
    assert secret.to_bytes(8, "little") not in blob
    progress = [line for line in printed.err.splitlines() if line.startswith("[dpvision]")]
    # one line before the search, the score-noise warning (139 validation digits), one after
    assert len(progress) == 3, printed.err
    winner = result["selected"]["candidate"]
    assert f"selected candidate {winner} (" in progress[-1]
    loser = f"candidate {1 - winner} (learner"  # drawn too, never to be named
    for words in (f"K = {len(drawn)}", "run 1/", f"{len(drawn)} runs", loser):
        assert words not in printed.err + printed.out + log.read_text()


def test_the_published_search_is_the_same_whatever_k_the_coins_draw(monkeypatch, capsys):
    """With the same secret (so the same split) and K forced to 0, 1 or 4 (a Poisson K can
    be any of them): the ``tuning`` entry and the first progress line are identical, the
    results of K = 1 and K = 4 have the same keys, and K = 0's are a subset of them (it has
    no model: inherent). Warnings a run logs are withheld, as their number would tell K."""
    configure()
    base = _digits("secret_seed=5")
    search = parse_search(["learner.learning_rate=0.1,0.5"])
    original_fit = tune_module.fit

    def noisy_fit(*args, **kwargs):
        logging.getLogger("dpvision.features.cache").warning("a warning of one run")
        return original_fit(*args, **kwargs)

    monkeypatch.setattr(tune_module, "fit", noisy_fit)
    results, lines = {}, {}
    for runs in (0, 1, 4):
        monkeypatch.setattr(Repetitions, "sample", lambda self, rng, runs=runs: runs)
        results[runs], model = run_tune(base, search, TuneSettings("poisson", 2.0), quiet=False)
        assert (model is None) == (runs == 0)
        lines[runs] = capsys.readouterr().err.splitlines()
    assert results[0]["tuning"] == results[1]["tuning"] == results[4]["tuning"]
    assert _keys(results[1]) == _keys(results[4])
    assert set(results[0]) < set(results[1])
    assert lines[0][0] == lines[1][0] == lines[4][0]
    assert [len(lines[runs]) for runs in (0, 1, 4)] == [3, 3, 3], lines  # plan, warning, end
    assert not any("warning of one run" in line for line in lines[1] + lines[4])


def _secret_seed_drawing(accept, *sets: str) -> TrainConfig:  # type: ignore[no-untyped-def]
    """The first base config (secret seeds 0, 1, ...) whose secret coins' draws ``accept``."""
    for secret in range(200):
        base = _digits(*sets, f"secret_seed={SECRET + secret}")
        if accept(base):
            return base
    raise AssertionError("no secret seed of 200 draws what the test needs")


def test_k_zero_from_the_secret_coins_releases_no_model_and_no_timing():
    search = parse_search(["learner.learning_rate=0.1,0.5"])
    settings = TuneSettings("poisson", 1.0)
    base = _secret_seed_drawing(lambda b: not _secret_draws(b, search, settings))
    assert _secret_draws(base, search, settings) == []  # K = 0 for this secret
    result, model = run_tune(base, search, settings, quiet=True)
    assert model is None
    assert result["selected"] is None
    assert not _hidden_keys(result)


def test_k_the_draws_every_run_and_the_score_noise_come_from_the_secret(monkeypatch):
    """The runs are those the secret's ``"tune coins"`` draw, in that order; each trains
    with the base's public seed under its own child secret and releases nothing about the
    validation rows; the score noise of a run changes with the secret, not the seed."""
    calls, noises = [], []
    original_fit, original_score = tune_module.fit, tune_module.release_score

    def spy_fit(config, *, quiet, secret, validation):
        calls.append((config.seed, config.learner["learning_rate"], secret.seed("noise")))
        assert validation.mode == "selection"
        return original_fit(config, quiet=quiet, secret=secret, validation=validation)

    def spy_score(correct, score_noise, rng):
        score = original_score(correct, score_noise, rng)
        noises.append(score - correct)
        return score

    monkeypatch.setattr(tune_module, "fit", spy_fit)
    monkeypatch.setattr(tune_module, "release_score", spy_score)
    search = parse_search(["learner.learning_rate=0.1,0.5"])
    base = _secret_seed_drawing(
        lambda b: set(_secret_draws(b, search, TuneSettings(mean_runs=3.0))) == {0, 1}, "seed=7"
    )
    run_tune(base, search, TuneSettings(mean_runs=3.0), quiet=True)
    drawn = _secret_draws(base, search, TuneSettings(mean_runs=3.0))
    assert len(drawn) >= 2  # the test has an order to check
    assert set(drawn) == {0, 1}
    assert [rate for _, rate, _ in calls] == [(0.1, 0.5)[index] for index in drawn]
    assert {seed for seed, _, _ in calls} == {7}
    assert len({noise_seed for _, _, noise_seed in calls}) == len(drawn)  # a secret per run
    first = noises[0]
    calls.clear()
    noises.clear()
    run_tune(
        dataclasses.replace(base, secret_seed=base.secret_seed + 1000),
        search,
        TuneSettings(mean_runs=3.0),
        quiet=True,
    )
    assert noises[0] != first  # same public seed and run number, another secret


def test_a_secret_seed_replays_the_tune_and_fresh_secrets_differ():
    """The same ``secret_seed``: the same selection, noisy score and model (research
    replay); without it, fresh OS entropy: the models differ (their noise is continuous:
    equal with probability 0; the noisy scores are not, being clamped to [0, 1], and two
    fresh runs on digits were both seen at 1.0)."""
    search = parse_search(["learner.learning_rate=0.1,0.5"])
    settings = TuneSettings(mean_runs=2.0)
    replays = [run_tune(_digits("secret_seed=11"), search, settings, quiet=True) for _ in "ab"]
    (first, model_a), (second, model_b) = replays
    assert first["selected"] == second["selected"]
    assert first["validation_score_noisy"] == second["validation_score_noisy"]
    assert np.array_equal(model_a.coef, model_b.coef)
    fresh = [run_tune(_digits(), search, settings, quiet=True)[1] for _ in "ab"]
    assert not np.array_equal(fresh[0].coef, fresh[1].coef)


def test_an_adversary_with_every_public_input_reproduces_neither_score_nor_model():
    """The adversary knows the code, the config with its public seed and the data (here
    all of it): rerunning tune with them — fresh secret, or guessing the secret seed is the
    public one — yields another noisy score and another model."""
    search = parse_search(["learner.learning_rate=0.1,0.5"])
    settings = TuneSettings(mean_runs=2.0)
    # Half the rows held out: score noise of ±2 points, so no score is clamped at 100 %.
    public = ("seed=7", "validation_fraction=0.5")
    published, model = run_tune(_digits(*public), search, settings, quiet=True)
    assert model is not None
    assert published["seed"] == 7
    for guess in ([], ["secret_seed=7"]):
        rerun, again = run_tune(_digits(*public, *guess), search, settings, quiet=True)
        assert again is not None
        assert rerun["validation_score_noisy"] != published["validation_score_noisy"]
        assert not np.array_equal(again.coef, model.coef)


def test_nothing_exact_about_the_validation_examples_is_released(separable, tmp_path):
    out = tmp_path / "tuned.json"
    saved = tmp_path / "tuned.safetensors"
    argv = [
        "tune", "--quiet", "--dataset", f"npz:{separable}", "--set", "num_classes=2",
        "--set", "learner.epochs=3", "--search", "learner.learning_rate=0.1,0.5",
        "--mean-runs", "2", "--epsilon", "2", "--json", str(out), "--save", str(saved),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert not [key for key in result if key.startswith("validation_") and "noisy" not in key]
    assert "history" not in result
    ledger = PrivacyLedger.from_dict({**_ledger_header(), "entries": result["privacy_ledger"]})
    assert ledger.epsilon(1e-5, "rdp") == pytest.approx(result["epsilon"], rel=1e-12)
    assert result["epsilon"] <= 2.0
    # the saved model carries the selection's ledger, not the single run's
    assert main(["evaluate", "--quiet", str(saved), "--dataset", f"npz:{separable}"]) == 0


def _ledger_header():
    return {"format": "dpvision-ledger/1", "neighboring_relation": "add_or_remove_one"}


def test_the_score_moves_by_at_most_one_when_a_validation_example_is_added():
    """Neighbouring validation sets (one added example, whatever its norm), noise off: the
    count of correct examples — the score's release — moves by at most its sensitivity 1."""
    rng = np.random.default_rng(0)
    coef = rng.normal(size=(3, 5))
    x, y = rng.normal(size=(50, 5)), rng.integers(0, 3, 50)
    huge = np.full((1, 5), 1e12)
    for label in range(3):
        neighbour_x, neighbour_y = np.vstack([x, huge]), np.append(y, label)
        counts = [
            int(((features @ coef.T).argmax(1) == labels).sum())
            for features, labels in ((x, y), (neighbour_x, neighbour_y))
        ]
        scores = [release_score(c, 0.0, np.random.default_rng(1)) for c in counts]
        assert abs(scores[1] - scores[0]) <= 1
    assert release_score(10, 5.0, np.random.default_rng(1)) != 10  # noise on by default use
    with pytest.raises(DPVisionError, match="score noise must be >= 0"):
        release_score(10, -1.0, np.random.default_rng(1))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give at least one --search"),
        (["--search", "learner.learning_rate"], "--search expects KEY=V1,V2"),
        (["--search", "=1,2"], "--search expects KEY=V1,V2"),
        (["--search", "learner.learning_rate=1,,2"], "none empty"),
        (["--search", "learner.learning_rate="], "none empty"),
        (["--search", "learner.learning_rate=1,1"], "a value is listed twice"),
        (["--search", "learner.epochs=1,2", "--search", "learner.epochs=3"], "searched twice"),
        (["--search", "epsilon=1,2"], "epsilon is fixed by the selection"),
        (["--search", "learner.lerning_rate=1,2"], "unknown learner option 'lerning_rate'"),
        (["--search", "learner.epochs=1,-2"], "epochs"),
        (["--search", "learner.epochs=1,2", "--distribution", "zipf"], "unknown distribution"),
        (["--search", "learner.epochs=1,2", "--distribution", "tnb:-1"], "unknown distribution"),
        (["--search", "learner.epochs=1,2", "--mean-runs", "0.5"], "mean number of runs"),
        (["--search", "learner.epochs=1,2", "--epsilon", "inf"], "needs a finite target"),
        (["--search", "learner.epochs=1,2", "--method", "dp-randp"], "dp-randp"),
        (
            ["--search", "learner.epochs=1,2", "--set", "preprocessing.kind=center"],
            "makes releases of its own",
        ),
    ],
)
def test_bad_searches_are_one_line_before_any_training(argv, message, capsys, tmp_path):
    out = tmp_path / "never.json"
    code = main(["tune", "--quiet", "--json", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_more_runs_cost_more_noise():
    """The selection's price: a larger E[K] needs a larger factor on every run's σ."""
    base = resolve(sets=["method='dp-sgd-linear'", "features='pixels'", "learner.epochs=1"])
    search = parse_search(["learner.learning_rate=0.1,0.2"])
    scales = []
    for mean in (1.0, 4.0, 16.0):
        result, _ = run_tune(base, search, TuneSettings(mean_runs=mean), quiet=True)
        scales.append(result["tuning"]["noise_scale"])
    assert 1.0 < scales[0] < scales[1] < scales[2]
    assert math.isfinite(scales[2])


def test_the_python_entry_point_mirrors_the_command(tmp_path):
    saved = tmp_path / "m.safetensors"
    result, model = dpvision.tune(
        ["learner.learning_rate=0.1,0.5"],
        dataset="digits",
        epsilon=2.0,
        mean_runs=2,
        learner={"epochs": 2},
        save=saved,
    )
    assert result["epsilon"] <= 2.0
    assert result["selected"]["setting"]["learner.learning_rate"] in (0.1, 0.5)
    assert dpvision.load_model(saved).epsilon == result["epsilon"]
    assert model.predict(np.zeros((2, 8, 8, 1), dtype=np.uint8)).shape == (2,)
    with pytest.raises(DPVisionError, match="give at least one --search"):
        dpvision.tune([], dataset="digits")
