"""learner.finetune: what trains, what is frozen."""

import pytest
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models import FrozenBatchNorm, wide_resnet
from dpvision.models.finetune import FINETUNE_MODES, apply_finetune, trainable_names


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        FrozenBatchNorm(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, bias=False),
        nn.GroupNorm(2, 4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def test_each_mode_trains_what_it_names():
    model = _net()
    assert trainable_names(model, "all") == [n for n, _ in model.named_parameters()]
    assert trainable_names(model, "head") == ["7.weight", "7.bias"]
    assert trainable_names(model, "norms+head") == [
        "1.weight",
        "1.bias",
        "4.weight",
        "4.bias",
        "7.weight",
        "7.bias",
    ]
    assert trainable_names(model, "bias+head") == [
        "0.bias",
        "1.bias",
        "4.bias",
        "7.weight",
        "7.bias",
    ]


@pytest.mark.parametrize("mode", FINETUNE_MODES)
def test_apply_freezes_the_rest(mode):
    model = wide_resnet(10, 1, num_classes=10)
    trained = apply_finetune(model, mode)
    assert trained == [n for n, p in model.named_parameters() if p.requires_grad]
    assert ("head" in mode) == (len(trained) < len(list(model.parameters())))


def test_unknown_mode_and_nothing_to_train():
    with pytest.raises(DPVisionError, match=r"unknown learner\.finetune 'lora'"):
        trainable_names(_net(), "lora")
    with pytest.raises(DPVisionError, match="no linear head"):
        apply_finetune(nn.Sequential(nn.Conv2d(1, 2, 3)), "head")
