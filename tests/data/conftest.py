"""Fixtures for the dpvision.data tests: an isolated environment and real-format file writers.

Every test runs with ``HOME`` in a temporary folder, ``DPVISION_DATA`` unset, no system dataset
folders, and downloads disabled (``DPVISION_OFFLINE=1``), so no test can read a real user cache
or reach the network; the download tests re-enable downloads towards a local server only.
"""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpvision.data import sources

IDX_IMAGES = 0x00000803
IDX_LABELS = 0x00000801


# The full Fashion-MNIST: $DPVISION_DATA (set by .ci/run), ../shared/data beside the clone
# (this workplace), or where Debian's dataset-fashion-mnist installs it. Read at import,
# before `isolated_env` clears DPVISION_DATA for each test.
_FASHION_MNIST_PLACES = [
    *(
        [Path(os.environ["DPVISION_DATA"]) / "fashion-mnist"]
        if os.environ.get("DPVISION_DATA")
        else []
    ),
    Path(__file__).resolve().parents[3] / "shared" / "data" / "fashion-mnist",
    *(base / "fashion-mnist" for base in sources.SYSTEM_DATA_DIRS),
]
_REAL_FASHION_MNIST = next((p for p in _FASHION_MNIST_PLACES if p.is_dir()), None)


@pytest.fixture
def real_fashion_mnist() -> Path:
    """The folder of the real Fashion-MNIST IDX files; skips where it is absent."""
    if _REAL_FASHION_MNIST is None:
        places = ", ".join(str(p) for p in _FASHION_MNIST_PLACES)
        pytest.skip(f"no local Fashion-MNIST copy (looked in {places}; set DPVISION_DATA)")
    return _REAL_FASHION_MNIST


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Points HOME at an empty folder and turns off every source outside the test's tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(sources.ENV_DATA, raising=False)
    monkeypatch.setenv(sources.ENV_OFFLINE, "1")
    for name in sources.DOWNLOADS:
        monkeypatch.delenv(sources.mirror_env_var(name), raising=False)
    monkeypatch.setattr(sources, "SYSTEM_DATA_DIRS", ())
    return home


def idx_bytes(array: np.ndarray, magic: int) -> bytes:
    """Serialises a uint8 array in IDX format with the given magic number."""
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def py2_pickle(batch: dict[bytes, Any]) -> bytes:
    """A protocol-2 pickle as Python 2 + NumPy wrote the CIFAR batches.

    Keys and byte strings are Python 2 ``str`` (``SHORT_BINSTRING``/``BINSTRING`` opcodes), which
    Python 3 only reads back as ``bytes`` with ``encoding='bytes'``; arrays refer to
    ``numpy.core.multiarray._reconstruct`` as old NumPy did.
    """

    def string(value: bytes) -> bytes:
        if len(value) < 256:
            return b"U" + bytes([len(value)]) + value
        return b"T" + struct.pack("<i", len(value)) + value

    def integer(value: int) -> bytes:
        return b"K" + bytes([value]) if 0 <= value < 256 else b"J" + struct.pack("<i", value)

    def array(value: np.ndarray) -> bytes:
        assert value.dtype == np.uint8
        out = b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
        out += integer(0) + b"\x85" + string(b"b") + b"\x87R"
        dtype = b"cnumpy\ndtype\n" + string(b"u1") + integer(0) + integer(1) + b"\x87R"
        dtype += b"(" + integer(3) + string(b"|") + b"NNN" + integer(-1) + integer(-1)
        dtype += integer(0) + b"tb"
        out += b"(" + integer(1) + b"(" + b"".join(integer(d) for d in value.shape) + b"t"
        out += dtype + b"\x89" + string(value.tobytes()) + b"tb"
        return out

    body = b"\x80\x02}("
    for key, value in batch.items():
        body += string(key)
        if isinstance(value, np.ndarray):
            body += array(value)
        elif isinstance(value, bytes):
            body += string(value)
        else:
            items = (string(v) if isinstance(v, bytes) else integer(int(v)) for v in value)
            body += b"](" + b"".join(items) + b"e"
    return body + b"u."


