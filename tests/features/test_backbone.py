"""Encoder (backbone) features: layers, pooling, norm, errors, the cache key, end to end."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from features_testing import isolate_cache, make_dataset, one_torch_thread, random_images

from dpvision.cli import main
from dpvision.data.core import images_to_tensor
from dpvision.errors import DPVisionError
from dpvision.features import (
    FeatureSpec,
    block_names,
    cache_key,
    encoder_features,
    extract_features,
    feature_shape,
    format_feature_spec,
    load_or_extract,
    parse_feature_spec,
)
from dpvision.features.reductions import rescale_to_norm
from dpvision.models.encoder import EncoderInfo, build_body, load_encoder, save_encoder

WRN_SHAPE = (1, 16, 16)
TANH_SHAPE = (1, 28, 28)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own HOME and feature cache under tmp_path, and one torch thread."""
    with one_torch_thread():
        yield isolate_cache(tmp_path, monkeypatch)


def save(path: Path, model: str, shape: tuple[int, int, int], seed: int = 0) -> Path:
    """A freshly initialised body of ``model`` (seeded), saved as an encoder file."""
    torch.manual_seed(seed)
    body = build_body(model, shape, 16)
    info = EncoderInfo(model, shape, 16, (0.5,), (0.25,), {"trained_on": "synthetic (test)"})
    return save_encoder(path, body, info)


@pytest.fixture
def wrn(tmp_path: Path) -> Path:
    return save(tmp_path / "wrn.pt", "wrn-10-1", WRN_SHAPE)


@pytest.fixture
def tanh(tmp_path: Path) -> Path:
    return save(tmp_path / "tanh.pt", "tanh-cnn", TANH_SHAPE)


def images_for(shape: tuple[int, int, int], count: int = 6, seed: int = 0) -> np.ndarray:
    channels, height, width = shape
    return random_images(count, height, width, channels, seed=seed)


def features(images: np.ndarray, path: Path, options: str = "") -> np.ndarray:
    spec = parse_feature_spec(f"encoder:path={path}{options}")
    out = extract_features(images, spec, progress=False)
    assert out.dtype == np.float32
    assert out.shape[1:] == feature_shape(images.shape[1:], spec)
    return out


def direct(path: Path, images: np.ndarray) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The body's output and the (first) output of every module, without the extractor."""
    body, info = load_encoder(path)
    outputs: dict[str, torch.Tensor] = {}

    def keeper(name: str) -> object:
        def hook(_module: torch.nn.Module, _inputs: object, output: torch.Tensor) -> None:
            outputs.setdefault(name, output)

        return hook

    for name, module in body.named_modules():
        if name:
            module.register_forward_hook(keeper(name))  # type: ignore[arg-type]
    with torch.no_grad():
        embedding = body(info.normalize(images_to_tensor(images)))
    return embedding, outputs


def test_block_names() -> None:
    assert block_names(build_body("wrn-10-1", WRN_SHAPE, 16)) == [
        "stem",
        "stages.0.0",
        "stages.1.0",
        "stages.2.0",
        "embedding",
    ]
    assert block_names(build_body("wrn-16-1", WRN_SHAPE, 16))[1:4] == [
        "stages.0.0",
        "stages.0.1",
        "stages.1.0",
    ]
    assert block_names(build_body("tanh-cnn", TANH_SHAPE, 16)) == [
        "features.1",
        "features.4",
        "embedding",
    ]


@pytest.mark.parametrize(
    ("options", "dim"),
    [
        ("", 64),
        (",layers=embedding", 64),
        (",layers=blocks", 16 + 16 + 32 + 64 + 64),
        (",layers=blocks,grid=2", (16 + 16 + 32 + 64) * 4 + 64),
        (",layers=stem+stages.0.0", 32),
        (",layers=stem+stages.0.0,grid=2", 128),
        (",layers=stages.2.0+embedding,grid=3", 64 * 9 + 64),
        (",projection_dim=10", 10),
    ],
)
def test_wrn_shapes(wrn: Path, options: str, dim: int) -> None:
    assert features(images_for(WRN_SHAPE), wrn, options).shape == (6, dim)


@pytest.mark.parametrize(
    ("options", "dim"),
    [("", 32), (",layers=blocks", 16 + 32 + 32), (",layers=features.1+embedding,grid=2", 96)],
)
def test_tanh_cnn_shapes(tanh: Path, options: str, dim: int) -> None:
    assert features(images_for(TANH_SHAPE), tanh, options).shape == (6, dim)


def test_unflattened_features_are_one_by_one_maps(wrn: Path) -> None:
    images = images_for(WRN_SHAPE)
    maps = features(images, wrn, ",layers=blocks,flatten=false")
    assert maps.shape == (6, 192, 1, 1)
    np.testing.assert_array_equal(maps.reshape(6, -1), features(images, wrn, ",layers=blocks"))


