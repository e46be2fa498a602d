"""Extraction: shapes, agreement with kymatio, pooling, projection, data independence."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from features_testing import isolate_cache, one_torch_thread, random_images
from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

from dpvision.errors import DPVisionError
from dpvision.features import (
    FeatureSpec,
    Progress,
    extract_features,
    feature_shape,
    parse_feature_spec,
    projection_matrix,
    scattering_channels,
)
from dpvision.features import scatternet as scatternet_module
from dpvision.features.scatternet import scatter

GRAY = (28, 28, 1)
RGB = (32, 32, 3)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own HOME and feature cache under tmp_path, and one torch thread."""
    with one_torch_thread():
        yield isolate_cache(tmp_path, monkeypatch)


def extract(images: np.ndarray, text: str, **kwargs: object) -> np.ndarray:
    return extract_features(images, parse_feature_spec(text), progress=False, **kwargs)  # type: ignore[arg-type]


def kymatio_reference(images: np.ndarray) -> np.ndarray:
    """kymatio's own output on independently normalised inputs, as Handcrafted-DP does it."""
    count, height, width, channels = images.shape
    x = images.astype(np.float64) / 255.0
    if channels == 3:  # transforms.Normalize with the ImageNet statistics
        x = (x - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    tensor = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32))
    with torch.no_grad():
        out = ScatteringTorch2D(J=2, shape=(height, width))(tensor)  # (N, C, 81, h, w)
    return out.reshape(count, -1, out.shape[-2], out.shape[-1]).numpy()


@pytest.mark.parametrize(("shape", "maps"), [(GRAY, (81, 7, 7)), (RGB, (243, 8, 8))])
def test_scatternet_shapes(shape, maps):
    images = random_images(3, *shape)
    flat = extract(images, "scatternet")
    assert flat.shape == (3, int(np.prod(maps)))
    assert flat.dtype == np.float32
    assert extract(images, "scatternet:flatten=false").shape == (3, *maps)
    assert feature_shape(shape, FeatureSpec("scatternet", flatten=False)) == maps
    assert maps[0] == scattering_channels(shape[2])


def test_scatternet_shape_of_fashion_mnist_is_3969():
    assert feature_shape(GRAY, FeatureSpec("scatternet")) == (3969,)
    assert feature_shape(RGB, FeatureSpec("scatternet")) == (243 * 8 * 8,)


@pytest.mark.parametrize("shape", [GRAY, RGB])
def test_scatternet_equals_kymatio(shape):
    images = random_images(4, *shape, seed=3)
    expected = kymatio_reference(images)
    maps = extract(images, "scatternet:flatten=false")
    np.testing.assert_allclose(maps, expected, rtol=1e-5, atol=1e-6)
    flat = extract(images, "scatternet")
    np.testing.assert_array_equal(flat, maps.reshape(len(images), -1))


