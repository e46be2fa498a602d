"""``TrainedModel.predict`` takes what ``dpvision predict`` takes (issue 52, item 1): arrays
of any size, Pillow images, lists, files and folders, each brought to the model's geometry
exactly as the command line decodes the same image."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import dpvision
from dpvision.cli import main
from dpvision.data.imagefolder import read_images
from dpvision.data.pictures import as_images
from dpvision.data.resize import ImageGeometry
from dpvision.errors import DPVisionError

GEOMETRY = ImageGeometry((24, 24), crop_mode="border", interpolation="bicubic")


def _picture(rng: np.random.Generator, size: tuple[int, int], mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (*size, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def _files(root: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    sizes = [(105, 133), (32, 32), (70, 20)]
    paths = []
    for i, (size, mode) in enumerate(zip(sizes, ["RGB", "RGBA", "L"], strict=True)):
        paths.append(root / f"img{i}.png")
        _picture(rng, size, mode).save(paths[-1])
    return paths


@pytest.mark.parametrize("channels", [1, 3])
def test_every_kind_of_input_gives_the_pixels_of_the_files(tmp_path, channels):
    files = _files(tmp_path / "images")
    expected = read_images(files, channels=channels, geometry=GEOMETRY)
    opened = [Image.open(f) for f in files]
    arrays = [np.asarray(image) for image in opened]  # (H, W, 3), (H, W, 4) and (H, W)
    for inputs in (tmp_path / "images", files, [str(f) for f in files], opened, arrays):
        got = as_images(inputs, channels, GEOMETRY)
        assert got.dtype == np.uint8
        assert got.shape == (3, 24, 24, channels)
        np.testing.assert_array_equal(got, expected)
    one = as_images(arrays[0], channels, GEOMETRY)  # one image, no batch axis
    np.testing.assert_array_equal(one, expected[:1])
    np.testing.assert_array_equal(as_images(opened[2], channels, GEOMETRY), expected[2:])
    batch = np.stack([np.asarray(Image.open(files[0]))] * 2)  # (N, H, W, C)
    np.testing.assert_array_equal(as_images(batch, channels, GEOMETRY), expected[[0, 0]])


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (np.zeros((8, 8, 3), dtype=np.float32), r"uint8 images \(0–255\), got float32"),
        (torch.zeros(1, 3, 8, 8), "got Tensor"),
        ([[np.zeros((8, 8), dtype=np.uint8)]], "a list inside a list"),
        (np.zeros((2, 8, 8, 5), dtype=np.uint8), r"C = 1, 3 or 4; got shape \(2, 8, 8, 5\)"),
        (42, "got int"),
    ],
)
def test_what_it_cannot_read_is_one_line(inputs, message):
    with pytest.raises(DPVisionError, match=message) as error:
        as_images(inputs, 3, GEOMETRY)
    assert "\n" not in str(error.value)


def test_a_loaded_model_predicts_real_images_as_dpvision_predict_does(tmp_path, capsys):
    """The issue's notebook: a 105×133 array, a Pillow image and a list of mixed sizes."""
    rng = np.random.default_rng(1)
    root = tmp_path / "tree"
    for label, cls in enumerate(("a", "b")):
        for i in range(10):
            path = root / cls / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            _picture(rng, (30 + 7 * i + label, 40)).save(path)
    model_file = tmp_path / "m.safetensors"
    argv = ["train", "-q", "--dataset", f"imagefolder:{root}", "--method", "dp-ls"]
    argv += ["--features", "pixels", "--set", "image_size=16", "--save", str(model_file)]
    assert main(argv) == 0
    files = _files(tmp_path / "new")
    capsys.readouterr()
    assert main(["predict", str(model_file), str(tmp_path / "new"), "--proba"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))[1:]
    cli_labels = [int(row[1]) for row in rows]
    cli_probabilities = np.array([[float(p) for p in row[3:]] for row in rows])

    model = dpvision.load_model(model_file)
    opened = [Image.open(f) for f in files]
    arrays = [np.asarray(image) for image in opened]
    for inputs in (opened, arrays, files, tmp_path / "new"):
        assert model.predict(inputs).tolist() == cli_labels
        np.testing.assert_allclose(model.predict_proba(inputs), cli_probabilities, rtol=1e-12)
    assert model.predict(arrays[0]).tolist() == cli_labels[:1]  # a single 105×133 image
    assert model.predict(opened[0]).tolist() == cli_labels[:1]
    assert model.score(files, np.array(cli_labels)) == 1.0
