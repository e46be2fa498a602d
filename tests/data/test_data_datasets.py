"""Dataset names, the ImageDataset container, the lookup order, digits and real Fashion-MNIST."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpvision.data import (
    DATASETS,
    ImageDataset,
    available_datasets,
    images_to_float,
    images_to_tensor,
    load_dataset,
    sources,
)
from dpvision.errors import DPVisionError


def _dataset(**changes: Any) -> ImageDataset:
    fields: dict[str, Any] = {
        "name": "t",
        "train_images": np.zeros((4, 3, 2, 1), np.uint8),
        "train_labels": np.array([0, 1, 2, 1]),
        "test_images": np.zeros((2, 3, 2, 1), np.uint8),
        "test_labels": np.array([2, 0]),
        "num_classes": 3,
    }
    fields.update(changes)
    return ImageDataset(**fields)


def test_image_dataset_properties() -> None:
    ds = _dataset()
    assert ds.image_shape == (3, 2, 1)
    assert (ds.num_train, ds.num_test) == (4, 2)
    assert "train=4" in repr(ds)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"train_images": np.zeros((4, 3, 2), np.uint8)}, "train images must be a uint8 array"),
        ({"test_images": np.zeros((2, 3, 2, 1), np.float32)}, "test images must be a uint8"),
        ({"train_labels": np.array([0, 1, 2])}, "4 train images but 3 train labels"),
        ({"test_labels": np.array([0, 3])}, r"test labels must lie in \[0, 3\)"),
        ({"test_labels": np.array([0.0, 1.0])}, "test labels must be an int64 array"),
        ({"test_images": np.zeros((2, 3, 3, 1), np.uint8)}, "train images are"),
        ({"class_names": ("a", "b")}, "2 class names for 3 classes"),
        ({"num_classes": 0}, "num_classes must be >= 1"),
    ],
)
def test_image_dataset_validation(change: dict, message: str) -> None:
    with pytest.raises(DPVisionError, match=message):
        _dataset(**change)


def test_float_conversion_is_nchw_in_unit_interval() -> None:
    images = np.arange(2 * 3 * 4 * 3, dtype=np.uint8).reshape(2, 3, 4, 3) * 2
    out = images_to_float(images)
    assert out.dtype == np.float32
    assert out.shape == (2, 3, 3, 4)
    assert out.flags.c_contiguous
    np.testing.assert_array_equal(out, images.transpose(0, 3, 1, 2) / np.float32(255))
    tensor = images_to_tensor(images)
    assert tuple(tensor.shape) == (2, 3, 3, 4)
    assert str(tensor.dtype) == "torch.float32"
    assert float(images_to_float(np.full((1, 1, 1, 1), 255, np.uint8))[0, 0, 0, 0]) == 1.0
    with pytest.raises(DPVisionError, match="expects uint8 images"):
        images_to_float(images.astype(np.float32))


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(DPVisionError, match=r"unknown dataset 'imagenet'; choose one of: digits"):
        load_dataset("imagenet")
    assert "npz:PATH" in available_datasets()
    assert set(DATASETS) == {
        "digits",
        "mnist",
        "fashion-mnist",
        "cifar10",
        "cifar10-jpeg",
        "cifar100",
        "dermamnist",
    }


def test_digits() -> None:
    ds = load_dataset("digits")
    assert ds.num_classes == 10
    assert ds.train_images.shape == (1438, 8, 8, 1)
    assert ds.test_images.shape == (359, 8, 8, 1)
    assert ds.train_images.dtype == np.uint8
    assert ds.train_images.max() == 255
    counts = np.bincount(ds.test_labels, minlength=10)
    assert counts.min() >= 35
    assert counts.max() <= 37
    again = load_dataset("digits")
    np.testing.assert_array_equal(again.test_labels, ds.test_labels)
    np.testing.assert_array_equal(again.train_images, ds.train_images)


def test_import_does_not_import_torch(datafiles: Any) -> None:
    datafiles.mnist(datafiles.root / "mnist")
    code = (
        f"import sys, dpvision.data as d; d.load_dataset('mnist', {str(datafiles.root)!r}); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- lookup order -------------------------------------------------------------------------


def _mnist_copies(datafiles: Any, isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Writes distinguishable MNIST copies in every lookup place; returns their train sizes."""
    places = {
        "explicit": (datafiles.root / "explicit", 11),
        "env": (datafiles.root / "env" / "mnist", 12),
        "cache": (isolated_env / ".cache" / "dpvision" / "mnist", 13),
        "system": (datafiles.root / "system" / "mnist", 14),
    }
    for folder, n_train in places.values():
        datafiles.mnist(folder, n_train=n_train, n_test=2)
    monkeypatch.setenv(sources.ENV_DATA, str(datafiles.root / "env"))
    monkeypatch.setattr(sources, "SYSTEM_DATA_DIRS", (datafiles.root / "system",))
    return places


def test_lookup_order(datafiles: Any, isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    places = _mnist_copies(datafiles, isolated_env, monkeypatch)
    assert load_dataset("mnist", places["explicit"][0]).num_train == 11
    assert load_dataset("mnist").num_train == 12
    monkeypatch.delenv(sources.ENV_DATA)
    assert load_dataset("mnist").num_train == 13
    monkeypatch.setenv("HOME", str(datafiles.root / "elsewhere"))
    assert load_dataset("mnist").num_train == 14


def test_explicit_dir_is_the_only_place_looked_at(
    datafiles: Any, isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _mnist_copies(datafiles, isolated_env, monkeypatch)
    empty = datafiles.root / "empty"
    empty.mkdir()
    with pytest.raises(DPVisionError, match=r"mnist not found in .*empty \(nor in .*empty/mnist\)"):
        load_dataset("mnist", empty)


def test_data_dir_accepts_str_and_tilde(datafiles: Any, isolated_env: Path) -> None:
    datafiles.mnist(isolated_env / "mydata" / "mnist")
    assert load_dataset("mnist", "~/mydata").num_train == 30


def test_not_found_lists_the_places_searched(
    datafiles: Any, isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(sources.ENV_DATA, str(datafiles.root / "env"))
    monkeypatch.setattr(sources, "SYSTEM_DATA_DIRS", (Path("/nonexistent/datasets"),))
    with pytest.raises(DPVisionError) as info:
        load_dataset("cifar10")
    message = str(info.value)
    assert "\n" not in message
    assert str(datafiles.root / "env" / "cifar10") in message
    assert str(isolated_env / ".cache" / "dpvision" / "cifar10") in message
    assert "/nonexistent/datasets/cifar10" in message
    assert "--data-dir" in message
    assert "DPVISION_DATA" in message
    assert "DPVISION_OFFLINE is set" in message


def test_download_false_never_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sources.ENV_OFFLINE)

    def fail(*args: Any) -> None:
        raise AssertionError("download attempted")

    monkeypatch.setattr(sources, "download_dataset", fail)
    with pytest.raises(DPVisionError, match="downloads are disabled"):
        load_dataset("dermamnist", download=False)


# --- the real Fashion-MNIST ---------------------------------------------------------------


def test_real_fashion_mnist(real_fashion_mnist: Path) -> None:
    ds = load_dataset("fashion-mnist", real_fashion_mnist)
    assert ds.train_images.shape == (60000, 28, 28, 1)
    assert ds.test_images.shape == (10000, 28, 28, 1)
    assert ds.num_classes == 10
    assert np.bincount(ds.train_labels, minlength=10).tolist() == [6000] * 10
    assert np.bincount(ds.test_labels, minlength=10).tolist() == [1000] * 10
    assert ds.train_images.max() == 255
    assert ds.train_images.min() == 0
