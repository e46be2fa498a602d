import pytest
import torch

from dpvision.config import resolve
from dpvision.errors import DPVisionError
from dpvision.models import mlp, validate_model
from dpvision.models.registry import parse_model
from dpvision.runs.train import run_training


def test_mlp_shapes_and_parameter_counts():
    model = mlp((1, 8, 8), num_classes=10, hidden=32)
    validate_model(model)
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    assert sum(p.numel() for p in model.parameters()) == 64 * 32 + 32 + 32 * 10 + 10
    linear = mlp((3, 4, 4), num_classes=5, hidden=0)
    assert sum(p.numel() for p in linear.parameters()) == 48 * 5 + 5


def test_mlp_rejects_bad_arguments():
    with pytest.raises(DPVisionError, match="hidden"):
        mlp((1, 8, 8), hidden=-1)
    with pytest.raises(DPVisionError, match="input_shape"):
        mlp((8, 8))


def test_mlp_names_parse():
    assert parse_model("mlp-32") == ("mlp", {"hidden": 32})
    assert parse_model("mlp-0") == ("mlp", {"hidden": 0})
    with pytest.raises(DPVisionError, match="mlp-HIDDEN"):
        parse_model("mlp-x")


def test_dp_sgd_trains_an_mlp_on_digits():
    """The 8×8 digits had no dp-sgd model before mlp-H. The schedule is the dp-sgd recipe's
    (B 719, 40 epochs, lr 0.70, C 0.1, momentum 0.9): measured 84.68 %. (5 epochs at B 128
    under the recipe's lr 0.125 reach 49 %: a short schedule needs its own lr.)"""
    config = resolve(
        None,
        {"method": "dp-sgd", "epsilon": 4.0},
        ["learner.model='mlp-32'", "learner.normalization='none'"],
    )
    result = run_training(config, quiet=True)
    assert result["epsilon"] <= 4.0
    assert result["test_accuracy"] > 0.5