@pytest.mark.parametrize(("model", "shape"), [("wrn-10-1", WRN_SHAPE), ("tanh-cnn", TANH_SHAPE)])
def test_embedding_is_the_body_output(tmp_path: Path, model: str, shape: tuple) -> None:
    path = save(tmp_path / "enc.pt", model, shape)
    images = images_for(shape)
    embedding, _ = direct(path, images)
    assert torch.equal(torch.from_numpy(features(images, path)), embedding)
    blocks = features(images, path, ",layers=blocks")
    assert torch.equal(torch.from_numpy(blocks[:, -embedding.shape[1] :]), embedding)


def test_block_values_are_pooled_module_outputs(wrn: Path) -> None:
    images = images_for(WRN_SHAPE)
    embedding, outputs = direct(wrn, images)
    got = torch.from_numpy(features(images, wrn, ",layers=blocks,grid=2"))
    expected = [
        torch.nn.functional.adaptive_avg_pool2d(outputs[name], 2).flatten(1)
        for name in ("stem", "stages.0.0", "stages.1.0", "stages.2.0")
    ]
    torch.testing.assert_close(got, torch.cat([*expected, embedding], dim=1))
    # grid=1 is the global average; explicit layers come in the order given.
    swapped = torch.from_numpy(features(images, wrn, ",layers=stages.0.0+stem"))
    means = [outputs[name].mean(dim=(2, 3)) for name in ("stages.0.0", "stem")]
    torch.testing.assert_close(swapped, torch.cat(means, dim=1))


def test_batches_do_not_change_the_features(tanh: Path) -> None:
    images = images_for(TANH_SHAPE, count=7)
    spec = parse_feature_spec(f"encoder:path={tanh},layers=blocks")
    whole = extract_features(images, spec, progress=False)
    batched = encoder_features(images, spec, batch_size=3)
    np.testing.assert_allclose(batched, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("options", "norm"),
    [("", 50.0), (",layers=blocks,grid=2", 0.5), (",projection_dim=7", 3.0)],
)
def test_norm_rescales_every_vector(wrn: Path, options: str, norm: float) -> None:
    images = images_for(WRN_SHAPE)
    out = features(images, wrn, f"{options},norm={norm}")
    np.testing.assert_allclose(np.linalg.norm(out.astype(np.float64), axis=1), norm, rtol=1e-6)
    plain = features(images, wrn, options)
    scale = np.linalg.norm(plain, axis=1, keepdims=True) / norm
    np.testing.assert_allclose(out * scale, plain, rtol=1e-5, atol=1e-6)  # only rescaled


def test_rescale_keeps_zero_rows_zero() -> None:
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0], [float("nan"), 1.0]])
    out = rescale_to_norm(x, 2.0)
    torch.testing.assert_close(out, torch.tensor([[1.2, 1.6], [0.0, 0.0], [0.0, 0.0]]))


def test_wrong_image_shape(wrn: Path) -> None:
    spec = parse_feature_spec(f"encoder:path={wrn}")
    with pytest.raises(DPVisionError, match=r"takes images of shape \(1, 16, 16\)"):
        extract_features(images_for((1, 28, 28)), spec, progress=False)
    with pytest.raises(DPVisionError, match="these are"):
        feature_shape((16, 16, 3), spec)


def test_unknown_layer_lists_the_blocks(wrn: Path) -> None:
    spec = parse_feature_spec(f"encoder:path={wrn},layers=stem+stage.0.0")
    with pytest.raises(DPVisionError, match=r"no layer 'stage\.0\.0'") as error:
        extract_features(images_for(WRN_SHAPE), spec, progress=False)
    message = str(error.value)
    assert "\n" not in message
    assert "stem, stages.0.0, stages.1.0, stages.2.0, embedding" in message


def test_a_layer_run_twice_is_refused(wrn: Path) -> None:
    spec = parse_feature_spec(f"encoder:path={wrn},layers=stages.0.0.act")
    with pytest.raises(DPVisionError, match="runs 2 times"):
        extract_features(images_for(WRN_SHAPE), spec, progress=False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("encoder", "need an encoder file"),
        ("encoder:layers=blocks", "need an encoder file"),
        ("encoder:path=", "need an encoder file"),
        ("pixels:path=/tmp/enc.pt", "path applies to encoder and backbone features only"),
        ("scatternet:grid=2", "grid applies to encoder and backbone features only"),
        ("pixels:norm=1", "norm applies to encoder and backbone features only"),
        ("encoder:path=e.pt,pool=2", "use grid="),
        ("encoder:path=e.pt,grid=0", "grid must be >= 1"),
        ("encoder:path=e.pt,norm=0", "positive finite"),
        ("encoder:path=e.pt,norm=inf", "positive finite"),
        ("encoder:path=e.pt,norm=big", "norm must be a number"),
        ("encoder:path=e.pt,layers=blocks+stem", "give it alone"),
        ("encoder:path=e.pt,layers=stem+stem", "twice"),
        ("encoder:path=e.pt,layers=stem++embedding", "empty"),
    ],
)
def test_bad_specs(text: str, message: str) -> None:
    with pytest.raises(DPVisionError, match=message) as error:
        parse_feature_spec(text)
    assert "\n" not in str(error.value)


