"""Image-folder datasets (``imagefolder:PATH``) read with Pillow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpvision.data import load_dataset
from dpvision.data.resize import ImageGeometry
from dpvision.errors import DPVisionError


def _write(path: Path, array: np.ndarray, fmt: str = "PNG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format=fmt)


def _folder(root: Path, mode: str = "RGB", size: tuple[int, int] = (6, 4)) -> dict:
    """Writes 2 train + 1 test image per class for classes 'cat' and 'ant' (sorted: ant, cat)."""
    rng = np.random.default_rng(0)
    height, width = size
    shape = (height, width, 3) if mode == "RGB" else (height, width)
    written: dict = {}
    for split, count in (("train", 2), ("test", 1)):
        for cls in ("cat", "ant"):
            for i in range(count):
                array = rng.integers(0, 256, shape, dtype=np.uint8)
                _write(root / split / cls / f"img{i}.png", array)
                written[(split, cls, i)] = array
    return written


def test_rgb_png_folder(tmp_path: Path) -> None:
    written = _folder(tmp_path / "ds")
    (tmp_path / "ds" / "train" / "cat" / "notes.txt").write_text("ignored")
    ds = load_dataset(f"imagefolder:{tmp_path / 'ds'}")
    assert ds.class_names == ("ant", "cat")
    assert ds.num_classes == 2
    assert ds.train_images.shape == (4, 6, 4, 3)
    assert ds.test_images.shape == (2, 6, 4, 3)
    assert ds.train_labels.tolist() == [0, 0, 1, 1]
    np.testing.assert_array_equal(ds.train_images[2], written[("train", "cat", 0)])


def test_grayscale_folder_has_one_channel_when_asked(tmp_path: Path) -> None:
    written = _folder(tmp_path / "ds", mode="L")
    ds = load_dataset(f"imagefolder:{tmp_path / 'ds'}", channels=1)
    assert ds.train_images.shape == (4, 6, 4, 1)
    np.testing.assert_array_equal(ds.test_images[0, ..., 0], written[("test", "ant", 0)])


def test_one_rgb_image_does_not_change_the_input_shape(tmp_path: Path) -> None:
    # Before: one RGB training image turned a grayscale set into 3-channel input.
    _folder(tmp_path / "ds", mode="L")
    gray = load_dataset(f"imagefolder:{tmp_path / 'ds'}", channels=1).train_images.shape
    _write(tmp_path / "ds" / "train" / "cat" / "rgb.png", np.zeros((6, 4, 3), np.uint8), "PNG")
    mixed = load_dataset(f"imagefolder:{tmp_path / 'ds'}", channels=1).train_images.shape
    assert gray[1:] == mixed[1:] == (6, 4, 1)
    assert load_dataset(f"imagefolder:{tmp_path / 'ds'}").train_images.shape[-1] == 3


def test_mixed_modes_become_rgb_and_jpeg_is_read(tmp_path: Path) -> None:
    _folder(tmp_path / "ds", mode="L")
    _write(tmp_path / "ds" / "test" / "cat" / "extra.JPG", np.zeros((6, 4, 3), np.uint8), "JPEG")
    ds = load_dataset(f"imagefolder:{tmp_path / 'ds'}")
    assert ds.train_images.shape[-1] == 3
    assert ds.num_test == 3


def test_size_mismatch_without_a_size_names_no_file(tmp_path: Path) -> None:
    """The Python API without ``geometry``: a folder of mixed sizes is refused in one line
    that names the folder (the config's) and neither a private file nor a private size."""
    _folder(tmp_path / "ds")
    _write(tmp_path / "ds" / "test" / "cat" / "big.png", np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(DPVisionError, match="not all of one size") as error:
        load_dataset(f"imagefolder:{tmp_path / 'ds'}")
    message = str(error.value)
    assert "\n" not in message
    assert str(tmp_path / "ds") in message
    assert not [word for word in ("big.png", "img0.png", "8x8", "4x6") if word in message]


def test_missing_test_folder(tmp_path: Path) -> None:
    _write(tmp_path / "ds" / "train" / "a" / "x.png", np.zeros((2, 2), np.uint8))
    with pytest.raises(DPVisionError, match=r"ds/test: no such folder"):
        load_dataset(f"imagefolder:{tmp_path / 'ds'}")


def test_test_class_unknown_to_train(tmp_path: Path) -> None:
    _folder(tmp_path / "ds")
    _write(tmp_path / "ds" / "test" / "dog" / "x.png", np.zeros((6, 4, 3), np.uint8))
    with pytest.raises(DPVisionError, match=r"class folder\(s\) dog have no counterpart"):
        load_dataset(f"imagefolder:{tmp_path / 'ds'}")


def test_an_empty_class_folder_is_a_class_with_no_example(tmp_path: Path) -> None:
    """The label set is the folders' names; a class folder without images refused the run
    before issue 48's review, which told whether its one image was in the data."""
    _folder(tmp_path / "ds")
    (tmp_path / "ds" / "train" / "bee").mkdir()
    (tmp_path / "ds" / "test" / "bee").mkdir()
    dataset = load_dataset(f"imagefolder:{tmp_path / 'ds'}")
    assert dataset.class_names is not None
    assert "bee" in dataset.class_names
    bee = dataset.class_names.index("bee")
    assert bee not in set(dataset.train_labels.tolist())


def test_corrupt_image_names_the_file(tmp_path: Path) -> None:
    _folder(tmp_path / "ds")
    (tmp_path / "ds" / "train" / "ant" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DPVisionError, match=r"broken\.png: cannot read the image"):
        load_dataset(f"imagefolder:{tmp_path / 'ds'}")


def test_decoding_in_worker_processes_gives_the_same_arrays(tmp_path: Path, monkeypatch) -> None:
    """DataLoader workers decode large folders; the arrays and their order do not change."""
    from dpvision.data import imagefolder

    _folder(tmp_path / "ds")
    serial = load_dataset(f"imagefolder:{tmp_path / 'ds'}")
    monkeypatch.setattr(imagefolder, "PARALLEL_FROM", 2)
    assert imagefolder.decode_workers(4) >= 1
    parallel = load_dataset(f"imagefolder:{tmp_path / 'ds'}")
    np.testing.assert_array_equal(serial.train_images, parallel.train_images)
    np.testing.assert_array_equal(serial.test_images, parallel.test_images)
    np.testing.assert_array_equal(serial.train_labels, parallel.train_labels)


def test_a_broken_image_in_a_worker_is_one_line(tmp_path: Path, monkeypatch) -> None:
    from dpvision.data import imagefolder

    _folder(tmp_path / "ds")
    broken = tmp_path / "ds" / "train" / "cat" / "img1.png"
    broken.write_bytes(broken.read_bytes()[:60])  # the header survives, the pixels do not
    monkeypatch.setattr(imagefolder, "PARALLEL_FROM", 2)
    with pytest.raises(DPVisionError, match="cannot decode the image") as error:
        load_dataset(f"imagefolder:{tmp_path / 'ds'}")
    assert "\n" not in str(error.value)
    assert "img1.png" in str(error.value)


def test_one_image_changes_no_outcome_and_no_warning(tmp_path: Path, capfd) -> None:
    """Issue 48's review: a palette PNG with transparency made Pillow warn on stderr, a
    large image warned or was refused naming its file, and a class folder that lost its one
    image refused the run: each told whether that one private image was in the data. Now D
    and D plus (or minus) such an image both run, and nothing is printed."""
    import warnings

    from dpvision.testing import assert_same_outcome

    root = tmp_path / "tree"
    rng = np.random.default_rng(0)

    def run(extra: tuple[str, ...]) -> object:
        for kind in ("a", "b", "rare"):
            (root / kind).mkdir(parents=True, exist_ok=True)
            for old in (root / kind).iterdir():
                old.unlink()
        for i in range(40):  # both sides of the 80/20 split hold images (n is public)
            pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / ("a", "b")[i % 2] / f"{i}.png")
        if "palette" in extra:
            palette = Image.fromarray(rng.integers(0, 4, (8, 8), dtype=np.uint8), mode="P")
            palette.info["transparency"] = 0
            palette.save(root / "a" / "palette.png", transparency=0)
        if "large" in extra:
            Image.new("L", (12_000, 8_000)).save(root / "b" / "large.png")
        if "rare" in extra:
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                root / "rare" / "only.png"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning of a decode fails the run here
            geometry = ImageGeometry.from_config({"image_size": 8})
            return load_dataset(f"imagefolder:{root}", geometry=geometry).num_classes

    old_limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = 40_000_000  # 96 Mpx: over twice the limit, refused before
    try:
        outcome = assert_same_outcome(run, (), [("palette",), ("large",), ("rare",)])
        restored = Image.MAX_IMAGE_PIXELS  # the limit is back after each decode
    finally:
        Image.MAX_IMAGE_PIXELS = old_limit
    assert not outcome.refused
    assert restored == 40_000_000
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("layout", ["single tree", "train/test"])
def test_one_class_folder_is_refused_before_any_image_is_read(tmp_path: Path, layout) -> None:
    """A one-class "classifier" trained silently to 100 %. The class folders are the public
    label space, so refusing one folder says nothing of the images (none is read: a broken
    one in it would otherwise be the error)."""
    root = tmp_path / "ds"
    prefix = root if layout == "single tree" else root / "train"
    (prefix / "cat").mkdir(parents=True)
    (prefix / "cat" / "broken.png").write_bytes(b"not an image")
    if layout == "train/test":
        (root / "test" / "cat").mkdir(parents=True)
    with pytest.raises(DPVisionError, match=r"one class folder \(cat\); a classifier needs two"):
        load_dataset(f"imagefolder:{root}")
