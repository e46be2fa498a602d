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
    """The 8×8 digits had no dp-sgd model before mlp-H."""
    config = resolve(
        None,
        {"method": "dp-sgd", "epsilon": 4.0},
        ["learner.model='mlp-32'", "learner.batch_size=128", "learner.epochs=5",
         "learner.normalization='none'"],
    )  # fmt: skip
    result = run_training(config, quiet=True)
    assert result["epsilon"] <= 4.0
    assert result["test_accuracy"] > 0.5
