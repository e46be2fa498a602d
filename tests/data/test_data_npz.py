"""The generic ``npz:PATH`` format and MedMNIST (DermaMNIST) archives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpvision.data import load_dataset
from dpvision.errors import DPVisionError


def _arrays(n_train: int = 8, n_test: int = 4, shape: tuple[int, ...] = (5, 6, 3)) -> dict:
    rng = np.random.default_rng(0)
    return {
        "x_train": rng.integers(0, 256, (n_train, *shape), dtype=np.uint8),
        "y_train": np.arange(n_train) % 3,
        "x_test": rng.integers(0, 256, (n_test, *shape), dtype=np.uint8),
        "y_test": np.arange(n_test) % 4,
    }


def _save(tmp_path: Path, **arrays: Any) -> Path:
    path = tmp_path / "my data.npz"
    np.savez(path, **arrays)
    return path


def test_uint8_channels_last(tmp_path: Path) -> None:
    arrays = _arrays()
    path = _save(tmp_path, **arrays)
    ds = load_dataset(f"npz:{path}", num_classes=4)
    assert ds.name == f"npz:{path}"
    assert ds.train_images.shape == (8, 5, 6, 3)
    np.testing.assert_array_equal(ds.train_images, arrays["x_train"])
    np.testing.assert_array_equal(ds.test_labels, arrays["y_test"])
    assert ds.num_classes == 4  # as given: never read off the labels


def test_float_grayscale_images_and_column_labels(tmp_path: Path) -> None:
    arrays = _arrays(shape=(4, 4))
    arrays["x_train"] = arrays["x_train"] / 255.0
    arrays["x_test"] = (arrays["x_test"] / 255.0).astype(np.float32)
    arrays["y_train"] = arrays["y_train"][:, None].astype(np.int32)
    path = _save(tmp_path, **arrays)
    ds = load_dataset(f"NPZ:{path}", num_classes=4)
    assert ds.train_images.shape == (8, 4, 4, 1)
    assert ds.train_images.dtype == np.uint8
    np.testing.assert_array_equal(ds.train_images[..., 0], np.rint(arrays["x_train"] * 255))
    assert ds.train_labels.dtype == np.int64
    assert ds.train_labels.shape == (8,)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"y_test": None}, r"missing array\(s\) y_test \(found: x_train, y_train, x_test\)"),
        ({"x_train": np.zeros((8, 3, 5, 6), np.uint8)}, r"x_train: .*channels-first\?"),
        ({"x_train": np.zeros((8, 30), np.uint8)}, r"x_train: images must have shape"),
        ({"x_train": np.full((8, 5, 6, 3), 255.0)}, r"x_train: float images must lie in \[0, 1\]"),
        ({"x_test": np.full((4, 5, 6, 3), np.nan)}, r"x_test: images contain NaN"),
        ({"x_test": np.zeros((4, 5, 5, 3), np.uint8)}, r"share one \(H, W, C\)"),
        ({"y_train": np.arange(7)}, r"x_train has 8 images but y_train has 7 labels"),
        ({"y_train": np.zeros(8) + 0.5}, r"y_train: labels must be integers"),
        ({"y_train": -np.ones(8, np.int64)}, r"y_train: labels must be >= 0"),
        ({"y_train": np.zeros((8, 2), np.int64)}, r"y_train: labels must have shape \(N,\)"),
        ({"x_train": np.full((8, 5, 6, 3), 300)}, r"x_train: integer images must lie in 0..255"),
    ],
)
def test_wrong_format_npz(tmp_path: Path, change: dict, message: str) -> None:
    arrays = _arrays()
    for key, value in change.items():
        if value is None:
            del arrays[key]
        else:
            arrays[key] = value
    path = _save(tmp_path, **arrays)
    with pytest.raises(DPVisionError, match=message) as info:
        load_dataset(f"npz:{path}", num_classes=10)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_object_arrays_are_refused(tmp_path: Path) -> None:
    arrays = _arrays()
    arrays["y_train"] = np.array([1, "a", None] * 3, dtype=object)[:8]
    path = _save(tmp_path, **arrays)
    with pytest.raises(
        DPVisionError, match=r"my data\.npz: cannot load array 'y_train' \(Object arrays"
    ):
        load_dataset(f"npz:{path}", num_classes=10)


@pytest.mark.parametrize("content", [b"not a zip at all", b"PK\x03\x04 truncated"])
def test_not_an_npz(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.npz"
    path.write_bytes(content)
    with pytest.raises(DPVisionError, match=r"bad\.npz: not a readable \.npz archive"):
        load_dataset(f"npz:{path}", num_classes=10)


def test_npy_instead_of_npz(tmp_path: Path) -> None:
    path = tmp_path / "single.npy"
    np.save(path, np.zeros(3))
    with pytest.raises(DPVisionError, match=r"single\.npy: a single \.npy array"):
        load_dataset(f"npz:{path}", num_classes=10)


def test_missing_npz_and_empty_path(tmp_path: Path) -> None:
    with pytest.raises(DPVisionError, match=r"nope\.npz: no such file"):
        load_dataset(f"npz:{tmp_path / 'nope.npz'}", num_classes=10)
    with pytest.raises(DPVisionError, match=r"names no path; write npz:PATH"):
        load_dataset("npz:", num_classes=10)


def test_dermamnist_train_and_test_only(datafiles: Any) -> None:
    path = datafiles.medmnist(datafiles.root / "dermamnist" / "dermamnist.npz", n=(14, 5, 7))
    ds = load_dataset("dermamnist", datafiles.root)
    assert ds.num_classes == 7
    assert ds.train_images.shape == (14, 28, 28, 3)
    assert ds.test_images.shape == (7, 28, 28, 3)
    assert ds.train_labels.shape == (14,)
    with np.load(path) as archive:
        np.testing.assert_array_equal(ds.train_images, archive["train_images"])
        np.testing.assert_array_equal(ds.train_labels, archive["train_labels"][:, 0])
    assert load_dataset("dermamnist", path.parent).num_train == 14
    assert load_dataset("dermamnist", path).num_train == 14


def test_dermamnist_labels_out_of_range(datafiles: Any) -> None:
    datafiles.medmnist(datafiles.root / "dermamnist.npz", classes=9)
    with pytest.raises(DPVisionError, match=r"dermamnist\.npz: train_labels has labels outside"):
        load_dataset("dermamnist", datafiles.root)


def test_dermamnist_missing_keys(datafiles: Any) -> None:
    np.savez(datafiles.root / "dermamnist.npz", x_train=np.zeros((1, 28, 28, 3), np.uint8))
    with pytest.raises(DPVisionError, match=r"missing array\(s\) train_images, train_labels"):
        load_dataset("dermamnist", datafiles.root)


def test_the_number_of_classes_is_given_not_read_off_the_labels(tmp_path):
    # Before: m = max(label) + 1, so one added example of label 9 changed the model's shape.
    path = tmp_path / "set.npz"
    labels = np.array([0, 1, 2, 1])
    images = np.zeros((4, 5, 5), np.uint8)
    np.savez(path, x_train=images, y_train=labels, x_test=images, y_test=labels)
    with pytest.raises(DPVisionError, match="needs its number of classes"):
        load_dataset(f"npz:{path}")
    assert load_dataset(f"npz:{path}", num_classes=10).num_classes == 10
    with pytest.raises(DPVisionError, match=r"y_train has labels outside \[0, 2\) but"):
        load_dataset(f"npz:{path}", num_classes=2)
