"""Verified downloads, served by a local HTTP server on 127.0.0.1 that the tests start."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dpvision.data import load_dataset, sources
from dpvision.data.sources import Checksum, RemoteDataset, RemoteFile
from dpvision.errors import DPVisionError

MNIST_NAMES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Keeps the test output clean."""


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """Serves ``tmp_path / "www"`` on 127.0.0.1 (ephemeral port); yields (base URL, folder)."""
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(www))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.delenv(sources.ENV_OFFLINE)
    monkeypatch.setattr(sources, "DOWNLOAD_TIMEOUT_S", 5.0)
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", www
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def _register(
    monkeypatch: pytest.MonkeyPatch, name: str, files: dict[str, bytes], **kw: Any
) -> None:
    """Replaces the registry entry of ``name`` with the SHA-256 of the given file contents."""
    entries = tuple(
        RemoteFile(
            filename,
            (f"https://invalid.example/{filename}",),
            (Checksum("sha256", hashlib.sha256(content).hexdigest(), "test"),),
            **kw,
        )
        for filename, content in files.items()
    )
    registry = dict(sources.DOWNLOADS)
    registry[name] = RemoteDataset(name, "https://invalid.example/", entries)
    monkeypatch.setattr(sources, "DOWNLOADS", registry)


def _mnist_files(datafiles: Any) -> dict[str, bytes]:
    folder = datafiles.root / "generated"
    datafiles.mnist(folder, n_train=10, n_test=5)
    return {name: (folder / name).read_bytes() for name in MNIST_NAMES}


def _cache_files(home: Path) -> list[Path]:
    return [p for p in (home / ".cache").rglob("*") if p.is_file()]


