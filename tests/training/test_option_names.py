"""The clipping options' names: ``clipping`` is the clip policy and ``grad_sample_mode`` how
the per-example gradients are computed, as in Opacus; the former names (``clipping_mode``,
``clipping = "vmap"``) still load, with a one-line deprecation message, and give the same
options, the same secret randomness and the same checkpoint settings."""

import logging

import numpy as np
import pytest
from sklearn.base import clone

from dpvision.config import resolve
from dpvision.errors import DPVisionError
from dpvision.learners import DPSGDLinear
from dpvision.runs.schedule import run_settings
from dpvision.training.options import DPSGDOptions

OLD_AND_NEW = [
    ({"clipping_mode": "adaptive"}, {"clipping": "adaptive"}),
    ({"clipping_mode": "per-layer"}, {"clipping": "per_layer"}),
    ({"clipping": "vmap"}, {"grad_sample_mode": "vmap"}),
    (
        {"clipping": "bookkeeping", "clipping_mode": "per-layer"},
        {"grad_sample_mode": "bookkeeping", "clipping": "per_layer"},
    ),
]


def _deprecations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


@pytest.mark.parametrize(("old", "new"), OLD_AND_NEW)
def test_the_old_names_load_with_a_deprecation_message_and_give_the_same_options(old, new, caplog):
    with caplog.at_level(logging.WARNING, logger="dpvision"):
        from_new = DPSGDOptions.from_dict(new)
        assert not _deprecations(caplog)
        from_old = DPSGDOptions.from_dict(old)
    assert from_old == from_new
    messages = _deprecations(caplog)
    assert len(messages) == len(old)  # one per old key
    for message in messages:
        assert "\n" not in message
        assert message.startswith("learner.clipping")
    written = {name for message in messages for name in new if f"learner.{name} = " in message}
    assert written == set(new)  # each message says what to write instead


def test_the_deprecation_message_says_what_to_write():
    from dpvision.training.options import current_names

    assert current_names({"clipping": "vmap", "clipping_mode": "per-layer", "epochs": 2}) == {
        "epochs": 2,
        "grad_sample_mode": "vmap",
        "clipping": "per_layer",
    }


def test_per_layer_is_read_as_opacus_spells_it():
    assert DPSGDOptions.from_dict({"clipping": "per-layer"}).clipping == "per_layer"
    assert DPSGDOptions(clipping="per-layer").clipping == "per_layer"
    assert DPSGDOptions.from_dict({"clipping": "per-layer"}).to_dict()["clipping"] == "per_layer"


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"clipping": "ghost"}, "unknown learner.clipping 'ghost'; choose one of: flat, per_layer"),
        ({"clipping_mode": "ghost"}, "unknown learner.clipping 'ghost'"),
        ({"grad_sample_mode": "hooks"}, "unknown learner.grad_sample_mode 'hooks'; choose one"),
        ({"grad_sample_mode": "flat"}, "unknown learner.grad_sample_mode 'flat'"),
        ({"clipping_mode": "flat", "clipping": "adaptive"}, "give only learner.clipping$"),
        ({"clipping": "vmap", "grad_sample_mode": "auto"}, "give only learner.grad_sample_mode"),
    ],
)
def test_bad_values_are_one_line_errors(raw, match):
    with pytest.raises(DPVisionError, match=match) as error:
        DPSGDOptions.from_dict(raw)
    assert "\n" not in str(error.value)


def test_an_old_name_given_with_its_new_one_at_the_same_value_is_accepted():
    options = DPSGDOptions.from_dict({"clipping_mode": "per-layer", "clipping": "per_layer"})
    assert options.clipping == "per_layer"


def _config(method: str, **learner: str):
    sets = [f"learner.{key}={value}" for key, value in learner.items()]
    return resolve(overrides={"method": method, "secret_seed": 7}, sets=sets)


@pytest.mark.parametrize(
    ("method", "old", "new"),
    [
        ("dp-sgd", *OLD_AND_NEW[3]),
        ("dp-sgd-linear", {"clipping_mode": "adaptive"}, {"clipping": "adaptive"}),
        ("auto", {"clipping_mode": "adaptive"}, {"clipping": "adaptive"}),
    ],
)
def test_a_config_under_the_old_names_is_published_under_the_new_and_replays(method, old, new):
    from_old, from_new = _config(method, **old), _config(method, **new)
    assert from_old.learner == from_new.learner == new
    assert from_old == from_new
    # The run's secret randomness (and so its noise) does not depend on what the options
    # are called: a run replays across the rename with the same secret seed.
    stream = from_old.secret_randomness().seed("noise")
    assert stream == from_new.secret_randomness().seed("noise")
    if method == "dp-sgd":  # and its checkpoint still resumes
        assert run_settings(from_old) == run_settings(from_new)
        assert run_settings(from_new)["learner"]["clipping_mode"] == "per-layer"


def test_the_linear_learner_lists_its_new_option_only():
    with pytest.raises(DPVisionError, match="unknown learner option 'clip_mode'") as error:
        _config("dp-sgd-linear", clip_mode="adaptive")
    assert "clipping," in str(error.value)
    assert "clipping_mode" not in str(error.value)
    with pytest.raises(DPVisionError, match=r"learner\.clipping must be 'flat' or 'adaptive'"):
        _config("dp-sgd-linear", clipping="per_layer")


def test_the_linear_learner_reads_its_old_keyword_with_a_deprecation_message(caplog):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(120, 4)), np.arange(120) % 3
    common = dict(
        target_epsilon=2.0, num_classes=3, epochs=2, unclipped_num_std=20.0, random_state=0
    )
    new = DPSGDLinear(**common, clipping="adaptive")
    old = DPSGDLinear(**common, clipping_mode="adaptive")
    assert clone(new).get_params()["clipping"] == "adaptive"  # scikit-learn's contract
    assert clone(old).get_params()["clipping_mode"] == "adaptive"
    with caplog.at_level(logging.WARNING, logger="dpvision"):
        new.fit(x, y)
        assert not _deprecations(caplog)
        old.fit(x, y)
    (message,) = _deprecations(caplog)
    assert message == "DPSGDLinear(clipping_mode=...) is deprecated: write clipping='adaptive'"
    np.testing.assert_array_equal(old.coef_, new.coef_)
    assert old.final_clip_norm_ == new.final_clip_norm_
    assert new.set_params(clipping="flat").clipping == "flat"
    with pytest.raises(DPVisionError, match="give only clipping"):
        DPSGDLinear(clipping="flat", clipping_mode="adaptive").set_params(
            clipping="adaptive", clipping_mode="flat"
        ).check_params()
    with pytest.raises(DPVisionError, match="clipping must be 'flat' or 'adaptive'"):
        DPSGDLinear(clipping="per-layer").check_params()


@pytest.mark.parametrize(
    ("method", "key", "hint"),
    [
        ("dp-sgd", "pretrained", "(pre-trained weights come from learner.init = FILE"),
        ("dp-sgd", "lr", "(the learning rate is learning_rate);"),
        ("dp-sgd", "epoch", "(did you mean epochs?);"),
        ("dp-sgd-linear", "clip_nrom", "(did you mean clip_norm?);"),
    ],
)
def test_an_unknown_option_names_where_the_setting_lives_before_the_list(method, key, hint):
    """timm's ``pretrained=True`` or a typo: the hint comes before the forty valid names."""
    with pytest.raises(DPVisionError) as error:
        _config(method, **{key: True})
    message = str(error.value)
    assert hint in message
    assert message.index(hint) < message.index("valid:")
    assert "\n" not in message
