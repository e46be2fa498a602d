"""validate_model and replace_batchnorm: no layer may mix the examples of a batch."""

import pytest
import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models import replace_batchnorm, scatter_cnn, tanh_cnn, validate_model, wide_resnet


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def model_with_batchnorm() -> nn.Module:
    return nn.Sequential(
        nn.Sequential(
            nn.Conv2d(3, 24, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(24, 24, 3, padding=1),
            nn.BatchNorm2d(24),
        ),
        nn.Flatten(),
        nn.Linear(24 * 4 * 4, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 3),
    )


def test_dpvision_models_pass_the_validator():
    for model in (tanh_cnn((1, 28, 28)), tanh_cnn((3, 32, 32)), scatter_cnn(), wide_resnet(10, 1)):
        validate_model(model)


@pytest.mark.parametrize(
    "layer",
    [
        nn.BatchNorm1d(8),
        nn.BatchNorm2d(8),
        nn.BatchNorm3d(8),
        nn.SyncBatchNorm(8),
        nn.BatchNorm2d(8, affine=False, track_running_stats=False),
        nn.InstanceNorm2d(8, track_running_stats=True),
    ],
    ids=lambda layer: type(layer).__name__,
)
def test_validator_rejects_layers_that_mix_examples(layer):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Sequential(nn.ReLU(), layer))
    with pytest.raises(DPVisionError) as error:
        validate_model(model)
    message = str(error.value)
    assert "\n" not in message
    assert f"replace {type(layer).__name__} at layer '1.1'" in message


def test_validator_message_names_the_path_and_the_fix():
    with pytest.raises(DPVisionError) as error:
        validate_model(model_with_batchnorm())
    assert str(error.value) == (
        "replace BatchNorm2d at layer '0.3' with GroupNorm (e.g. nn.GroupNorm(12, 24)) or "
        "freeze its statistics to fine-tune (freeze_batchnorm(model)): BatchNorm mixes "
        "examples in a batch, which breaks per-example clipping "
        "(and 1 more such layer; replace_batchnorm(model) fixes them all)"
    )


@pytest.mark.parametrize(
    "layer",
    [nn.GroupNorm(4, 8), nn.LayerNorm([8, 6, 6]), nn.InstanceNorm2d(8), nn.Identity()],
    ids=lambda layer: type(layer).__name__,
)
def test_validator_accepts_per_example_layers(layer):
    validate_model(nn.Sequential(nn.Conv2d(3, 8, 3), layer))


def test_replace_batchnorm_returns_a_valid_copy_and_leaves_the_original():
    model = model_with_batchnorm()
    fixed = replace_batchnorm(model)
    validate_model(fixed)
    with pytest.raises(DPVisionError):
        validate_model(model)  # The original is unchanged.
    norm_2d, norm_1d = fixed[0][3], fixed[3]
    assert isinstance(norm_2d, nn.GroupNorm)
    assert (norm_2d.num_groups, norm_2d.num_channels) == (12, 24)  # Largest divisor ≤ 16.
    assert isinstance(norm_1d, nn.GroupNorm)
    assert (norm_1d.num_groups, norm_1d.num_channels) == (1, 8)  # (N, C) features: one group.
    assert fixed(torch.randn(3, 3, 4, 4)).shape == (3, 3)
    # The other weights are copied.
    torch.testing.assert_close(fixed[0][0].weight, model[0][0].weight)


def test_replace_batchnorm_keeps_examples_apart():
    fixed = replace_batchnorm(model_with_batchnorm())
    x = torch.randn(4, 3, 4, 4)
    together = fixed(x)
    alone = torch.cat([fixed(x[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(together, alone)


def test_replace_batchnorm_handles_a_root_layer_instance_norm_and_groups():
    root = replace_batchnorm(nn.BatchNorm2d(32), groups=8)
    assert isinstance(root, nn.GroupNorm)
    assert root.num_groups == 8
    small = replace_batchnorm(nn.Sequential(nn.BatchNorm2d(8), nn.BatchNorm3d(10)))
    assert [norm.num_groups for norm in small] == [8, 10]  # min(16, C) when it divides C.
    fixed = replace_batchnorm(nn.Sequential(nn.InstanceNorm2d(6, track_running_stats=True)))
    validate_model(fixed)
    assert isinstance(fixed[0], nn.GroupNorm)
    assert fixed[0].num_groups == 6
    with pytest.raises(DPVisionError, match="groups must be a positive integer"):
        replace_batchnorm(nn.BatchNorm2d(4), groups=0)


class _PatchEmbed(nn.Module):
    def __init__(self, img_size: int) -> None:
        super().__init__()
        self.img_size = (img_size, img_size)
        self.proj = nn.Conv2d(3, 4, 8, stride=8)


class _SmallViT(nn.Module):
    """A ViT's shape checks without timm: built for ``img_size``, weights' cfg at 224."""

    def __init__(self, img_size: int = 224, num_classes: int = 3) -> None:
        super().__init__()
        self.pretrained_cfg = {"input_size": (3, 224, 224)}
        self.patch_embed = _PatchEmbed(img_size)
        self.head = nn.Linear(4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != self.patch_embed.img_size:
            raise AssertionError(f"Input height ({x.shape[-2]}) doesn't match model")
        return self.head(self.patch_embed.proj(x).mean(dim=(2, 3)))


@pytest.mark.parametrize(("built", "named"), [(32, "32×32"), (224, "224×224")])
def test_a_size_mismatch_names_the_size_the_model_was_built_for(built, named):
    """``model_args = {img_size = 32}`` builds a ViT for 32×32 while its pretrained_cfg
    still says 224: the message names what the model as built takes."""
    from dpvision.models.registry import check_forward

    with pytest.raises(DPVisionError) as error:
        check_forward("python:vit.py:SmallViT", _SmallViT(img_size=built), (3, 48, 48), 3)
    message = str(error.value)
    assert f"takes {named} images, these are 48×48 (3 channels)" in message
    assert f"set image_size = {built}, or give learner.model_args = {{img_size = 48}}" in message