@pytest.mark.parametrize(
    ("height", "width", "scales", "angles", "order"),
    [
        (32, 32, 2, 8, 2),  # CIFAR-10
        (28, 28, 2, 8, 1),
        (32, 32, 3, 8, 2),  # three scales: second-order paths from two first-order scales
        (33, 31, 3, 4, 2),  # odd sizes: uneven padding
        (24, 20, 2, 6, 2),
        (4, 4, 2, 8, 2),  # kymatio's case of a pad as wide as the image
        (64, 48, 4, 8, 2),
    ],
)
def test_scatter_equals_kymatio_on_any_configuration(height, width, scales, angles, order):
    """The transform, for every size, J, L and order, is kymatio's to float32 rounding."""
    x = torch.from_numpy(np.random.default_rng(5).random((3, 1, height, width), np.float32))
    transform = ScatteringTorch2D(J=scales, shape=(height, width), L=angles, max_order=order)
    with torch.no_grad():
        expected = transform(x).flatten(1, 2)
    got = scatter(x, scales=scales, angles=angles, max_order=order)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_scatter_is_the_same_in_chunks(monkeypatch):
    """Transforming a batch in chunks (which bounds memory) changes no value."""
    images = torch.rand(5, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    whole = scatter(images)
    monkeypatch.setattr(scatternet_module, "_CHUNK", 4)  # 15 channel-images: 4 chunks
    torch.testing.assert_close(scatter(images), whole, rtol=0, atol=0)


def test_scatter_of_no_images_has_the_shape_of_many():
    assert scatter(torch.rand(0, 3, 32, 32)).shape == (0, 243, 8, 8)
    assert scatter(torch.rand(0, 1, 28, 28), max_order=1).shape == (0, 17, 7, 7)


def test_low_pass_is_one_separable_product():
    """φ's kernel is rank one, so each S is one pair of small products (the speed-up)."""
    plan = scatternet_module._plan(32, 32, 2, 8, 2, "cpu")
    assert [len(pairs) for pairs in plan.low] == [1, 1]
    rows, cols_t = plan.low[0][0]
    assert rows.shape == (8, 40)
    assert cols_t.shape == (40, 8)


def test_scatternet_normalisation_matters_for_rgb_only():
    """RGB input is standardised before scattering; [0, 1] RGB input would differ."""
    images = random_images(2, *RGB, seed=4)
    unnormalised = torch.from_numpy(
        np.ascontiguousarray(images.transpose(0, 3, 1, 2)) / np.float32(255)
    )
    with torch.no_grad():
        raw = ScatteringTorch2D(J=2, shape=(32, 32))(unnormalised).reshape(2, 243, 8, 8).numpy()
    assert not np.allclose(extract(images, "scatternet:flatten=false"), raw, atol=1e-3)


@pytest.mark.parametrize("shape", [GRAY, RGB])
def test_pixels_are_scaled_channels_first(shape):
    images = random_images(5, *shape)
    features = extract(images, "pixels")
    height, width, channels = shape
    assert features.shape == (5, height * width * channels)
    assert features.dtype == np.float32
    assert features.min() >= 0.0
    assert features.max() <= 1.0
    expected = images.transpose(0, 3, 1, 2).reshape(5, -1) / np.float32(255)
    np.testing.assert_array_equal(features, expected)
    assert extract(images, "pixels:flatten=false").shape == (5, channels, height, width)


def test_pixels_hit_both_ends_of_the_range():
    images = np.zeros((2, 4, 4, 1), dtype=np.uint8)
    images[1] = 255
    features = extract(images, "pixels")
    assert features[0].max() == 0.0
    assert features[1].min() == 1.0


def test_pooling_averages_windows_including_the_border():
    images = random_images(2, 7, 7, 1)
    pooled = extract(images, "pixels:pool=2,flatten=false")
    assert pooled.shape == (2, 1, 4, 4)
    x = images[..., 0] / np.float32(255)
    np.testing.assert_allclose(pooled[:, 0, 0, 0], x[:, :2, :2].mean(axis=(1, 2)), rtol=1e-6)
    np.testing.assert_allclose(pooled[:, 0, 3, 3], x[:, 6, 6], rtol=1e-6)  # 1x1 corner window
    np.testing.assert_allclose(pooled[:, 0, 1, 3], x[:, 2:4, 6].mean(axis=1), rtol=1e-6)
    global_mean = extract(images, "pixels:pool=7,flatten=false")
    np.testing.assert_allclose(global_mean[:, 0, 0, 0], x.mean(axis=(1, 2)), rtol=1e-6)


def test_scatternet_pooling_shapes():
    images = random_images(2, *GRAY)
    assert extract(images, "scatternet:pool=2,flatten=false").shape == (2, 81, 4, 4)
    assert extract(images, "scatternet:pool=2").shape == (2, 81 * 16)
    maps = extract(images, "scatternet:flatten=false")
    pooled = extract(images, "scatternet:pool=7")
    np.testing.assert_allclose(pooled, maps.mean(axis=(2, 3)), rtol=1e-5, atol=1e-7)


def test_projection_is_the_seeded_matrix_applied_to_flat_features():
    images = random_images(6, *GRAY)
    projected = extract(images, "scatternet:projection_dim=32,projection_seed=5")
    assert projected.shape == (6, 32)
    assert projected.dtype == np.float32
    flat = extract(images, "scatternet")
    matrix = projection_matrix(3969, 32, seed=5)
    np.testing.assert_allclose(projected, flat @ matrix, rtol=1e-4, atol=1e-4)


def test_projection_matrix_is_seeded_and_scaled():
    a = projection_matrix(500, 400, seed=0)
    assert a.shape == (500, 400)
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, projection_matrix(500, 400, seed=0))
    assert not np.allclose(a, projection_matrix(500, 400, seed=1))
    # Entries are N(0, 1/dim): the sample variance of 200 000 entries is within 2 %.
    assert abs(float(a.var()) * 400 - 1.0) < 0.02
    assert abs(float(a.mean())) < 0.01 / np.sqrt(400) * 10


def test_projection_determinism_and_seed():
    images = random_images(4, 8, 8, 1)
    first = extract(images, "pixels:projection_dim=16,projection_seed=1")
    again = extract(images, "pixels:projection_dim=16,projection_seed=1")
    other = extract(images, "pixels:projection_dim=16,projection_seed=2")
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)


