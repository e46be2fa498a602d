"""Run configuration: TOML + flags + --set, validated with one-line errors."""

import math

import pytest

from dpvision.config import TrainConfig, resolve
from dpvision.errors import DPVisionError


def test_defaults_need_no_download():
    config = resolve()
    assert (config.dataset, config.method, config.features) == ("digits", "dp-ls", "pixels")
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


def test_epsilon_inf_and_noise_multiplier_replace_each_other():
    assert math.isinf(resolve(sets=["epsilon=inf"]).epsilon)
    config = resolve(sets=["noise_multiplier=0"])
    assert config.noise_multiplier == 0
    assert config.epsilon is None
    assert resolve(None, {"noise_multiplier": 2.0}, ["epsilon=1"]).epsilon == 1.0


@pytest.mark.parametrize(
    ("toml", "sets", "message"),
    [
        ("lerner = 3\n", [], "unknown key 'lerner'"),
        ("[learner]\nepoch = 3\n", [], "unknown learner option 'epoch' for dp-ls"),
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
    config = resolve(sets=["learner.ridge=0.5"])
    assert TrainConfig(**{**config.to_dict(), "preprocessing": config.preprocessing}) == config