def test_missing_encoder_file(tmp_path: Path) -> None:
    spec = parse_feature_spec(f"encoder:path={tmp_path / 'nope.pt'}")
    with pytest.raises(DPVisionError, match="not found"):
        extract_features(images_for(WRN_SHAPE), spec, progress=False)
    with pytest.raises(DPVisionError, match="not found"):
        load_or_extract(make_dataset(shape=(16, 16, 1)), spec, progress=False)


def test_spec_round_trip() -> None:
    text = "encoder:path=/tmp/a b/enc.pt,layers=stem+stages.0.0,grid=2,norm=50.0"
    spec = parse_feature_spec(text)
    assert (spec.path, spec.layers, spec.grid, spec.norm) == (
        "/tmp/a b/enc.pt",
        "stem+stages.0.0",
        2,
        50.0,
    )
    assert format_feature_spec(spec) == text
    assert parse_feature_spec(format_feature_spec(spec)) == spec
    assert FeatureSpec("encoder", path="e.pt", norm=50) == parse_feature_spec(
        "encoder:path=e.pt,norm=50"
    )
    assert format_feature_spec(parse_feature_spec("encoder:path=e.pt")) == "encoder:path=e.pt"


def test_cache_key_follows_the_encoder_file(wrn: Path, isolated_cache: Path) -> None:
    dataset = make_dataset(shape=(16, 16, 1))
    spec = parse_feature_spec(f"encoder:path={wrn}")
    first_key = cache_key(dataset, spec)
    first, _ = load_or_extract(dataset, spec, progress=False)
    first = np.array(first)
    again, _ = load_or_extract(dataset, spec, progress=False)
    np.testing.assert_array_equal(again, first)
    assert len(list(isolated_cache.glob("*.json"))) == 1  # a hit: no second entry

    save(wrn, "wrn-10-1", WRN_SHAPE, seed=1)  # re-trained: same path, new weights
    assert cache_key(dataset, spec) != first_key
    second, _ = load_or_extract(dataset, spec, progress=False)
    assert not np.allclose(second, first)
    np.testing.assert_array_equal(
        second, extract_features(dataset.train_images, spec, progress=False)
    )
    assert len(list(isolated_cache.glob("*.json"))) == 2


def test_pixel_cache_keys_are_unchanged() -> None:
    key = cache_key(make_dataset(), FeatureSpec("pixels"))
    assert "encoder_sha256" not in key
    assert set(key["spec"]) == {
        "name",
        "pool",
        "projection_dim",
        "projection_seed",
        "flatten",
        "scales",
        "angles",
        "max_order",
    }


def _npz(path: Path, rng: np.random.Generator, count: int) -> Path:
    y = rng.integers(0, 2, count)
    x = rng.random((count, 28, 28)) * 60
    x[y == 1, :, :14] += 150  # class 1 is bright on the left, class 0 on the right
    x[y == 0, :, 14:] += 150
    split = count * 4 // 5
    np.savez(
        path,
        x_train=x[:split].astype(np.uint8),
        y_train=y[:split],
        x_test=x[split:].astype(np.uint8),
        y_test=y[split:],
    )
    return path


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--set", "preprocessing.kind=center", "--set", "preprocessing.clip_norm=5"],
    ],
)
def test_train_cli_on_encoder_features(tmp_path: Path, tanh: Path, extra: list[str]) -> None:
    data = _npz(tmp_path / "tiny.npz", np.random.default_rng(0), 500)
    features_text = f"encoder:path={tanh},layers=blocks" + (",norm=5" if extra else "")
    out = tmp_path / "result.json"
    argv = [
        "train",
        "--quiet",
        "--dataset",
        f"npz:{data}",
        "--set",
        "num_classes=10",
        "--features",
        features_text,
    ]
    argv += ["--method", "dp-ls", "--epsilon", "2", *extra, "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["features"] == features_text
    assert result["num_features"] == 80
    assert result["epsilon"] <= 2.0
    assert len(result["privacy_ledger"]) == (4 if extra else 3)
    assert result["test_accuracy"] > 0.6


@pytest.mark.parametrize("method", ["dp-fc", "dp-sgd-linear"])
def test_other_feature_learners_on_encoder_features(
    tmp_path: Path, tanh: Path, method: str
) -> None:
    data = _npz(tmp_path / "tiny.npz", np.random.default_rng(1), 500)
    out = tmp_path / "result.json"
    argv = [
        "train",
        "--quiet",
        "--dataset",
        f"npz:{data}",
        "--set",
        "num_classes=10",
        "--method",
        method,
    ]
    argv += ["--features", f"encoder:path={tanh},norm=1", "--epsilon", "1", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["num_features"] == 32
    assert result["epsilon"] <= 1.0
    assert result["test_accuracy"] > 0.6


def test_spec_fields_are_frozen(wrn: Path) -> None:
    spec = parse_feature_spec(f"encoder:path={wrn}")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.grid = 2  # type: ignore[misc]
