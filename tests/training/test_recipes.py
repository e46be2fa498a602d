"""The default recipe: what ``auto`` resolves to, from public facts only."""

import json
import math

import numpy as np
import pytest

from dpvision.cli import main
from dpvision.config import resolve
from dpvision.recipes import (
    COLOUR_MIN_EPSILON,
    COLOUR_MIN_TRAIN,
    COLOUR_PREPROCESSING,
    COLOUR_SCHEDULES,
    LINEAR_SCHEDULES,
    deep_schedule,
    default_features,
    default_model,
    default_preprocessing,
    is_colour,
    linear_schedule,
    schedule_for,
)
from dpvision.runs.auto import apply_recipe


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))


def test_the_schedule_keeps_the_tuned_sample_rate_and_scales_the_learning_rate():
    for epsilon in (0.1, 0.5, 1.0, 3.0):
        tuned = schedule_for(epsilon)
        assert tuned.epsilon == epsilon
        big, small = linear_schedule(60_000, epsilon), linear_schedule(6_000, epsilon)
        assert big["batch_size"] == tuned.batch_size
        assert small["batch_size"] == round(tuned.batch_size / 10)  # same q = B/N
        assert small["epochs"] == big["epochs"] == tuned.epochs
        assert math.isclose(
            small["learning_rate"] / big["learning_rate"], small["batch_size"] / big["batch_size"]
        )
    # more data than the tuned set: the batch stays, the steps grow
    assert linear_schedule(1_281_167, 3.0)["batch_size"] == 8192
    assert linear_schedule(3, 3.0)["batch_size"] == 1


def test_the_nearest_tuned_epsilon_on_a_log_scale():
    assert schedule_for(2.0).epsilon == 3.0  # log(3/2) < log(2/1)
    assert schedule_for(1.5).epsilon == 1.0
    assert schedule_for(8.0).epsilon == max(s.epsilon for s in LINEAR_SCHEDULES) == 3.0
    assert schedule_for(math.inf).epsilon == 3.0
    assert schedule_for(None).epsilon == 3.0  # a fixed σ


def test_features_preprocessing_and_model_follow_the_shape():
    assert default_features("auto", (1, 28, 28)) == "scatternet"
    assert default_features("dp-sgd-linear", (1, 8, 8)) == "scatternet"
    assert default_features("auto", (1, 6, 6)) == "pixels"  # J = 2 keeps no layout of 6×6
    assert default_features("dp-ls") == default_features("dp-sgd") == "pixels"
    assert default_preprocessing("auto", "scatternet") == {"kind": "group-norm", "groups": 27}
    assert default_preprocessing("dp-ls", "scatternet:pool=2")["kind"] == "group-norm"
    assert default_preprocessing("auto", "pixels", 3) == {
        "kind": "group-norm",
        "groups": 1,
        "channels": 3,
    }
    assert default_preprocessing("dp-ls", "pixels")["kind"] == "none"
    assert default_preprocessing("dp-sgd", "scatternet")["kind"] == "none"  # its own GroupNorm
    assert default_model((1, 28, 28)) == default_model((3, 32, 32)) == "tanh-cnn"
    assert default_model((1, 28, 28), "scatternet") == "scatter-cnn"
    assert default_model((3, 64, 64)) == "wrn-16-4"
    assert default_model((1, 8, 8)) == "mlp-256"


def test_the_recipe_keeps_what_the_user_set():
    config, recipe = apply_recipe(resolve(sets=["learner.epochs=5", "learner.clip_norm=1.0"]))
    assert config.method == "dp-sgd-linear"
    assert recipe["default"]
    assert config.learner["epochs"] == 5
    assert config.learner["clip_norm"] == 1.0
    assert "learner.epochs" not in recipe["set"]
    assert "learner.batch_size" in recipe["set"]
    assert config.preprocessing.kind == "group-norm"
    assert config.features == "scatternet"
    explicit, note = apply_recipe(resolve(sets=["method=dp-ls"]))
    assert (explicit.method, explicit.features, explicit.preprocessing.kind) == (
        "dp-ls",
        "pixels",
        "none",
    )
    assert note == {
        "default": False,
        "set": {},
        "why": "as configured",
        "summary": "dp-ls on pixels — as configured",
    }