def test_download_then_load(
    server: tuple[str, Path], datafiles: Any, isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, www = server
    files = _mnist_files(datafiles)
    for name, content in files.items():
        (www / "mnist-mirror" / name).parent.mkdir(exist_ok=True)
        (www / "mnist-mirror" / name).write_bytes(content)
    _register(monkeypatch, "mnist", files)
    monkeypatch.setenv("DPVISION_DOWNLOAD_URL_MNIST", f"{base}/mnist-mirror/")
    ds = load_dataset("mnist")
    assert (ds.num_train, ds.num_test) == (10, 5)
    cache = isolated_env / ".cache" / "dpvision" / "mnist"
    assert sorted(p.name for p in cache.iterdir()) == sorted(MNIST_NAMES)
    # A second load uses the cache: the server may be gone.
    for path in www.joinpath("mnist-mirror").iterdir():
        path.unlink()
    assert load_dataset("mnist").num_train == 10


def test_checksum_mismatch_leaves_nothing(
    server: tuple[str, Path], datafiles: Any, isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, www = server
    files = _mnist_files(datafiles)
    for name, content in files.items():
        (www / name).write_bytes(content)
    (www / MNIST_NAMES[0]).write_bytes(files[MNIST_NAMES[0]][:-10])  # truncated in transit
    _register(monkeypatch, "fashion-mnist", files)
    monkeypatch.setenv("DPVISION_DOWNLOAD_URL_FASHION_MNIST", base)
    with pytest.raises(DPVisionError, match=r"checksum mismatch for train-images-idx3-ubyte\.gz"):
        load_dataset("fashion-mnist")
    assert _cache_files(isolated_env) == []


def test_checksum_mismatch_of_single_file_leaves_cache_empty(
    server: tuple[str, Path], isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, www = server
    (www / "dermamnist.npz").write_bytes(b"not the registered content")
    _register(monkeypatch, "dermamnist", {"dermamnist.npz": b"the registered content"})
    monkeypatch.setenv("DPVISION_DOWNLOAD_URL_DERMAMNIST", base)
    with pytest.raises(DPVisionError) as info:
        load_dataset("dermamnist")
    message = str(info.value)
    assert "checksum mismatch for dermamnist.npz" in message
    assert "nothing was saved" in message
    assert "\n" not in message
    assert _cache_files(isolated_env) == []


def test_http_404(
    server: tuple[str, Path], isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, _ = server
    _register(monkeypatch, "dermamnist", {"dermamnist.npz": b"whatever"})
    monkeypatch.setenv("DPVISION_DOWNLOAD_URL_DERMAMNIST", base + "/missing")
    with pytest.raises(DPVisionError, match=r"HTTP 404 .*download dermamnist\.npz manually into"):
        load_dataset("dermamnist")
    assert _cache_files(isolated_env) == []


def test_unreachable_server(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as sock:  # a port on 127.0.0.1 that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.delenv(sources.ENV_OFFLINE)
    monkeypatch.setattr(sources, "DOWNLOAD_TIMEOUT_S", 5.0)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    _register(monkeypatch, "dermamnist", {"dermamnist.npz": b"whatever"})
    monkeypatch.setenv("DPVISION_DOWNLOAD_URL_DERMAMNIST", f"http://127.0.0.1:{port}")
    with pytest.raises(DPVisionError, match=r"download from http://127\.0\.0\.1:\d+/dermamnist"):
        load_dataset("dermamnist")
    assert _cache_files(isolated_env) == []


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def test_cifar_archive_is_unpacked_and_removed(
    server: tuple[str, Path], datafiles: Any, isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, www = server
    datafiles.cifar10(datafiles.root, per_batch=2)
    folder = datafiles.root / "cifar-10-batches-py"
    archive = _tar_gz({f"cifar-10-batches-py/{p.name}": p.read_bytes() for p in folder.iterdir()})
    (www / "cifar-10-python.tar.gz").write_bytes(archive)
    _register(monkeypatch, "cifar10", {"cifar-10-python.tar.gz": archive}, unpack=True)
    monkeypatch.setenv("DPVISION_DOWNLOAD_URL_CIFAR10", base)
    ds = load_dataset("cifar10")
    assert ds.num_train == 10
    cache = isolated_env / ".cache" / "dpvision" / "cifar10"
    assert [p.name for p in cache.iterdir()] == ["cifar-10-batches-py"]


def test_unsafe_archive_is_rejected(
    server: tuple[str, Path], isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, www = server
    archive = _tar_gz({"../escape.txt": b"x"})
    (www / "cifar-100-python.tar.gz").write_bytes(archive)
    _register(monkeypatch, "cifar100", {"cifar-100-python.tar.gz": archive}, unpack=True)
    monkeypatch.setenv("DPVISION_DOWNLOAD_URL_CIFAR100", base)
    with pytest.raises(DPVisionError, match=r"unsafe archive entry '\.\./escape\.txt'"):
        load_dataset("cifar100")
    assert _cache_files(isolated_env) == []
    assert not (isolated_env / ".cache" / "dpvision" / "escape.txt").exists()


def test_dataset_without_verified_download(
    isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(sources.ENV_OFFLINE)
    registry = {k: v for k, v in sources.DOWNLOADS.items() if k != "cifar100"}
    monkeypatch.setattr(sources, "DOWNLOADS", registry)
    with pytest.raises(DPVisionError, match=r"no verified download is registered; download it"):
        load_dataset("cifar100")


def test_registry_is_complete_and_well_formed() -> None:
    assert set(sources.DOWNLOADS) == {"mnist", "fashion-mnist", "cifar10", "cifar100", "dermamnist"}
    for name, remote in sources.DOWNLOADS.items():
        assert remote.name == name
        for item in remote.files:
            assert item.urls
            assert all(url.startswith(("https://", "http://")) for url in item.urls)
            for checksum in item.checksums:
                length = {"md5": 32, "sha256": 64}[checksum.algorithm]
                assert len(checksum.hexdigest) == length
                int(checksum.hexdigest, 16)


def test_fashion_mnist_registry_accepts_the_local_copy(real_fashion_mnist: Path) -> None:
    """The local copy is re-compressed (its gzip header differs from the official files)."""
    for item in sources.DOWNLOADS["fashion-mnist"].files:
        digest = hashlib.sha256((real_fashion_mnist / item.filename).read_bytes()).hexdigest()
        assert digest in {c.hexdigest for c in item.checksums}
