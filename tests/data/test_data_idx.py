"""IDX (MNIST / Fashion-MNIST) files: parsing, validation and loading by name."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpvision.data import load_dataset
from dpvision.data.idx import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, read_idx
from dpvision.errors import DPVisionError


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_loads_from_the_folder_itself(datafiles: Any, gz: bool) -> None:
    folder = datafiles.root / "m"
    written = datafiles.mnist(folder, gz=gz)
    ds = load_dataset("mnist", folder)
    assert ds.name == "mnist"
    assert ds.num_classes == 10
    assert ds.train_images.shape == (30, 28, 28, 1)
    assert ds.train_images.dtype == np.uint8
    assert ds.train_labels.dtype == np.int64
    assert ds.test_images.shape == (20, 28, 28, 1)
    np.testing.assert_array_equal(ds.train_images[..., 0], written["train_images"])
    np.testing.assert_array_equal(ds.train_labels, written["train_labels"])
    np.testing.assert_array_equal(ds.test_images[..., 0], written["test_images"])
    np.testing.assert_array_equal(ds.test_labels, written["test_labels"])
    assert ds.class_names == tuple(str(d) for d in range(10))


def test_fashion_mnist_loads_from_a_parent_folder(datafiles: Any) -> None:
    datafiles.mnist(datafiles.root / "fashion-mnist")
    ds = load_dataset("Fashion-MNIST", datafiles.root)
    assert ds.name == "fashion-mnist"
    assert ds.num_train == 30
    assert ds.class_names is not None
    assert ds.class_names[0] == "T-shirt/top"


def test_read_idx_detects_gzip_by_content_not_name(datafiles: Any) -> None:
    labels = np.arange(7, dtype=np.uint8)
    path = datafiles.write_idx(datafiles.root / "labels.idx", labels, IDX_LABELS_MAGIC, gz=True)
    np.testing.assert_array_equal(read_idx(path, IDX_LABELS_MAGIC), labels)
    assert read_idx(path, IDX_LABELS_MAGIC).flags.writeable


def _mnist_file(datafiles: Any, stem: str) -> Path:
    folder = datafiles.root / "m"
    datafiles.mnist(folder)
    return folder / f"{stem}.gz"


def test_truncated_gzip_names_the_file(datafiles: Any) -> None:
    path = _mnist_file(datafiles, "train-images-idx3-ubyte")
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(DPVisionError, match=r"train-images-idx3-ubyte\.gz: truncated or corrupt"):
        load_dataset("mnist", path.parent)


def test_truncated_payload_names_the_file(datafiles: Any) -> None:
    path = _mnist_file(datafiles, "t10k-images-idx3-ubyte")
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[:-100]))
    with pytest.raises(DPVisionError, match=r"t10k-images-idx3-ubyte\.gz: truncated") as info:
        load_dataset("mnist", path.parent)
    assert "\n" not in str(info.value)


def test_trailing_bytes_are_reported(datafiles: Any) -> None:
    path = _mnist_file(datafiles, "train-labels-idx1-ubyte")
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes()) + b"\0\0"))
    with pytest.raises(DPVisionError, match=r"train-labels-idx1-ubyte\.gz: corrupt"):
        load_dataset("mnist", path.parent)


def test_bad_magic_names_the_file(datafiles: Any) -> None:
    path = _mnist_file(datafiles, "t10k-labels-idx1-ubyte")
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(struct.pack(">I", 0x00000803) + data[4:]))
    with pytest.raises(DPVisionError, match=r"t10k-labels-idx1-ubyte\.gz: bad IDX magic"):
        load_dataset("mnist", path.parent)


def test_swapped_files_fail_on_magic(datafiles: Any) -> None:
    folder = datafiles.root / "m"
    datafiles.mnist(folder)
    images = folder / "train-images-idx3-ubyte.gz"
    labels = folder / "train-labels-idx1-ubyte.gz"
    content = images.read_bytes()
    images.write_bytes(labels.read_bytes())
    labels.write_bytes(content)
    with pytest.raises(DPVisionError, match=r"train-images-idx3-ubyte\.gz: bad IDX magic"):
        load_dataset("mnist", folder)


@pytest.mark.parametrize("content", [b"", b"\x00\x00", b"\x00\x00\x08\x03\x00\x00"])
def test_too_short_headers(datafiles: Any, content: bytes) -> None:
    path = datafiles.root / "short-idx"
    path.write_bytes(content)
    with pytest.raises(DPVisionError, match="short-idx"):
        read_idx(path, IDX_IMAGES_MAGIC)


def test_image_and_label_counts_must_agree(datafiles: Any) -> None:
    folder = datafiles.root / "m"
    datafiles.mnist(folder)
    datafiles.write_idx(
        folder / "t10k-labels-idx1-ubyte.gz", np.zeros(3, np.uint8), IDX_LABELS_MAGIC
    )
    with pytest.raises(DPVisionError, match=r"holds 20 images but .*t10k-labels.* holds 3 labels"):
        load_dataset("mnist", folder)


def test_labels_beyond_ten_classes_are_rejected(datafiles: Any) -> None:
    folder = datafiles.root / "m"
    datafiles.mnist(folder)
    datafiles.write_idx(
        folder / "train-labels-idx1-ubyte.gz", np.full(30, 12, np.uint8), IDX_LABELS_MAGIC
    )
    with pytest.raises(DPVisionError, match=r"ubyte\.gz: labels outside \[0, 10\)"):
        load_dataset("mnist", folder)


def test_incomplete_folder_is_not_found(datafiles: Any) -> None:
    folder = datafiles.root / "m"
    datafiles.mnist(folder)
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DPVisionError, match=r"mnist not found in .*t10k-labels-idx1-ubyte\[\.gz\]"):
        load_dataset("mnist", folder)


def test_unreadable_file_is_reported(datafiles: Any) -> None:
    with pytest.raises(DPVisionError, match=r"missing-file: cannot read"):
        read_idx(datafiles.root / "missing-file", IDX_LABELS_MAGIC)
