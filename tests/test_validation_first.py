"""Every option error is refused before the work (issue 39, item 9): a bad value of any
learner option of any method is one line and exit code 2 from ``dpvision train``, ``tune``
and ``sweep``, and no data is read (so no feature is extracted) before it.

The data loader is replaced by one that fails the test, so an option checked only inside
``fit`` (as ``learner.batch_size`` of dp-sgd-linear was, after feature extraction) shows.
"""

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from dpvision.cli import main
from dpvision.config.schema import TrainConfig
from dpvision.learners import LEARNERS
from dpvision.learners.options import PARAMETER_CONSTRAINTS
from dpvision.options import Choice, Interval, constraints_of
from dpvision.training.options import DPSGDOptions, PerformanceOptions

# What ``[learner]`` may not hold for a feature method (set by the run), as validation says.
_SET_BY_RUN = {
    "clipping_mode",
    "target_epsilon",
    "target_delta",
    "noise_multiplier",
    "accountant",
    "random_state",
    "sampling_state",
    "device",
}

# One value out of range (or of the wrong type) for every option of the feature learners.
_FEATURE_BAD: dict[str, list[str]] = {
    "alpha": ["-1"],
    "ridge": ["-1", '"bogus"'],
    "max_block_bytes": ["0"],
    "chunk_size": ["0"],
    "clip_norm": ["0", "inf"],
    "num_classes": ["1"],
    "secure_mode": ['"maybe"'],
    "iterations": ["0"],
    "learning_rate": ["-1", "nan"],
    "bias": ["nan"],
    "covariance_clip_norm": ["-1"],
    "epochs": ["0"],
    "batch_size": ["-5"],
    "betas": ["[0.9, 1.5]"],
    "bias_init": ["inf"],
    "clipbound_learning_rate": ["0"],
    "clipping": ['"per_layer"'],
    "ema_decay": ["1"],
    "expected_batch_size": ["0"],
    "fit_intercept": ['"maybe"'],
    "loss": ['"hinge"'],
    "max_clipbound": ["0"],
    "min_clipbound": ["-1"],
    "momentum": ["-0.5"],
    "optimizer": ['"lbfgs"'],
    "sample_rate": ["1.5"],
    "steps": ["0"],
    "target_unclipped_quantile": ["1"],
    "unclipped_num_std": ["0"],
}


def _feature_cases() -> list[tuple[str, str, str]]:
    cases = []
    for method, learner in LEARNERS.items():
        for key in sorted(set(learner().get_params()) - _SET_BY_RUN):
            cases += [(method, key, value) for value in _FEATURE_BAD[key]]
    return cases


def _bad_deep_value(field: dataclasses.Field[Any]) -> str | None:
    """A value out of range for one DPSGDOptions field (from its declared constraints)."""
    special = {
        "model": '"no-such-model"',
        "init": '"/nonexistent/weights.pt"',
        "encoder": '"/nonexistent/encoder.pt"',
        "max_grad_norm": "inf",
    }
    if field.name in special:
        return special[field.name]
    if field.type in (bool, "bool"):
        return '"maybe"'
    for constraint in constraints_of(DPSGDOptions).get(field.name, ()) or constraints_of(
        PerformanceOptions
    ).get(field.name, ()):
        if isinstance(constraint, Choice):
            return '"bogus"'
        if isinstance(constraint, Interval) and constraint.low is not None:
            return str(constraint.low - 1)
    return None


def _deep_cases() -> list[tuple[str, str, str]]:
    fields = [f for f in dataclasses.fields(DPSGDOptions) if f.name != "performance"]
    fields += list(dataclasses.fields(PerformanceOptions))
    cases = []
    for field in fields:
        value = _bad_deep_value(field)
        if value is None:  # model_args: any table (checked when the model is built)
            continue
        randp_only = field.name == "encoder" or field.name.startswith("phase2_")
        cases.append(("dp-randp" if randp_only else "dp-sgd", field.name, value))
    cases.append(("dp-randp", "pretrain.steps", "0"))
    return cases