def test_the_dp_sgd_recipe_fits_the_batch_to_n_and_keeps_what_the_user_set(tmp_path):
    small, large = deep_schedule(240, 3.0), deep_schedule(50_000, 3.0)
    assert (small["batch_size"], large["batch_size"]) == (120, 1024)  # N/2, at most 1024
    assert small["learning_rate"] == 0.5 * 120 / 512
    assert small["max_grad_norm"] == large["max_grad_norm"] == 0.1
    assert small["momentum"] == 0.9
    assert deep_schedule(240, 1.0)["epochs"] == schedule_for(1.0).epochs
    assert deep_schedule(1, 3.0)["batch_size"] == 1
    adam = deep_schedule(240, 3.0, "adam")
    assert "momentum" not in adam
    assert adam["learning_rate"] == 1e-3
    rng = np.random.default_rng(0)
    path = tmp_path / "a.npz"
    _npz(path, rng, rng.integers(0, 3, 400))
    base = [f"dataset='npz:{path}'", "num_classes=3", "method=dp-sgd", "learner.model=mlp-8"]
    config, recipe = apply_recipe(resolve(sets=base))
    assert config.learner["batch_size"] == 150  # 300 training rows
    assert recipe["set"]["learner.epochs"] == 40
    mine, note = apply_recipe(resolve(sets=[*base, "learner.steps=5", "learner.momentum=0"]))
    assert (mine.learner["steps"], mine.learner["momentum"]) == (5, 0)
    assert "epochs" not in mine.learner
    assert "learner.momentum" not in note["set"]
    every = ["batch_size=8", "steps=3", "learning_rate=0.1", "max_grad_norm=1", "momentum=0"]
    every += ["optimizer='sgd'"]
    _, none = apply_recipe(resolve(sets=[*base, *(f"learner.{o}" for o in every)]))
    assert none["set"] == {}
    assert none["why"] == "as configured"


def _npz(path, rng, labels):
    x = rng.integers(0, 256, (len(labels), 12, 12), dtype=np.uint8)
    np.savez(path, x_train=x[:300], y_train=labels[:300], x_test=x[300:], y_test=labels[300:])


def test_colour_images_take_privdatanorm_and_the_colour_schedules():
    colour = default_preprocessing("auto", "scatternet", 3, colour=True)
    assert colour == COLOUR_PREPROCESSING
    assert colour["kind"] == "private-norm"
    assert default_preprocessing("dp-sgd-linear", "scatternet", 3, colour=True) == colour
    assert default_preprocessing("dp-ls", "scatternet", 3, colour=True)["kind"] == "group-norm"
    assert is_colour(3, COLOUR_MIN_TRAIN, 3.0)
    assert is_colour(3, COLOUR_MIN_TRAIN)  # a fixed σ: no target to be short of
    # grey images, too few examples for the private statistics, too small a budget
    for channels, n, epsilon in (
        (1, 60_000, 3.0),
        (3, COLOUR_MIN_TRAIN - 1, 3.0),
        (3, None, 3.0),
        (3, 50_000, COLOUR_MIN_EPSILON / 2),
    ):
        assert not is_colour(channels, n, epsilon)
    for tuned in COLOUR_SCHEDULES:
        options = linear_schedule(50_000, tuned.epsilon, colour=True)
        assert options["batch_size"] == tuned.batch_size  # tuned at N = 50 000
        assert options["epochs"] == tuned.epochs
        assert math.isclose(options["learning_rate"], tuned.learning_rate_per_512 * 16)
        assert schedule_for(tuned.epsilon, colour=True) == tuned
    assert linear_schedule(25_000, 3.0, colour=True)["batch_size"] == 4096  # the same q
    assert linear_schedule(60_000, 3.0) == linear_schedule(60_000, 3.0, colour=False)


def _colour_npz(tmp_path):
    rng = np.random.default_rng(0)
    path, labels = tmp_path / "c.npz", rng.integers(0, 3, COLOUR_MIN_TRAIN + 100)
    x = rng.integers(0, 256, (len(labels), 8, 8, 3), dtype=np.uint8)
    n = COLOUR_MIN_TRAIN
    np.savez(path, x_train=x[:n], y_train=labels[:n], x_test=x[n:], y_test=labels[n:])
    return [f"dataset='npz:{path}'", "num_classes=3"]


def test_the_recipe_of_colour_images_from_the_shape_and_n(tmp_path):
    base = [*_colour_npz(tmp_path), "epsilon=3.0"]
    config, recipe = apply_recipe(resolve(sets=base))
    assert config.features == "scatternet"
    assert config.preprocessing.kind == "private-norm"
    assert config.learner["epochs"] == schedule_for(3.0, colour=True).epochs
    assert "colour images" in recipe["why"]
    # the method named, the preprocessing left auto: still the colour images' PrivDataNorm
    named, _ = apply_recipe(resolve(sets=[*base, "method=dp-sgd-linear", "features=scatternet"]))
    assert named.preprocessing.kind == "private-norm"
    held, _ = apply_recipe(resolve(sets=[*base, "validation_fraction=0.5"]))  # N = 2 500
    assert held.preprocessing.kind == "group-norm"


def test_below_its_epsilon_colour_images_keep_the_free_group_norm(tmp_path):
    """PrivDataNorm's releases alone cost ε ≈ 0.63: at ε = 0.5 the colour recipe would find
    no σ for the steps; the run takes the grey recipe instead (and runs)."""
    base = _colour_npz(tmp_path)
    config, recipe = apply_recipe(resolve(sets=[*base, "epsilon=0.5"]))
    assert config.preprocessing.kind == "group-norm"
    assert config.learner["epochs"] == schedule_for(0.5).epochs
    assert "colour" not in recipe["why"]
    at_one, _ = apply_recipe(resolve(sets=[*base, f"epsilon={COLOUR_MIN_EPSILON}"]))
    assert at_one.preprocessing.kind == "private-norm"