class DataFiles:
    """Writes small datasets in the real on-disk formats."""

    idx_bytes = staticmethod(idx_bytes)
    py2_pickle = staticmethod(py2_pickle)

    def __init__(self, root: Path) -> None:
        self.root = root
        self.rng = np.random.default_rng(1234)

    def images(self, n: int, shape: tuple[int, ...]) -> np.ndarray:
        """Random uint8 images."""
        return self.rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)

    def labels(self, n: int, num_classes: int) -> np.ndarray:
        """Labels cycling through the classes (every class present when n >= num_classes)."""
        return (np.arange(n) % num_classes).astype(np.uint8)

    def write_idx(self, path: Path, array: np.ndarray, magic: int, gz: bool = True) -> Path:
        """Writes one IDX file (gzip-compressed when ``gz``)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        data = idx_bytes(array, magic)
        path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
        return path

    def mnist(
        self, folder: Path, n_train: int = 30, n_test: int = 20, gz: bool = True
    ) -> dict[str, np.ndarray]:
        """Writes the four MNIST IDX files into ``folder``; returns the arrays written."""
        arrays = {
            "train_images": self.images(n_train, (28, 28)),
            "train_labels": self.labels(n_train, 10),
            "test_images": self.images(n_test, (28, 28)),
            "test_labels": self.labels(n_test, 10)[::-1].copy(),
        }
        for key, stem in (
            ("train_images", "train-images-idx3-ubyte"),
            ("train_labels", "train-labels-idx1-ubyte"),
            ("test_images", "t10k-images-idx3-ubyte"),
            ("test_labels", "t10k-labels-idx1-ubyte"),
        ):
            magic = IDX_IMAGES if key.endswith("images") else IDX_LABELS
            name = f"{stem}.gz" if gz else stem
            self.write_idx(folder / name, arrays[key], magic, gz=gz)
        return arrays

    def cifar10(self, parent: Path, per_batch: int = 6, py2: bool = True) -> dict[str, Any]:
        """Writes ``parent/cifar-10-batches-py`` with 5 train batches and a test batch."""
        folder = parent / "cifar-10-batches-py"
        folder.mkdir(parents=True, exist_ok=True)
        written: dict[str, Any] = {}
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            batch = {
                b"batch_label": name.encode(),
                b"labels": [int(v) for v in self.rng.integers(0, 10, per_batch)],
                b"data": self.images(per_batch, (3072,)),
                b"filenames": [b"x.png"] * per_batch,
            }
            raw = py2_pickle(batch) if py2 else pickle.dumps(batch)
            (folder / name).write_bytes(raw)
            written[name] = batch
        return written

    def cifar100(self, parent: Path, n_train: int = 12, n_test: int = 8) -> dict[str, Any]:
        """Writes ``parent/cifar-100-python`` with ``train`` and ``test`` (Python 3 pickles)."""
        folder = parent / "cifar-100-python"
        folder.mkdir(parents=True, exist_ok=True)
        written: dict[str, Any] = {}
        for name, n in (("train", n_train), ("test", n_test)):
            batch = {
                b"fine_labels": [int(v) for v in self.rng.integers(0, 100, n)],
                b"coarse_labels": [int(v) for v in self.rng.integers(0, 20, n)],
                b"data": self.images(n, (3072,)),
            }
            (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
            written[name] = batch
        return written

    def medmnist(self, path: Path, n: tuple[int, int, int] = (14, 7, 7), classes: int = 7) -> Path:
        """Writes a MedMNIST-format archive (train/val/test, labels (N, 1))."""
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {}
        for split, count in zip(("train", "val", "test"), n, strict=True):
            arrays[f"{split}_images"] = self.images(count, (28, 28, 3))
            arrays[f"{split}_labels"] = self.labels(count, classes)[:, None]
        np.savez_compressed(path, **arrays)
        return path


@pytest.fixture
def datafiles(tmp_path: Path) -> DataFiles:
    """A :class:`DataFiles` writing under ``tmp_path / "files"``."""
    root = tmp_path / "files"
    root.mkdir()
    return DataFiles(root)
