"""The named dataset ``cifar10-jpeg``: the JPEG copy of CIFAR-10, as a tree or its archive."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpvision.data import cifar_jpeg, load_dataset
from dpvision.data.cifar import CIFAR10
from dpvision.data.datasets import dataset_info, same_dataset
from dpvision.errors import DPVisionError

CLASSES = CIFAR10.class_names or ()


def _jpeg(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="JPEG", quality=75)
    return out.getvalue()


def _tree(root: Path, size: int = 32) -> dict[tuple[str, int], np.ndarray]:
    """One train and one test image per class (flat colours, so JPEG keeps them)."""
    written = {}
    for split in ("train", "test"):
        for label, name in enumerate(CLASSES):
            array = np.full((size, size, 3), 20 * label + (5 if split == "test" else 0), np.uint8)
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "0000.jpg").write_bytes(_jpeg(array))
            written[(split, label)] = array
    return written


def test_the_unpacked_tree_loads_as_32x32_rgb_in_cifar10s_class_order(tmp_path: Path) -> None:
    written = _tree(tmp_path / "cifar10-jpeg")
    ds = load_dataset("cifar10-jpeg", data_dir=tmp_path)
    assert ds.name == "cifar10-jpeg"
    assert ds.num_classes == 10
    assert ds.class_names == CLASSES
    assert ds.train_images.shape == (10, 32, 32, 3)
    assert ds.test_images.shape == (10, 32, 32, 3)
    assert ds.train_labels.tolist() == list(range(10))
    assert ds.geometry is None  # the images' own size, as the pickles
    for label in range(10):
        assert np.abs(ds.test_images[label].astype(int) - written[("test", label)]).max() <= 2


def test_the_archive_is_unpacked_once_into_the_cache(tmp_path: Path, monkeypatch) -> None:
    source = tmp_path / "src"
    _tree(source / "cifar10-jpeg")
    shared = tmp_path / "shared" / "cifar10-jpeg"
    shared.mkdir(parents=True)
    with tarfile.open(shared / "cifar10-jpeg.tar.xz", "w:xz") as tar:
        tar.add(source / "cifar10-jpeg", arcname="cifar10-jpeg")
    monkeypatch.setenv("DPVISION_DATA", str(tmp_path / "shared"))
    first = load_dataset("cifar10-jpeg")
    cache = Path(os.environ["HOME"]) / ".cache" / "dpvision" / "cifar10-jpeg"
    (copy,) = cache.iterdir()  # one folder per archive, named by its digest
    assert copy.stat().st_mode & 0o777 == 0o700  # private images: the owner's alone
    unpacked = copy / "cifar10-jpeg"
    assert (unpacked / "train" / "truck" / "0000.jpg").is_file()
    stamp = (unpacked / "train").stat().st_mtime_ns
    second = load_dataset("cifar10-jpeg")
    assert (unpacked / "train").stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(first.train_images, second.train_images)


def test_an_archive_with_an_unsafe_entry_saves_nothing(tmp_path: Path) -> None:
    shared = tmp_path / "cifar10-jpeg"
    shared.mkdir()
    evil = tmp_path / "evil.txt"
    evil.write_text("x")
    with tarfile.open(shared / "cifar10-jpeg.tar.xz", "w:xz") as tar:
        tar.add(evil, arcname="../evil.txt")
    with pytest.raises(DPVisionError, match="unsafe archive entry"):
        load_dataset("cifar10-jpeg", data_dir=tmp_path)


def test_other_class_folders_are_refused_in_one_line(tmp_path: Path) -> None:
    _tree(tmp_path / "cifar10-jpeg")
    (tmp_path / "cifar10-jpeg" / "train" / "zebra").mkdir()
    with pytest.raises(DPVisionError, match="not CIFAR-10's") as caught:
        load_dataset("cifar10-jpeg", data_dir=tmp_path)
    assert "\n" not in str(caught.value)


def test_an_image_of_another_size_is_resized_not_refused(tmp_path: Path) -> None:
    # Its size is a private row's: a refusal would tell D from D plus that image.
    _tree(tmp_path / "cifar10-jpeg")
    odd = np.zeros((40, 36, 3), np.uint8)
    (tmp_path / "cifar10-jpeg" / "train" / "cat" / "0001.jpg").write_bytes(_jpeg(odd))
    ds = load_dataset("cifar10-jpeg", data_dir=tmp_path)
    assert ds.train_images.shape == (11, 32, 32, 3)


def test_missing_copy_is_one_line_naming_both_forms_and_never_a_download(tmp_path) -> None:
    with pytest.raises(DPVisionError) as caught:
        load_dataset("cifar10-jpeg", data_dir=tmp_path)
    message = str(caught.value)
    assert "cifar10-jpeg.tar.xz" in message
    assert "train/<class>" in message
    assert "\n" not in message


def test_the_copy_is_its_own_dataset_never_cifar10() -> None:
    info = dataset_info("cifar10-jpeg")
    assert info is not None
    assert info.num_classes == 10
    assert not same_dataset("cifar10-jpeg", "cifar10")
    assert "JPEG" in info.description
    assert cifar_jpeg.NAME == "cifar10-jpeg"


def test_the_copy_is_standardised_with_cifar10s_published_statistics() -> None:
    from dpvision.data.inputs import dataset_statistics

    assert dataset_statistics("cifar10-jpeg") == dataset_statistics("cifar10")


def test_dataset_normalization_without_statistics_is_refused_before_any_file(tmp_path) -> None:
    from dpvision.config import resolve

    missing = tmp_path / "nowhere"
    sets = ['learner.normalization="dataset"', "image_size=32"]
    with pytest.raises(DPVisionError, match="no published statistics for imagefolder:"):
        resolve(None, {"dataset": f"imagefolder:{missing}", "method": "dp-sgd"}, sets)
    config = resolve(None, {"dataset": "CIFAR10-JPEG", "method": "dp-sgd"}, sets[:1])
    assert config.learner["normalization"] == "dataset"


def _archive(folder: Path, source: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "cifar10-jpeg.tar.xz", "w:xz") as tar:
        tar.add(source, arcname="cifar10-jpeg")


def test_another_archive_never_reads_the_first_ones_copy(tmp_path: Path) -> None:
    # --data-dir B with another archive (or a neighbouring dataset in an audit) must train
    # on B's images, not on the copy unpacked from A.
    first, second = tmp_path / "a" / "cifar10-jpeg", tmp_path / "b" / "cifar10-jpeg"
    _tree(first)
    _tree(second)
    odd = np.full((32, 32, 3), 255, np.uint8)
    (second / "train" / "cat" / "0001.jpg").write_bytes(_jpeg(odd))
    _archive(tmp_path / "A" / "cifar10-jpeg", first)
    _archive(tmp_path / "B" / "cifar10-jpeg", second)
    assert load_dataset("cifar10-jpeg", data_dir=tmp_path / "A").train_images.shape[0] == 10
    assert load_dataset("cifar10-jpeg", data_dir=tmp_path / "B").train_images.shape[0] == 11


def test_an_archive_with_two_identical_images_stored_as_a_hard_link_loads(tmp_path) -> None:
    # tar stores a file that shares an inode with another as a hard link: refusing it would
    # refuse a dataset because two of its images are byte-identical.
    source = tmp_path / "src" / "cifar10-jpeg"
    _tree(source)
    os.link(source / "train" / "cat" / "0000.jpg", source / "train" / "cat" / "0001.jpg")
    _archive(tmp_path / "shared" / "cifar10-jpeg", source)
    ds = load_dataset("cifar10-jpeg", data_dir=tmp_path / "shared")
    assert ds.train_images.shape[0] == 11
    np.testing.assert_array_equal(ds.train_images[3], ds.train_images[4])


def test_other_class_folders_are_refused_before_any_image_is_decoded(tmp_path, monkeypatch):
    from dpvision.data import imagefolder

    _tree(tmp_path / "cifar10-jpeg")
    (tmp_path / "cifar10-jpeg" / "train" / "zebra").mkdir()
    monkeypatch.setattr(imagefolder, "load_image_folder", lambda *a, **k: pytest.fail("read"))
    with pytest.raises(DPVisionError, match="not CIFAR-10's"):
        load_dataset("cifar10-jpeg", data_dir=tmp_path)
