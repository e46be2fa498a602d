"""Synthetic images (dpvision.data.synthetic): shapes, determinism, the generators' statistics."""

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy import stats

from dpvision.data import synthetic
from dpvision.data.synthetic import (
    FILTER_BANK_NAMES,
    SYNTHETIC_KINDS,
    dead_leaves,
    generate,
    generator,
    oriented_filter_bank,
    preview_grid,
    sample_radii,
    spectral_noise,
    stream,
    write_preview,
)
from dpvision.errors import DPVisionError

DEAD_LEAVES = ("dead-leaves-squares", "dead-leaves-oriented", "dead-leaves-mixed")


def test_kinds_are_the_published_tuple() -> None:
    assert SYNTHETIC_KINDS == (
        "dead-leaves-squares",
        "dead-leaves-oriented",
        "dead-leaves-mixed",
        "oriented-filters",
        "spectral",
    )


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
@pytest.mark.parametrize(("size", "channels"), [(32, 3), (28, 1), (20, 3), (8, 1)])
def test_dtype_and_shape(kind: str, size: int, channels: int) -> None:
    images = generate(kind, 3, size=size, channels=channels)
    assert images.dtype == np.uint8
    assert images.shape == (3, size, size, channels)


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_zero_images(kind: str) -> None:
    assert generate(kind, 0, size=28, channels=1).shape == (0, 28, 28, 1)


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_image_depends_only_on_its_index(kind: str) -> None:
    images = generate(kind, 20, size=16)
    assert np.array_equal(generate(kind, 20, size=16), images)  # same seed: identical
    assert np.array_equal(generate(kind, 10, size=16, start=5)[3], images[8])
    assert np.array_equal(generate(kind, 10, size=16, start=5), images[5:15])
    batches = stream(kind, batch_size=3, size=16)
    assert np.array_equal(np.concatenate([next(batches) for _ in range(6)]), images[:18])
    resumed = stream(kind, batch_size=7, size=16, start=6)
    assert np.array_equal(next(resumed), images[6:13])
    assert np.array_equal(next(resumed), images[13:20])


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_seed_size_and_channels_change_the_images(kind: str) -> None:
    images = generate(kind, 4, size=16, channels=1)
    assert not np.array_equal(generate(kind, 4, size=16, channels=1, seed=1), images)
    assert not np.array_equal(generate(kind, 4, size=16, channels=3)[..., :1], images)
    for i in range(1, 4):  # images of one stream differ from each other
        assert not np.array_equal(images[i], images[0])


def test_kinds_differ_for_the_same_seed() -> None:
    first = {kind: generate(kind, 1, size=16)[0].tobytes() for kind in SYNTHETIC_KINDS}
    assert len(set(first.values())) == len(SYNTHETIC_KINDS)


def test_no_global_random_state_is_used() -> None:
    # The legacy global generator, on purpose: generate must neither read nor advance it.
    legacy = np.random
    legacy.seed(0)
    before = legacy.get_state()[1].copy()
    a = generate("spectral", 2, size=16)
    legacy.seed(123)
    b = generate("spectral", 2, size=16)
    assert np.array_equal(a, b)
    legacy.seed(0)
    generate("dead-leaves-mixed", 2, size=16)
    assert np.array_equal(legacy.get_state()[1], before)


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
@pytest.mark.parametrize("channels", [1, 3])
def test_images_use_the_value_range(kind: str, channels: int) -> None:
    images = generate(kind, 16, size=32, channels=channels).astype(np.float64)
    per_image = images.std(axis=(1, 2, 3))
    assert per_image.min() > 3.0  # no image is (nearly) constant
    assert per_image.mean() > 25.0
    assert images.min() <= 10
    assert images.max() >= 245
    if channels == 3:  # colour, not gray
        assert np.abs(images[..., 0] - images[..., 1]).mean() > 5.0


# --- dead leaves ----------------------------------------------------------------------------


@pytest.mark.parametrize("shapes", ["squares", "oriented", "mixed"])
def test_dead_leaves_cover_every_pixel(shapes: str) -> None:
    for index in range(30):
        rng = generator._image_rng(f"dead-leaves-{shapes}", 32, 3, 0, index)
        labels, drawn = dead_leaves.dead_leaves_labels(rng, 32, shapes)
        assert labels.min() >= 0  # -1 is the sentinel of an uncovered pixel
        assert drawn < synthetic.MAX_SHAPES
        assert labels.max() < drawn


