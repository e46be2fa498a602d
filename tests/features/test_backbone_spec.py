"""``backbone:model=…,weights=…`` features: any model's body, its weights, cached by them."""

import numpy as np
import pytest
import torch

from dpvision.errors import DPVisionError
from dpvision.features import extract_features, parse_feature_spec
from dpvision.features.cache import cache_key
from dpvision.models import tanh_cnn
from dpvision.models.heads import replace_head


@pytest.fixture
def weights(tmp_path):
    torch.manual_seed(0)
    model = tanh_cnn((1, 28, 28), num_classes=10)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    return model, tmp_path / "w.pt"


def test_backbone_features_are_the_body_outputs(weights):
    model, path = weights
    images = np.random.default_rng(0).integers(0, 255, (4, 28, 28, 1), dtype=np.uint8)
    features = extract_features(
        images, parse_feature_spec(f"backbone:model=tanh-cnn,weights={path}")
    )
    body = replace_head(model, torch.nn.Identity()).eval()
    with torch.no_grad():
        expected = body(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255)
    np.testing.assert_allclose(features, expected.numpy(), rtol=1e-5, atol=1e-6)
    layer = extract_features(
        images, parse_feature_spec(f"backbone:model=tanh-cnn,weights={path},layer=features.1")
    )
    assert layer.shape == (4, 16)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("backbone", "need a model"),
        ("backbone:model=tanh-cnn,path=x.pt", "not path="),
        ("backbone:model=tanh-cnn,tokens=cls", "tokens must be one of"),
        ("backbone:model=tanh-cnn,pool=2", "pool does not apply"),
        ("encoder:path=e.pt,model=tanh-cnn", "is for backbone features"),
        ("scatternet:weights=w.pt", "applies to encoder and backbone features only"),
    ],
)
def test_bad_backbone_specs_are_one_line_errors(text, message):
    with pytest.raises(DPVisionError, match=message) as error:
        parse_feature_spec(text)
    assert "\n" not in str(error.value)


def test_the_cache_key_follows_the_weights_file(weights, tmp_path):
    from dpvision.data.core import ImageDataset

    model, path = weights
    images = np.zeros((2, 28, 28, 1), np.uint8)
    dataset = ImageDataset("x", images, np.zeros(2, int), images, np.zeros(2, int), 10)
    spec = parse_feature_spec(f"backbone:model=tanh-cnn,weights={path}")
    before = cache_key(dataset, spec)
    with torch.no_grad():
        model.features[0].weight.add_(1)
    torch.save(model.state_dict(), path)
    assert cache_key(dataset, spec)["encoder_sha256"] != before["encoder_sha256"]
