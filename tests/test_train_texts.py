"""What ``dpvision train`` says about itself: its help names the run that no arguments start,
a dp-sgd result names the batch size, learning rate and momentum it used (the learner's
defaults included), and a deep model's line names its images, not "features pixels"."""

import re

import pytest

from dpvision.cli import main
from dpvision.config import resolve
from dpvision.runs.auto import apply_recipe
from dpvision.runs.train import summary


def test_help_names_the_default_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    # argparse wraps lines after a word's hyphen ("dp-sgd-" / "linear"): join them back.
    text = " ".join(re.sub(r"-\n\s*", "-", capsys.readouterr().out).split())
    config, _ = apply_recipe(resolve())  # what no arguments run (digits: no download)
    assert config.method == "dp-sgd-linear"
    assert "trains DP-LS" not in text
    assert f"{config.method} on ScatterNet features" in text
    assert config.features == "scatternet"


def test_dpsgd_recipe_line_names_the_values_used() -> None:
    sets = ['method="dp-sgd"', 'learner.model="mlp-8"', "learner.batch_size=128"]
    _, recipe = apply_recipe(resolve(sets=[*sets, "learner.learning_rate=0.5"]))
    line = recipe["summary"]
    assert "B 128" in line
    assert "lr 0.5" in line
    # momentum, C and the length were left to the dp-sgd recipe: their values, and why
    assert "momentum 0.9" in line
    assert "C 0.1" in line
    assert "epochs 40" in line
    assert "the dp-sgd recipe for N = " in line
    assert "learner defaults" not in line
    _, recipe = apply_recipe(resolve(sets=[*sets, "learner.momentum=0.5", "learner.steps=7"]))
    assert "momentum 0.5" in recipe["summary"]
    assert "steps 7" in recipe["summary"]
    _, adam = apply_recipe(resolve(sets=[*sets, 'learner.optimizer="adam"']))
    assert ", adam —" in adam["summary"]
    assert "lr 0.001" in adam["summary"]  # Adam keeps torch's default, not SGD's scaling


def test_feature_learner_recipe_line_is_unchanged() -> None:
    _, recipe = apply_recipe(resolve(sets=['method="dp-ls"']))
    assert recipe["summary"] == "dp-ls on pixels — as configured"


def _result(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "method": "dp-sgd",
        "dataset": "cifar10",
        "n_train": 50000,
        "n_test": 10000,
        "features": "pixels",
        "num_features": 3072,
        "test_accuracy": 0.5,
        "noise_multiplier": None,
        "wall_seconds": 1.0,
    }
    return base | fields


def test_deep_model_line_names_its_images() -> None:
    line = summary(_result(model="tanh-cnn", input_shape=[3, 32, 32])).splitlines()[0]
    assert line == "dp-sgd on cifar10 (50000 train / 10000 test), model tanh-cnn on 32×32×3 images"
    maps = summary(
        _result(model="scatter-cnn", features="scatternet", input_shape=[81, 7, 7])
    ).splitlines()[0]
    assert maps.endswith("model scatter-cnn on scatternet features (81×7×7)")
    linear = summary(_result(method="dp-ls", num_features=3072)).splitlines()[0]
    assert linear.endswith("features pixels (3072 dims)")


def test_dpsgd_run_prints_images_and_values(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "train",
            "--method",
            "dp-sgd",
            "--set",
            'learner.model="mlp-8"',
            "--set",
            "learner.steps=2",
            "--set",
            "learner.batch_size=64",
            "--set",
            "learner.momentum=0.5",
            "-q",
        ]
    )
    assert code in (0, None)
    out = capsys.readouterr().out
    assert "model mlp-8 on 8×8×1 images" in out
    assert "features pixels" not in out
    assert "B 64, steps 2, lr 0.0625, C 0.1, momentum 0.5" in out  # the recipe: 0.5·B/512


def test_a_private_validation_accuracy_says_it_is_a_noisy_count() -> None:
    """A noisy, clamped count printed as "validation accuracy 100.00 %" reads as exact; the
    line gives the noise in points (σ_v / n, both public) and says it is clamped."""
    noisy = summary(
        _result(
            validation_accuracy=1.0,
            n_validation=400,
            validation="private",
            validation_noise=6.0,
        )
    )
    assert "validation accuracy 100.00 % (400 training examples held out; a noisy count, " in noisy
    assert "± 1.50 points (one std), clamped to 0–100 %" in noisy
    public = summary(_result(validation_accuracy=0.9, n_validation=400, validation="public"))
    assert "validation accuracy 90.00 % (400 training examples held out)\n" in public