def test_projection_roughly_preserves_norms():
    images = random_images(3, *GRAY)
    flat = extract(images, "pixels")
    projected = extract(images, "pixels:projection_dim=2000")
    ratio = np.linalg.norm(projected, axis=1) / np.linalg.norm(flat, axis=1)
    np.testing.assert_allclose(ratio, 1.0, atol=0.1)


@pytest.mark.parametrize(
    "text",
    [
        "pixels",
        "pixels:pool=3,projection_dim=10",
        "scatternet",
        "scatternet:pool=2,projection_dim=20,projection_seed=3",
    ],
)
def test_features_are_data_independent(text):
    """An image's features do not depend on the other images: no statistic is used."""
    alone = random_images(3, *GRAY, seed=1)
    others = random_images(5, *GRAY, seed=2) // 2
    together = extract(np.concatenate([others, alone]), text, batch_size=4)
    np.testing.assert_allclose(together[5:], extract(alone, text), rtol=1e-5, atol=1e-6)


def test_batch_size_does_not_change_the_result():
    images = random_images(7, *GRAY)
    np.testing.assert_allclose(
        extract(images, "scatternet", batch_size=3), extract(images, "scatternet"), rtol=1e-6
    )


def test_empty_input_gives_empty_features():
    empty = np.zeros((0, *GRAY), dtype=np.uint8)
    assert extract(empty, "scatternet").shape == (0, 3969)
    assert extract(empty, "pixels:flatten=false").shape == (0, 1, 28, 28)


@pytest.mark.parametrize(
    ("images", "fragment"),
    [
        (np.zeros((2, 28, 28, 1), dtype=np.float32), "uint8 images"),
        (np.zeros((2, 28, 28), dtype=np.uint8), "uint8 images"),
        ([[0]], "got list"),
        (np.zeros((2, 28, 28, 4), dtype=np.uint8), "grayscale (C=1) or RGB (C=3)"),
        (np.zeros((2, 3, 3, 1), dtype=np.uint8), "at least 4x4"),
    ],
)
def test_bad_images_raise_one_line_errors(images, fragment):
    with pytest.raises(DPVisionError) as error:
        extract(images, "scatternet")
    assert fragment in str(error.value)
    assert "\n" not in str(error.value)


def test_bad_batch_size():
    with pytest.raises(DPVisionError, match="batch_size must be an integer >= 1"):
        extract(random_images(2, 4, 4, 1), "pixels", batch_size=0)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_one_line_on_a_terminal_only():
    terminal = _Terminal()
    with Progress(10, "demo", stream=terminal, interval=0.0) as bar:
        bar.update(4)
        bar.update(6)
    text = terminal.getvalue()
    assert text.count("\n") == 1
    assert text.endswith("\n")
    assert "\r" in text
    assert "demo: 10/10 images (100%)" in text
    plain = io.StringIO()  # a log, a pipe: plain lines, the first one at the start
    with Progress(10, "demo", stream=plain) as bar:
        assert plain.getvalue() == "[dpvision] demo: 0/10 images (  0%) 0 s\n"
        bar.update(10)
    assert "\r" not in plain.getvalue()
    disabled = _Terminal()
    with Progress(10, "demo", stream=disabled, enabled=False) as bar:
        bar.update(10)
    assert disabled.getvalue() == ""


def test_progress_shows_an_eta_midway():
    bar = Progress(10, "demo", enabled=False)
    bar.update(1)  # the first item's time holds the set-up: no rate from it alone
    assert "left" not in bar.render()
    bar.update(4)
    assert "5/10 images" in bar.render()
    assert "left" in bar.render()


def test_extraction_logs_a_plain_line_when_stderr_is_not_a_terminal(capsys):
    extract_features(random_images(2, 8, 8, 1), FeatureSpec("pixels"), progress=True)
    captured = capsys.readouterr()
    assert captured.err.startswith("[dpvision] pixels: 0/2 images (  0%) 0 s\n")
    assert "\r" not in captured.err
    assert captured.out == ""
    extract_features(random_images(2, 8, 8, 1), FeatureSpec("pixels"), progress=False)
    assert capsys.readouterr().err == ""


def test_importing_features_imports_neither_torch_nor_kymatio():
    code = (
        "import sys, dpvision.features as f; f.parse_feature_spec('scatternet:pool=2'); "
        "assert 'torch' not in sys.modules and 'kymatio' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