def test_the_recipe_keeps_the_preprocessing_options_the_user_set(tmp_path):
    base = [*_colour_npz(tmp_path), "epsilon=3.0"]
    sets = ["preprocessing.noise_multiplier=16.0", "preprocessing.mean_clip=0.1"]
    config, recipe = apply_recipe(resolve(sets=[*base, *sets]))
    pre = config.preprocessing
    assert pre.kind == "private-norm"
    assert (pre.noise_multiplier, pre.mean_clip) == (16.0, 0.1)
    assert pre.square_clip == COLOUR_PREPROCESSING["square_clip"]  # left to the recipe
    assert recipe["set"]["preprocessing"]["noise_multiplier"] == 16.0  # what ran
    named = ["method='dp-ls'", "features='scatternet'", "preprocessing.groups=9"]
    grouped, _ = apply_recipe(resolve(sets=[*base, *named]))
    assert (grouped.preprocessing.kind, grouped.preprocessing.groups) == ("group-norm", 9)


def test_the_colour_schedules_follow_privdatanorm_on_scatternet_only(tmp_path):
    """They were tuned after PrivDataNorm on ScatterNet features: pixels, or another
    normalisation the user chose, take the grey-scale schedules."""
    base = [*_colour_npz(tmp_path), "epsilon=3.0"]
    colour = schedule_for(3.0, colour=True)
    for extra in ("features='pixels'", "preprocessing.kind='group-norm'"):
        config, recipe = apply_recipe(resolve(sets=[*base, extra]))
        assert config.learner["epochs"] == schedule_for(3.0).epochs != colour.epochs
        assert "colour" not in recipe["why"]


def test_tune_on_colour_images_gets_the_group_norm_it_can_calibrate(tmp_path):
    """tune calibrates its candidates' steps, not PrivDataNorm's releases: its recipe
    leaves them out instead of refusing a preprocessing the user never chose."""
    config, _ = apply_recipe(
        resolve(sets=[*_colour_npz(tmp_path), "epsilon=3.0"]), private_statistics=False
    )
    assert config.preprocessing.kind == "group-norm"


def test_the_recipe_reads_no_pixel_and_no_label(tmp_path):
    """Neighbouring in everything but N and the shape: the same recipe, to the last option."""
    rng = np.random.default_rng(0)
    first, second = tmp_path / "a.npz", tmp_path / "b.npz"
    _npz(first, rng, rng.integers(0, 3, 400))
    _npz(second, rng, np.full(400, 2))  # other pixels, every label the same
    for method in ('method="auto"', 'method="dp-sgd"'):
        recipes = [
            apply_recipe(
                resolve(sets=[f"dataset='npz:{path}'", "num_classes=3", "epsilon=1.0", method])
            )
            for path in (first, second)
        ]
        (one, note_one), (two, note_two) = recipes
        assert {**one.to_dict(), "dataset": ""} == {**two.to_dict(), "dataset": ""}
        assert note_one["set"] == note_two["set"]


def test_dp_sgd_on_digits_runs_with_a_model_that_fits(tmp_path, capsys):
    """`dpvision train --dataset digits --method dp-sgd` failed on the 28×28 Tanh CNN."""
    out = tmp_path / "r.json"
    argv = ["train", "--dataset", "digits", "--method", "dp-sgd", "--quiet", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "mlp-256"
    chosen = result["recipe"]["set"]
    assert chosen["learner.model"] == "mlp-256"
    assert chosen["learner.max_grad_norm"] == 0.1  # the dp-sgd recipe, not the learner's 1
    assert result["test_accuracy"] > 0.5  # measured 0.8997 at seed 0
    assert "model mlp-256 fits 1×8×8 images" in capsys.readouterr().out


def test_the_audits_dp_sgd_defaults_leave_nothing_to_the_recipe():
    """Review of issue 52: the audit's mechanism (plain SGD, Phase I's learning-rate grid
    chosen for it) is its own, not the training recipe's momentum 0.9."""
    from dpvision.audit.harness import AUDIT_DEFAULTS
    from dpvision.runs.auto import _deep_unset

    config = resolve(sets=['method="dp-sgd"', *AUDIT_DEFAULTS["dp-sgd"]])
    assert _deep_unset(config.learner) == []
    _, recipe = apply_recipe(config)
    assert recipe["set"] == {}


def test_the_learning_rate_follows_the_batch_the_user_set():
    """CI of issue 52: with B 64 set, dp-sgd's recipe scaled lr by its own B = N/2 (lr 0.70
    at N = 1438 instead of 0.0625); the linear recipe did the same with its tuned batch."""
    _, deep = apply_recipe(resolve(sets=['method="dp-sgd"', "learner.batch_size=64"]))
    assert deep["set"]["learner.learning_rate"] == 0.5 * 64 / 512
    _, linear = apply_recipe(resolve(sets=["learner.batch_size=64", "learner.steps=2"]))
    assert linear["set"]["learner.learning_rate"] == schedule_for(3.0).learning_rate_per_512 / 8
    assert "learner.epochs" not in linear["set"]  # steps override epochs: not both