def test_dead_leaves_stop_at_the_shape_limit() -> None:
    labels, drawn = dead_leaves.dead_leaves_labels(np.random.default_rng(0), 32, "squares", 10)
    assert drawn == 10
    assert (labels == -1).any()  # 10 shapes cannot cover 32×32; the background shows there


def test_dead_leaves_colours_are_flat_per_shape() -> None:
    rng = generator._image_rng("dead-leaves-squares", 32, 3, 0, 7)
    labels, _ = dead_leaves.dead_leaves_labels(rng, 32, "squares")
    image = generate("dead-leaves-squares", 1, start=7)[0].reshape(-1, 3)
    for label in np.unique(labels):
        assert len(np.unique(image[labels == label], axis=0)) == 1
    assert len(np.unique(labels)) > 10  # many leaves are visible


def test_frontmost_shape_wins() -> None:
    # Two large axis-aligned squares: the first drawn (front) hides the second where they meet.
    iy, ix = np.divmod(np.arange(64), 8)
    cx, cy = np.array([2.0, 4.0], np.float32), np.array([2.0, 4.0], np.float32)
    inside = dead_leaves.box_mask(ix, iy, 8, cx, cy, np.array([2.0, 2.0], np.float32))
    front = inside.argmax(axis=0).reshape(8, 8)
    assert inside[:, 3 * 8 + 3].all()
    assert front[3, 3] == 0
    assert front[5, 5] == 1
    assert front[1, 1] == 0


def test_rotated_rectangle_at_zero_angle_is_the_box() -> None:
    rng = np.random.default_rng(1)
    iy, ix = np.divmod(np.arange(16 * 16), 16)
    cx, cy = rng.uniform(0, 16, (2, 40)).astype(np.float32)
    half = rng.integers(1, 6, 40).astype(np.float32)
    box = dead_leaves.box_mask(ix, iy, 16, cx, cy, half)
    px, py = ix.astype(np.float32), iy.astype(np.float32)
    zero = np.zeros(40, np.float32)
    assert np.array_equal(dead_leaves.rectangle_mask(px, py, cx, cy, half, half, zero), box)
    subset = np.arange(0, 256, 3)  # the gathered path (uncovered pixels only)
    assert np.array_equal(
        dead_leaves.box_mask(ix[subset], iy[subset], 16, cx, cy, half), box[:, subset]
    )


def test_polygon_mask_of_a_triangle() -> None:
    # Counter-clockwise (0, 0), (4, 0), (0, 4), the last vertex repeated: x, y >= 0, x + y <= 4.
    px, py = np.array([1.0, 3.0, 1.0, 3.0, -0.5, 2.0]), np.array([1.0, 1.0, 2.5, 3.0, 1.0, 2.0])
    vx, vy = np.array([[0.0, 4.0, 0.0, 0.0]]), np.array([[0.0, 0.0, 4.0, 4.0]])
    inside = dead_leaves.polygon_mask(px, py, vx, vy)
    assert inside.tolist() == [[True, True, True, False, False, True]]


def _radius_cdf(r: np.ndarray, low: float, high: float, exponent: float) -> np.ndarray:
    p = 1.0 - exponent
    return (r**p - low**p) / (high**p - low**p)


def test_radii_follow_the_inverse_cube_law() -> None:
    rng = np.random.default_rng(0)
    radii = sample_radii(rng, 20_000)
    assert radii.min() >= 0.03
    assert radii.max() <= 1.0
    assert stats.kstest(radii, lambda r: _radius_cdf(r, 0.03, 1.0, 3.0)).pvalue > 1e-3
    # The same test rejects radii whose density is ∝ r^-2: it can see a wrong exponent.
    wrong = sample_radii(rng, 20_000, exponent=2.0)
    assert stats.kstest(wrong, lambda r: _radius_cdf(r, 0.03, 1.0, 3.0)).pvalue < 1e-6
    assert stats.kstest(wrong, lambda r: _radius_cdf(r, 0.03, 1.0, 2.0)).pvalue > 1e-3


