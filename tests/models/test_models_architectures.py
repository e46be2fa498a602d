"""Architectures of dpvision.models: shapes, parameter counts, WSConv2d and argument checks."""

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models import (
    ScatterCNN,
    TanhCNN,
    WideResNet,
    WSConv2d,
    scatter_cnn,
    tanh_cnn,
    wide_resnet,
)


def count_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize(
    ("build", "input_shape", "num_classes"),
    [
        (lambda: tanh_cnn((1, 28, 28), num_classes=10), (1, 28, 28), 10),
        (lambda: tanh_cnn((3, 32, 32), num_classes=7), (3, 32, 32), 7),
        (lambda: scatter_cnn((81, 7, 7), num_classes=10), (81, 7, 7), 10),
        (lambda: scatter_cnn((243, 8, 8), num_classes=100), (243, 8, 8), 100),
        (lambda: wide_resnet(10, 1, num_classes=10), (3, 32, 32), 10),
        (lambda: wide_resnet(16, 4, num_classes=10), (3, 32, 32), 10),
        (lambda: wide_resnet(10, 2, num_classes=5, in_channels=1), (1, 28, 28), 5),
    ],
    ids=[
        "tanh-mnist",
        "tanh-cifar",
        "scatter-mnist",
        "scatter-cifar",
        "wrn-10-1",
        "wrn-16-4",
        "wrn-10-2-gray",
    ],
)
def test_factories_map_a_batch_to_one_row_of_logits_per_example(build, input_shape, num_classes):
    model = build()
    logits = model(torch.randn(3, *input_shape))
    assert logits.shape == (3, num_classes)
    assert torch.isfinite(logits).all()


def test_scatter_cnn_also_takes_flattened_features():
    model = scatter_cnn((81, 7, 7))
    features = torch.randn(2, 81, 7, 7)
    assert torch.equal(model(features), model(features.reshape(2, -1)))


def test_tanh_cnn_fmnist_has_the_parameter_count_of_the_paper():
    # conv 1·16·8·8+16 = 1,040; conv 16·32·4·4+32 = 8,224; fc 512·32+32 = 16,416;
    # fc 32·10+10 = 330.
    model = tanh_cnn((1, 28, 28), num_classes=10)
    assert count_parameters(model) == 1_040 + 8_224 + 16_416 + 330 == 26_010
    assert isinstance(model, TanhCNN)
    flatten_then_linear = model.classifier[1]
    assert isinstance(flatten_then_linear, nn.Linear)
    assert flatten_then_linear.in_features == 512 == 32 * 4 * 4


def test_other_models_have_the_documented_parameter_counts():
    assert count_parameters(tanh_cnn((3, 32, 32))) == 550_570
    assert count_parameters(scatter_cnn((81, 7, 7))) == 33_066
    assert count_parameters(scatter_cnn((243, 8, 8))) == 187_210
    assert count_parameters(wide_resnet(10, 1)) == 78_938


def test_wrn_16_4_has_about_2_75_million_parameters():
    model = wide_resnet(depth=16, width=4, num_classes=10)
    count = count_parameters(model)
    print(f"WRN-16-4 parameters: {count:,}")
    assert count == 2_753_818
    assert count == pytest.approx(2.75e6, rel=0.01)


def test_wide_resnet_structure_follows_jax_privacy():
    model = wide_resnet(depth=16, width=4)
    assert isinstance(model, WideResNet)
    assert len(model.stages) == 3
    for stage, channels in zip(model.stages, (64, 128, 256), strict=True):
        assert len(stage) == 2  # (16 − 4) / 6 blocks per stage.
        first, second = stage
        assert isinstance(first.skip, nn.Sequential)  # 1×1 WSConv of norm(act(x)).
        assert isinstance(first.skip[2], WSConv2d)
        assert first.skip[2].kernel_size == 1
        assert isinstance(second.skip, nn.Identity)
        assert first.conv_1.out_channels == channels
    assert [stage[0].conv_0.stride for stage in model.stages] == [1, 2, 2]
    assert not any(
        isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules()
    )


@pytest.mark.parametrize("depth", [4, 12, 15, 0, -2])
def test_bad_wide_resnet_depth_is_a_user_error(depth):
    with pytest.raises(DPVisionError, match="6·n \\+ 4"):
        wide_resnet(depth=depth, width=1)


