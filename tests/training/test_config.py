"""Run configuration: TOML + flags + --set, validated with one-line errors."""

import math

import pytest

from dpvision.config import TrainConfig, resolve
from dpvision.errors import DPVisionError


def test_defaults_need_no_download():
    config = resolve()
    # method and features are the default recipe's, resolved when the run starts
    assert (config.dataset, config.method, config.features) == ("digits", "auto", "auto")
    assert config.epsilon == 3.0


def test_toml_then_flags_then_set(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'dataset = "fashion-mnist"\nmethod = "dp-sgd-linear"\nepsilon = 3.0\n'
        '[learner]\nepochs = 40\nbatch_size = 8192\n[preprocessing]\nkind = "group-norm"\n'
    )
    config = resolve(path, {"epsilon": 1.0}, ["learner.epochs=20", "preprocessing.groups=9"])
    assert config.epsilon == 1.0
    assert config.learner == {"epochs": 20, "batch_size": 8192}
    assert (config.preprocessing.kind, config.preprocessing.groups) == ("group-norm", 9)


def test_epsilon_inf_and_noise_multiplier_replace_the_defaults():
    assert math.isinf(resolve(sets=["epsilon=inf"]).epsilon)
    config = resolve(sets=["noise_multiplier=0"])
    assert config.noise_multiplier == 0
    assert config.epsilon is None


def test_a_command_line_sigma_replaces_a_files_target(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("epsilon = 3.0\n")
    config = resolve(path, {"noise_multiplier": 2.0})
    assert (config.epsilon, config.noise_multiplier) == (None, 2.0)


@pytest.mark.parametrize(
    ("overrides", "sets", "named"),
    [
        ({"epsilon": 3.0, "noise_multiplier": 1.0}, [], ("--epsilon 3", "--noise-multiplier 1")),
        ({"noise_multiplier": 2.0}, ["epsilon=1"], ("--set epsilon=1", "--noise-multiplier 2")),
        ({}, ["epsilon=1", "noise_multiplier=0"], ("--set epsilon=1", "--set noise_multiplier")),
    ],
)
def test_a_target_and_a_sigma_on_the_command_line_conflict(overrides, sets, named):
    # Before: the later one silently won, and a run given ε = 3 reported ε = 8.39.
    with pytest.raises(DPVisionError, match="conflict") as error:
        resolve(None, overrides, sets)
    assert all(name in str(error.value) for name in named)


@pytest.mark.parametrize(
    ("toml", "sets", "message"),
    [
        ("lerner = 3\n", [], "unknown key 'lerner'"),
        ("[learner]\nepoch = 3\n", [], "unknown learner option 'epoch' for dp-sgd-linear"),
        ('method = "dp-magic"\n', [], "unknown method 'dp-magic'"),
        ("epsilon = 0\n", [], "epsilon must be > 0"),
        ("epsilon = -1\n", [], "epsilon must be > 0"),
        ("delta = 2\n", [], "delta must be in"),
        ('seed = "x"\n', [], "seed must be a whole number"),
        ('[preprocessing]\nkind = "bn"\n', [], "unknown preprocessing.kind"),
        ("dataset = \n", [], "not valid TOML"),
        ("", ["epsilon"], "--set expects key=value"),
        ("", ["accountant=prv"], "unknown accountant"),
    ],
)
def test_bad_config_is_a_one_line_error(tmp_path, toml, sets, message):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(DPVisionError, match=message) as info:
        resolve(path, sets=sets)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(DPVisionError, match="not found"):
        resolve(tmp_path / "nope.toml")


def test_resolved_config_round_trips_into_the_dataclass():
    config = resolve(sets=["method=dp-ls", "learner.ridge=0.5"])
    assert TrainConfig(**{**config.to_dict(), "preprocessing": config.preprocessing}) == config