def test_radii_with_exponent_one_are_log_uniform() -> None:
    radii = sample_radii(np.random.default_rng(0), 20_000, low=0.1, high=10.0, exponent=1.0)
    assert stats.kstest(np.log10(radii), "uniform", args=(-1, 2)).pvalue > 1e-3


def test_radii_reject_bad_arguments() -> None:
    with pytest.raises(DPVisionError, match="low < high"):
        sample_radii(np.random.default_rng(0), 10, low=0.5, high=0.1)
    with pytest.raises(DPVisionError, match="n must be"):
        sample_radii(np.random.default_rng(0), -1)


# --- oriented filters -----------------------------------------------------------------------


def test_filter_bank() -> None:
    bank = oriented_filter_bank()
    assert bank.shape == (40, 3, 3)
    assert len(FILTER_BANK_NAMES) == 40
    assert len(set(FILTER_BANK_NAMES)) == 40
    assert np.allclose(np.linalg.norm(bank.reshape(40, -1), axis=1), 1.0)
    assert np.array_equal(bank[20:], -bank[:20])  # the negatives, in the same order
    for name, f in zip(FILTER_BANK_NAMES, bank, strict=True):
        plain = name.lstrip("-")
        if plain in ("delta", "blur"):  # these pass low frequencies on: not zero-mean
            assert abs(f.sum()) > 0.5, name
        else:  # oriented edges and lines, centre-surround
            assert abs(f.sum()) < 1e-12, name
    edges = {n: f for n, f in zip(FILTER_BANK_NAMES, bank, strict=True) if n.startswith("edge")}
    assert len(edges) == 8
    assert np.allclose(edges["edge-90"], edges["edge-0"].T)  # a quarter turn swaps x and y
    assert np.allclose(edges["edge-45"], edges["edge-45"].T)
    lines = [n for n in FILTER_BANK_NAMES if n.startswith("line")]
    assert len(lines) == 8
    assert len({f.tobytes() for f in bank}) == 40  # all distinct
    assert not bank.flags.writeable


def test_oriented_filters_any_size_is_a_centre_crop() -> None:
    assert generate("oriented-filters", 2, size=33, channels=1).shape == (2, 33, 33, 1)


# --- spectral -------------------------------------------------------------------------------