@pytest.mark.parametrize(
    "build",
    [
        lambda: tanh_cnn((3, 28, 28)),
        lambda: tanh_cnn((1, 32, 32)),
        lambda: tanh_cnn((1, 28)),
        lambda: scatter_cnn((81, 8, 8)),
        lambda: scatter_cnn((81, 7, 7), groups=10),
        lambda: tanh_cnn((1, 28, 28), num_classes=1),
        lambda: wide_resnet(16, 0),
        lambda: wide_resnet(16, 4, groups=5),
        lambda: ScatterCNN((243, 8, 8), groups=-1),
        lambda: WSConv2d(3, 8, 3, padding=-1),
    ],
)
def test_bad_arguments_are_one_line_user_errors(build):
    with pytest.raises(DPVisionError) as error:
        build()
    assert "\n" not in str(error.value)


def manual_ws_weight(weight: torch.Tensor, gain: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    fan_in = weight[0].numel()
    mean = weight.mean(dim=(1, 2, 3), keepdim=True)
    var = ((weight - mean) ** 2).mean(dim=(1, 2, 3), keepdim=True)
    return (weight - mean) * gain / torch.sqrt(torch.clamp(fan_in * var, min=eps))


def randomise(conv: WSConv2d) -> WSConv2d:
    with torch.no_grad():
        conv.gain.copy_(torch.rand_like(conv.gain) + 0.5)
        conv.bias.copy_(torch.randn_like(conv.bias))
    return conv


def test_ws_conv_equals_a_manual_standardised_convolution():
    conv = randomise(WSConv2d(5, 7, 3, stride=1, padding=1).double())
    x = torch.randn(2, 5, 9, 9, dtype=torch.float64)
    expected = F.conv2d(x, manual_ws_weight(conv.weight, conv.gain), conv.bias, padding=1)
    torch.testing.assert_close(conv(x), expected)
    ws = conv.standardized_weight()
    # Each output channel of ŵ/gain has mean 0 and squared norm 1 (fan_in · var = 1).
    unit = ws / conv.gain
    torch.testing.assert_close(unit.mean(dim=(1, 2, 3)), torch.zeros(7, dtype=torch.float64))
    torch.testing.assert_close(unit.pow(2).sum(dim=(1, 2, 3)), torch.ones(7, dtype=torch.float64))


def test_ws_conv_same_padding_pads_after_like_tensorflow():
    conv = randomise(WSConv2d(3, 4, 3, stride=2, padding="same").double())
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    padded = F.pad(x, (0, 1, 0, 1))
    expected = F.conv2d(padded, manual_ws_weight(conv.weight, conv.gain), conv.bias, stride=2)
    out = conv(x)
    assert out.shape == (2, 4, 4, 4)
    torch.testing.assert_close(out, expected)


def test_ws_conv_floors_the_variance_and_differentiates_through_standardisation():
    conv = WSConv2d(2, 3, 3, padding=1).double()
    with torch.no_grad():
        conv.weight.fill_(0.5)  # Zero variance: ŵ = 0, so the output is the bias.
        conv.bias.copy_(torch.tensor([1.0, 2.0, 3.0]))
    out = conv(torch.randn(1, 2, 4, 4, dtype=torch.float64))
    torch.testing.assert_close(out, conv.bias.view(1, 3, 1, 1).expand(1, 3, 4, 4))

    conv = WSConv2d(4, 6, 3, padding=1).double()
    conv(torch.randn(2, 4, 5, 5, dtype=torch.float64)).pow(2).sum().backward()
    assert conv.weight.grad is not None
    # ŵ does not change when a constant is added to a channel's weights, so the gradient of
    # each output channel sums to zero; gain gets a gradient too.
    torch.testing.assert_close(
        conv.weight.grad.sum(dim=(1, 2, 3)), torch.zeros(6, dtype=torch.float64)
    )
    assert conv.gain.grad is not None
    assert conv.gain.grad.abs().sum() > 0


def test_ws_conv_initialisation():
    conv = WSConv2d(64, 256, 3)
    assert conv.weight.std().item() == pytest.approx(1 / math.sqrt(64 * 9), rel=0.03)
    assert torch.equal(conv.gain, torch.ones(256, 1, 1, 1))
    assert torch.equal(conv.bias, torch.zeros(256))


def test_scatter_cnn_without_input_norm_for_privately_normalised_features():
    model = ScatterCNN((81, 7, 7), groups=0)
    assert isinstance(model.norm, torch.nn.Identity)
    assert model(torch.zeros(2, 81, 7, 7)).shape == (2, 10)
