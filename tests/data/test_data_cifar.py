"""CIFAR-10/100 python-version pickles."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

from dpvision.data import load_dataset
from dpvision.errors import DPVisionError


def _expected_images(data: np.ndarray) -> np.ndarray:
    """Channels-last images from CIFAR rows (1024 red, 1024 green, 1024 blue values)."""
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)


def test_cifar10_python2_pickles_from_parent_folder(datafiles: Any) -> None:
    written = datafiles.cifar10(datafiles.root)
    ds = load_dataset("cifar10", datafiles.root)
    assert ds.train_images.shape == (30, 32, 32, 3)
    assert ds.test_images.shape == (6, 32, 32, 3)
    assert ds.num_classes == 10
    assert ds.class_names is not None
    assert ds.class_names[0] == "airplane"
    train_data = np.concatenate([written[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    train_labels = [v for i in range(1, 6) for v in written[f"data_batch_{i}"][b"labels"]]
    np.testing.assert_array_equal(ds.train_images, _expected_images(train_data))
    np.testing.assert_array_equal(ds.train_labels, train_labels)
    np.testing.assert_array_equal(ds.test_images, _expected_images(written["test_batch"][b"data"]))
    assert ds.train_images.flags.c_contiguous


def test_channel_order_is_red_green_blue(datafiles: Any) -> None:
    datafiles.cifar10(datafiles.root, per_batch=1)
    folder = datafiles.root / "cifar-10-batches-py"
    data = np.concatenate([np.full(1024, 10), np.full(1024, 20), np.full(1024, 30)])
    batch = {b"data": data.astype(np.uint8)[None, :], b"labels": [3]}
    (folder / "test_batch").write_bytes(datafiles.py2_pickle(batch))
    ds = load_dataset("cifar10", folder)
    assert ds.test_images[0, 5, 7].tolist() == [10, 20, 30]


def test_cifar10_python3_pickles_from_the_folder_itself(datafiles: Any) -> None:
    datafiles.cifar10(datafiles.root, py2=False)
    ds = load_dataset("cifar10", datafiles.root / "cifar-10-batches-py")
    assert ds.num_train == 30


def test_cifar100_uses_fine_labels(datafiles: Any) -> None:
    written = datafiles.cifar100(datafiles.root / "cifar100")
    ds = load_dataset("cifar-100", datafiles.root)
    assert ds.name == "cifar100"
    assert ds.num_classes == 100
    assert ds.train_images.shape == (12, 32, 32, 3)
    np.testing.assert_array_equal(ds.train_labels, written["train"][b"fine_labels"])
    np.testing.assert_array_equal(ds.test_labels, written["test"][b"fine_labels"])


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("pwned",))


def test_pickles_with_foreign_globals_are_refused(datafiles: Any, capsys: Any) -> None:
    datafiles.cifar10(datafiles.root)
    path = datafiles.root / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(pickle.dumps({b"data": _Evil(), b"labels": []}))
    with pytest.raises(DPVisionError, match=r"data_batch_3: not a valid CIFAR pickle .*print"):
        load_dataset("cifar10", datafiles.root)
    assert "pwned" not in capsys.readouterr().out


def test_missing_label_key_names_the_file(datafiles: Any) -> None:
    datafiles.cifar100(datafiles.root)
    path = datafiles.root / "cifar-100-python" / "test"
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(DPVisionError, match=r"cifar-100-python/test: no b'fine_labels' entry"):
        load_dataset("cifar100", datafiles.root)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]}, "shape"),
        ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, "dtype float32"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "2 images but 1 labels"),
        (
            {b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]},
            r"labels must lie in \[0, 10\)",
        ),
        ([1, 2, 3], "not a CIFAR batch"),
    ],
)
def test_malformed_batches(datafiles: Any, batch: Any, message: str) -> None:
    datafiles.cifar10(datafiles.root)
    path = datafiles.root / "cifar-10-batches-py" / "data_batch_2"
    path.write_bytes(pickle.dumps(batch))
    with pytest.raises(DPVisionError, match=rf"data_batch_2: .*{message}"):
        load_dataset("cifar10", datafiles.root)


def test_garbage_and_truncated_files(datafiles: Any) -> None:
    datafiles.cifar10(datafiles.root)
    path = datafiles.root / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(DPVisionError, match=r"test_batch: not a valid CIFAR pickle"):
        load_dataset("cifar10", datafiles.root)


def test_missing_batch_is_listed(datafiles: Any) -> None:
    datafiles.cifar10(datafiles.root)
    (datafiles.root / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(DPVisionError, match=r"missing data_batch_4; unpack the complete"):
        load_dataset("cifar10", datafiles.root)
