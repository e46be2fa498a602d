"""Model specs: dpvision names, timm:/torchvision: (the optional extra), python: factories."""

import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models.registry import build_model, build_network, check_model, parse_model
from dpvision.models.sources import split_spec

HAS_TIMM = importlib.util.find_spec("timm") is not None
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def _factory_file(folder: Path) -> Path:
    path = folder / "my_models.py"
    path.write_text(
        textwrap.dedent(
            """
            from torch import nn

            def small_cnn(num_classes, in_chans):
                return nn.Sequential(
                    nn.Conv2d(in_chans, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes),
                )

            def fixed_head():
                return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 1000))

            def not_a_module():
                return 3
            """
        )
    )
    return path


def test_split_spec_and_unknown_sources():
    assert split_spec("torchvision:resnet18") == ("torchvision", "resnet18")
    assert parse_model("python:a.py:f") == ("python", {})
    with pytest.raises(DPVisionError, match="unknown model source 'keras'"):
        split_spec("keras:resnet")
    with pytest.raises(DPVisionError, match="names no model"):
        split_spec("timm:")


def test_python_factory_from_a_file(tmp_path):
    path = _factory_file(tmp_path)
    raw = build_network(f"python:{path}:small_cnn", (1, 8, 8), 5)
    assert isinstance(raw[1], nn.BatchNorm2d)  # as the factory made it
    model = build_model(f"python:{path}:small_cnn", (1, 8, 8), 5, batchnorm="freeze")
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 5)
    assert type(model[1]).__name__ == "FrozenBatchNorm"
    grouped = build_model(f"python:{path}:small_cnn", (1, 8, 8), 5, batchnorm="group-norm")
    assert isinstance(grouped[1], nn.GroupNorm)


def test_python_factory_whose_head_does_not_fit_gets_a_new_one(tmp_path):
    path = _factory_file(tmp_path)
    model = build_model(f"python:{path}:fixed_head", (1, 8, 8), 3)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 3)


def test_python_factory_from_a_module():
    model = build_model("python:torch.nn:Identity", (4,), 4)  # no linear head: no fitting
    assert isinstance(model, nn.Identity)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("python:nowhere.py:f", "not found"),
        ("python:no_such_module_xyz:f", "cannot import no_such_module_xyz"),
        ("python:torch.nn:NoSuchThing", "no callable 'NoSuchThing'"),
        ("python:f", "python:MODULE:CALLABLE"),
    ],
)
def test_python_factory_errors_are_one_line(spec, message):
    with pytest.raises(DPVisionError, match=message) as error:
        check_model(spec)
    assert "\n" not in str(error.value)


def test_python_factory_that_returns_no_module(tmp_path):
    path = _factory_file(tmp_path)
    with pytest.raises(DPVisionError, match=r"not an nn\.Module"):
        build_network(f"python:{path}:not_a_module", (1, 8, 8), 3)


@pytest.mark.skipif(HAS_TIMM, reason="checks the message shown when timm is missing")
def test_timm_missing_says_how_to_install():
    with pytest.raises(DPVisionError, match=r"pip install 'dpvision\[models\]'") as error:
        check_model("timm:resnet18")
    assert "\n" not in str(error.value)


@pytest.mark.skipif(HAS_TORCHVISION, reason="checks the message shown when it is missing")
def test_torchvision_missing_says_how_to_install():
    with pytest.raises(DPVisionError, match=r"dpvision\[models\]"):
        check_model("torchvision:resnet18")


def test_cli_says_how_to_install_timm_before_any_work(tmp_path, capsys):
    if HAS_TIMM:
        pytest.skip("timm is installed here")
    from dpvision.cli import main

    code = main(
        [
            "train",
            "--dataset",
            "digits",
            "--method",
            "dp-sgd",
            "--set",
            "learner.model=timm:resnet18",
            "--epsilon",
            "1",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "docs/install.md" in err  # its own environment, not a pip line that replaces torch
    assert "would replace torch" in err
    assert not (tmp_path / "r.json").exists()