def _spectrum_slope(fields: np.ndarray) -> float:
    """Least-squares slope of log power against log |f| (radial average, mid frequencies)."""
    size = fields.shape[1]
    power = (np.abs(np.fft.fft2(fields, axes=(1, 2))) ** 2).mean(axis=0)
    fy, fx = np.meshgrid(np.fft.fftfreq(size), np.fft.fftfreq(size), indexing="ij")
    ring = np.round(np.hypot(fy, fx) * size).astype(int)
    rings = np.arange(2, size // 3)
    radial = np.array([power[ring == k].mean() for k in rings])
    return float(np.polyfit(np.log(rings), np.log(radial), 1)[0])


def test_spectral_noise_has_the_power_law() -> None:
    rng = np.random.default_rng(0)
    slopes = []
    for alpha in (0.5, 1.0, 1.5, 2.5):
        fields = np.stack([spectral_noise(rng, 64, alpha)[:, :, 0] for _ in range(16)])
        slope = _spectrum_slope(fields)
        assert abs(slope + 2 * alpha) < 0.25, (alpha, slope)
        slopes.append(slope)
    assert slopes == sorted(slopes, reverse=True)  # steeper for larger α


def test_spectral_noise_is_standardised() -> None:
    fields = spectral_noise(np.random.default_rng(0), 20, 1.0, 5)
    assert fields.shape == (20, 20, 5)
    assert np.allclose(fields.mean(axis=(0, 1)), 0.0, atol=1e-9)
    assert np.allclose(fields.std(axis=(0, 1)), 1.0)


def test_spectral_images_vary_in_smoothness() -> None:
    images = generate("spectral", 40, size=32, channels=1)[..., 0].astype(np.float64)
    roughness = np.abs(np.diff(images, axis=2)).mean(axis=(1, 2)) / images.std(axis=(1, 2))
    assert roughness.max() > 3 * roughness.min()  # α ~ U(0.5, 2.5): rough and smooth images


# --- previews and errors --------------------------------------------------------------------


def test_preview_grid_layout() -> None:
    images = np.arange(5 * 4 * 3 * 1, dtype=np.uint8).reshape(5, 4, 3, 1)
    grid = preview_grid(images, columns=2, padding=1)
    assert grid.shape == (3 * 5 + 1, 2 * 4 + 1, 1)
    assert np.array_equal(grid[1:5, 1:4], images[0])
    assert np.array_equal(grid[1:5, 5:8], images[1])
    assert np.array_equal(grid[11:15, 1:4], images[4])
    assert (grid[11:15, 5:8] == 255).all()  # the empty cell is background
    assert preview_grid(images, columns=10, padding=0).shape == (4, 5 * 3, 1)


def test_write_preview_png(tmp_path: Path) -> None:
    path = write_preview("dead-leaves-squares", tmp_path / "a" / "rgb.png", n=10, columns=4)
    assert path == tmp_path / "a" / "rgb.png"
    with Image.open(path) as png:
        assert png.format == "PNG"
        assert png.mode == "RGB"
        assert png.size == (4 * 34 + 2, 3 * 34 + 2)  # (width, height)
        pixels = np.asarray(png)
    expected = preview_grid(generate("dead-leaves-squares", 10), columns=4)
    assert np.array_equal(pixels, expected)
    gray = write_preview("spectral", tmp_path / "gray.png", n=4, size=28, channels=1)
    with Image.open(gray) as png:
        assert png.mode == "L"
        assert png.size == (4 * 30 + 2, 30 + 2)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["gray.png", "rgb.png"]


def test_write_preview_replaces_a_file(tmp_path: Path) -> None:
    path = tmp_path / "p.png"
    path.write_bytes(b"old")
    write_preview("spectral", path, n=2, size=8)
    with Image.open(path) as png:
        assert png.size == (2 * 10 + 2, 12)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: generate("dead-leaves", 2), "choose from dead-leaves-squares, "),
        (lambda: generate("spectral", -1), "n must be >= 0"),
        (lambda: generate("spectral", 2.5), "n must be an integer"),
        (lambda: generate("spectral", 2, size=7), "size must be in"),
        (lambda: generate("spectral", 2, size=10_000), "size must be in"),
        (lambda: generate("spectral", 2, channels=2), "channels must be 1"),
        (lambda: generate("spectral", 2, channels=True), "channels must be 1"),
        (lambda: generate("spectral", 2, seed=-1), "seed must be >= 0"),
        (lambda: generate("spectral", 2, start=-3), "start must be >= 0"),
        (lambda: stream("spectral", batch_size=0), "batch_size must be >= 1"),
        (lambda: stream("nope", batch_size=2), "unknown synthetic image kind"),
        (lambda: preview_grid(np.zeros((2, 4, 4, 3), np.uint8), columns=0), "columns must be"),
        (lambda: preview_grid(np.zeros((2, 4, 4, 3), np.uint8), padding=-1), "padding must be"),
        (lambda: preview_grid(np.zeros((2, 4, 4, 3), np.float32)), "uint8 \\(N, H, W, C\\)"),
        (lambda: preview_grid(np.zeros((4, 4, 3), np.uint8)), "uint8 \\(N, H, W, C\\)"),
        (lambda: preview_grid(np.zeros((0, 4, 4, 3), np.uint8)), "at least one image"),
        (lambda: write_preview("spectral", "x.png", n=0), "n must be >= 1"),
        (lambda: write_preview("spectral", "x.png", columns=0), "columns must be"),
        (lambda: write_preview("spectral", "x.jpg"), "must end in .png"),
        (lambda: write_preview("squares", "x.png"), "unknown synthetic image kind"),
    ],
)
def test_bad_input_is_a_one_line_error(call: Callable[[], object], message: str) -> None:
    with pytest.raises(DPVisionError, match=message) as error:
        call()
    assert "\n" not in str(error.value)


def test_unwritable_preview_is_a_dpvision_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(DPVisionError, match="cannot write"):
        write_preview("spectral", blocker / "x.png", n=1, size=8)


def test_import_does_not_import_torch() -> None:
    code = "import sys, dpvision.data.synthetic; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