@pytest.fixture
def no_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the data (hence extracting features) fails the test."""

    def refuse(self: TrainConfig) -> None:
        raise AssertionError("the data were read before the options were checked")

    monkeypatch.setattr(TrainConfig, "load_dataset", refuse)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], key: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("dpvision: error: "), err
    assert key in lines[0], err


def test_every_learner_option_has_its_range_declared() -> None:
    # A new keyword without an entry would be checked only inside fit, after the work.
    for learner in LEARNERS.values():
        assert set(PARAMETER_CONSTRAINTS[learner]) == set(learner().get_params()), learner


@pytest.mark.usefixtures("no_data")
@pytest.mark.parametrize(("method", "key", "value"), _feature_cases())
def test_feature_learner_option_refused_before_the_data(
    method: str, key: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(["train", "--method", method, "--set", f"learner.{key}={value}"], capsys, key)


@pytest.mark.usefixtures("no_data")
@pytest.mark.parametrize(("method", "key", "value"), _deep_cases())
def test_deep_option_refused_before_the_data(
    method: str, key: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    item = key if "." in key else f"learner.{key}"
    _refused(["train", "--method", method, "--set", f"{item}={value}"], capsys, key)


@pytest.mark.usefixtures("no_data")
@pytest.mark.parametrize("method", [None, "auto", "dp-sgd-linear", "dp-sgd"])
def test_the_issue_command(method: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    # `--set learner.batch_size=-5` was refused only after feature extraction had run.
    flags = [] if method is None else ["--method", method]
    _refused(["train", *flags, "--set", "learner.batch_size=-5"], capsys, "batch_size")


@pytest.mark.usefixtures("no_data")
@pytest.mark.parametrize(
    ("kind", "key", "value"),
    [
        ("group-norm", "groups", "-3"),
        ("group-norm", "channels", "0"),
        ("private-norm", "noise_multiplier", "-1"),
        ("private-norm", "mean_clip", "0"),
        ("private-norm", "square_clip", "nan"),
        ("center", "clip_norm", "-1"),
    ],
)
def test_preprocessing_option_refused_before_the_data(
    kind: str, key: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sets = ["--set", f'preprocessing.kind="{kind}"', "--set", f"preprocessing.{key}={value}"]
    _refused(["train", "--method", "dp-ls", *sets], capsys, f"preprocessing.{key}")


@pytest.mark.usefixtures("no_data")
def test_adaptive_clip_bounds_must_hold_the_clip_norm(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--method", "dp-sgd-linear", "--set", 'learner.clipping="adaptive"']
    _refused([*argv, "--set", "learner.min_clipbound=2"], capsys, "min_clipbound")


@pytest.mark.usefixtures("no_data")
@pytest.mark.parametrize("search", ["learner.batch_size=-5,10", "learner.learning_rate=1,-1"])
def test_tune_refuses_a_bad_candidate_before_the_data(
    search: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The second candidate's error came after the first had read the data.
    key = search.split("=")[0].split(".")[1]
    _refused(["tune", "--method", "dp-sgd-linear", "--search", search], capsys, key)


@pytest.mark.usefixtures("no_data")
def test_sweep_refuses_before_the_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "linear.toml"
    config.write_text('method = "dp-sgd-linear"\n')
    out = tmp_path / "out"
    argv = ["sweep", "--config", str(config), "--epsilons", "1,3", "--out", str(out)]
    _refused([*argv, "--set", "learner.batch_size=-5"], capsys, "batch_size")
    assert not out.exists()


def test_valid_values_still_pass() -> None:
    # The ranges are not too tight: the defaults and the edges that are allowed pass.
    from dpvision.config import resolve

    config = resolve(
        None,
        {"method": "dp-sgd-linear"},
        [
            "learner.batch_size=1",
            "learner.momentum=0",
            "learner.ema_decay=0",
            "learner.bias_init=-10",
            "learner.sample_rate=1",
            "learner.betas=[0, 0.999]",
        ],
    )
    assert config.learner["batch_size"] == 1
    assert math.isclose(config.learner["betas"][1], 0.999)
    resolve(None, {"method": "dp-ls"}, ['learner.ridge="auto"', "learner.alpha=0"])
    resolve(None, {"method": "dp-fc"}, ["learner.bias=-10", "learner.epochs=1"])
