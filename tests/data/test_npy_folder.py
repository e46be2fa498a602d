"""``npy:DIR`` datasets: four ``.npy`` files, the images memory-mapped for data larger than RAM."""

import json
from pathlib import Path

import numpy as np
import pytest

from dpvision.config import resolve
from dpvision.data import load_dataset
from dpvision.errors import DPVisionError
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.runs.train import fit


def _arrays(n_train: int = 120, n_test: int = 45) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, n_train + n_test)
    images = (rng.random((n_train + n_test, 28, 28)) * 60).astype(np.uint8)
    for c in range(3):
        images[labels == c, 4 + 7 * c : 9 + 7 * c, 4:24] += 180
    return {
        "x_train": images[:n_train],
        "y_train": labels[:n_train],
        "x_test": images[n_train:],
        "y_test": labels[n_train:],
    }


def _write_folder(folder: Path, arrays: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for key, value in arrays.items():
        np.save(folder / f"{key}.npy", value)
    return folder


def test_images_are_memory_mapped_and_match_the_npz_form(tmp_path: Path) -> None:
    arrays = _arrays()
    folder = _write_folder(tmp_path / "set", arrays)
    np.savez(tmp_path / "set.npz", **arrays)
    mapped = load_dataset(f"npy:{folder}", num_classes=3)
    loaded = load_dataset(f"npz:{tmp_path / 'set.npz'}", num_classes=3)
    assert isinstance(mapped.train_images, np.memmap)
    assert not mapped.train_images.flags.writeable
    assert mapped.train_images.shape == (120, 28, 28, 1)
    assert np.array_equal(mapped.train_images, loaded.train_images)
    assert np.array_equal(mapped.test_labels, loaded.test_labels)
    assert mapped.num_classes == loaded.num_classes == 3


def test_dpsgd_on_a_mapped_dataset_equals_the_loaded_one(tmp_path: Path) -> None:
    """Images read a batch at a time from the map give the very same run."""
    arrays = _arrays()
    folder = _write_folder(tmp_path / "set", arrays)
    np.savez(tmp_path / "set.npz", **arrays)
    sets = [
        f"learner.{k}={json.dumps(v)}"
        for k, v in {"batch_size": 30, "steps": 4, "augmult": 2, "crop_padding": 2}.items()
    ]
    # One secret for both (a run's own would be keyed by its dataset name too).
    results = [
        fit(
            resolve(
                None,
                {"dataset": name, "num_classes": 10, "method": "dp-sgd", "noise_multiplier": 1.0},
                sets,
            ),
            quiet=True,
            secret=SecretRandomness(5),
        )[0]
        for name in (f"npy:{folder}", f"npz:{tmp_path / 'set.npz'}")
    ]
    assert results[0]["test_accuracy"] == results[1]["test_accuracy"]
    assert results[0]["privacy_ledger"] == results[1]["privacy_ledger"]
    assert results[0]["history"] == results[1]["history"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("missing", "y_test.npy: no such file"),
        ("float", "memory-mapped images must be uint8"),
        ("garbage", "not a readable .npy array"),
        ("labels", "has 120 images but y_train has 7 labels"),
    ],
)
def test_bad_folders_get_one_line_errors(tmp_path: Path, change: str, message: str) -> None:
    arrays = _arrays()
    folder = _write_folder(tmp_path / "set", arrays)
    if change == "missing":
        (folder / "y_test.npy").unlink()
    elif change == "float":
        np.save(folder / "x_train.npy", arrays["x_train"] / 255.0)
    elif change == "garbage":
        (folder / "x_test.npy").write_bytes(b"not numpy")
    else:
        np.save(folder / "y_train.npy", arrays["y_train"][:7])
    with pytest.raises(DPVisionError, match=message) as error:
        load_dataset(f"npy:{folder}", num_classes=10)
    assert "\n" not in str(error.value)


def test_a_missing_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(DPVisionError, match="no such folder"):
        load_dataset(f"npy:{tmp_path / 'nowhere'}", num_classes=10)
