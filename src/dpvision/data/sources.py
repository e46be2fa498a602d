"""Where named datasets are looked for on disk, and their verified download.

Lookup order for a named dataset ``NAME`` (``mnist``, ``fashion-mnist``, ``cifar10``,
``cifar100``, ``dermamnist``):

1. the explicit ``data_dir`` (``--data-dir``): the folder holding the files, or a parent folder
   with ``NAME/`` in it. When given, it is the only place looked at and nothing is downloaded;
2. ``$DPVISION_DATA/NAME``;
3. ``~/.cache/dpvision/NAME`` (the download cache);
4. ``/usr/share/datasets/NAME`` (where e.g. Debian's ``dataset-fashion-mnist`` puts its files);
5. a download into ``~/.cache/dpvision/NAME``, unless ``DPVISION_OFFLINE`` is set to a
   non-empty value other than ``0``.

Every downloaded file is checked against the checksums in :data:`DOWNLOADS` before it is kept.
It is written to a temporary file in the cache folder and renamed into place (``os.replace``)
only once verified, so an interrupted or corrupt download leaves nothing behind. Archives
(CIFAR) are unpacked into a temporary folder that is then renamed into place.

The base URL of a dataset can be replaced by a mirror with the environment variable
``DPVISION_DOWNLOAD_URL_<NAME>`` (upper case, ``-`` as ``_``, e.g.
``DPVISION_DOWNLOAD_URL_FASHION_MNIST=http://127.0.0.1:8000/fmnist``); each file is then fetched
from ``<base>/<filename>`` and must still match the registered checksums.

The checksums are the MD5 digests published for the official files (by the dataset authors and
in torchvision's and MedMNIST's download code). MD5 is used only because it is what was
published; it detects corruption and mirror mix-ups, and no checksum was made up here.

Only public data is downloaded. The files are private training data once used; this module
reads nothing from them and releases nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import TypeVar

from dpvision.data.remote import DOWNLOADS, Checksum, RemoteDataset, RemoteFile
from dpvision.errors import DPVisionError
from dpvision.version import __version__

__all__ = [
    "DOWNLOADS",
    "ENV_DATA",
    "ENV_MIRROR_PREFIX",
    "ENV_OFFLINE",
    "SYSTEM_DATA_DIRS",
    "Checksum",
    "RemoteDataset",
    "RemoteFile",
    "cache_dir",
    "default_search_dirs",
    "download_dataset",
    "download_file",
    "downloads_allowed",
    "locate",
    "mirror_env_var",
    "unpack_archive",
]

logger = logging.getLogger(__name__)

ENV_DATA = "DPVISION_DATA"
"""Environment variable naming a folder with one sub-folder per dataset."""
ENV_OFFLINE = "DPVISION_OFFLINE"
"""Environment variable that, when set (not ``0``), forbids downloads."""
ENV_MIRROR_PREFIX = "DPVISION_DOWNLOAD_URL_"
"""Prefix of the per-dataset environment variables that replace the download base URL."""
SYSTEM_DATA_DIRS: tuple[Path, ...] = (Path("/usr/share/datasets"),)
"""System-wide folders with one sub-folder per dataset, searched after the user cache."""
DOWNLOAD_TIMEOUT_S = 60.0
"""Seconds a download may wait for the server on connect or on any one read."""
MAX_DOWNLOAD_BYTES = 1 << 30
"""Largest file a download accepts (the biggest registered file is about 170 MB)."""
_CHUNK = 1 << 20

T = TypeVar("T")


"""Download registry: official URLs and published checksums of each named dataset."""


def mirror_env_var(name: str) -> str:
    """The environment variable that replaces the base URL of dataset ``name``."""
    return ENV_MIRROR_PREFIX + name.upper().replace("-", "_")


def cache_dir(name: str) -> Path:
    """The download cache folder of dataset ``name``: ``~/.cache/dpvision/<name>``."""
    return Path.home() / ".cache" / "dpvision" / name


def downloads_allowed() -> bool:
    """False when ``$DPVISION_OFFLINE`` is set to something other than empty or ``0``."""
    return os.environ.get(ENV_OFFLINE, "").strip() in ("", "0")


def default_search_dirs(name: str) -> list[Path]:
    """Folders searched for dataset ``name`` when no ``data_dir`` is given, in order."""
    dirs = []
    env = os.environ.get(ENV_DATA, "").strip()
    if env:
        dirs.append(Path(env).expanduser() / name)
    dirs.append(cache_dir(name))
    dirs.extend(base / name for base in SYSTEM_DATA_DIRS)
    return dirs


def locate(
    name: str,
    data_dir: str | Path | None,
    find: Callable[[Path], T | None],
    expected: str,
    *,
    download: bool = True,
) -> T:
    """Finds dataset ``name`` following the lookup order of the module docstring.

    Args:
        name: Dataset name, a key of :data:`DOWNLOADS`.
        data_dir: Explicit folder (the files' folder or its parent), or ``None``.
        find: Given a candidate folder, returns what the loader needs (e.g. the folder that
            holds the files) or ``None`` when the dataset is not there.
        expected: Describes the expected files, for error messages.
        download: Whether a download may be attempted (also subject to ``DPVISION_OFFLINE``).

    Returns:
        The first non-``None`` result of ``find``.

    Raises:
        DPVisionError: If the dataset is not found and cannot be downloaded.
    """
    if data_dir is not None:
        root = Path(data_dir).expanduser()
        for candidate in (root, root / name):
            found = find(candidate)
            if found is not None:
                return found
        raise DPVisionError(
            f"{name} not found in {root} (nor in {root / name}): expected {expected}; "
            "point --data-dir at the folder that holds these files"
        )
    searched = default_search_dirs(name)
    for candidate in searched:
        found = find(candidate)
        if found is not None:
            return found
    places = ", ".join(str(p) for p in searched)
    fix = f"put the files in one of them, pass --data-dir DIR, or set {ENV_DATA}=DIR (DIR/{name}/)"
    if not download or not downloads_allowed():
        why = "downloads are disabled" + (f" ({ENV_OFFLINE} is set)" if download else "")
        raise DPVisionError(
            f"{name} not found (searched {places}; {why}): expected {expected}; {fix}"
        )
    target = cache_dir(name)
    download_dataset(name, target)
    found = find(target)
    if found is None:
        raise DPVisionError(
            f"{name}: downloaded into {target} but the expected files ({expected}) are not "
            f"there; delete {target} and retry, or {fix}"
        )
    return found


def download_dataset(name: str, target: Path) -> None:
    """Downloads, verifies (and unpacks) every file of dataset ``name`` into ``target``.

    Files already present in ``target`` are kept. Each file is written atomically.

    Args:
        name: A key of :data:`DOWNLOADS`.
        target: Destination folder, created if needed.

    Raises:
        DPVisionError: If the dataset has no verified download or a file cannot be fetched or
            fails its checksum.
    """
    remote = DOWNLOADS.get(name)
    if remote is None or not remote.files:
        raise DPVisionError(
            f"{name}: no verified download is registered; download it manually into "
            f"{target} (or set {ENV_DATA})"
        )
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DPVisionError(
            f"{target}: cannot create the download folder ({exc.strerror or exc}); "
            f"set {ENV_DATA} or pass --data-dir"
        ) from exc
    mirror = os.environ.get(mirror_env_var(name), "").strip()
    for item in remote.files:
        if not item.unpack and (target / item.filename).is_file():
            continue
        urls = (mirror.rstrip("/") + "/" + item.filename,) if mirror else item.urls
        download_file(name, item, urls, target)


def download_file(name: str, item: RemoteFile, urls: tuple[str, ...], target: Path) -> Path:
    """Fetches one file from the first URL that delivers it with a matching checksum.

    Args:
        name: Dataset name, for messages.
        item: The registry entry (file name, checksums, whether to unpack).
        urls: URLs to try in order.
        target: Destination folder (exists).

    Returns:
        The path of the saved file, or ``target`` for an unpacked archive.

    Raises:
        DPVisionError: If no URL delivers a file with a matching checksum; the message
            describes the last failure. Nothing is left in ``target`` in that case.
    """
    error = ""
    for url in urls:
        with _temporary_file(target, item.filename) as tmp:
            try:
                digests = _fetch(url, tmp)
            except DPVisionError as exc:
                error = str(exc)
                logger.warning("%s", error)
                continue
            if not any(digests.get(c.algorithm) == c.hexdigest.lower() for c in item.checksums):
                want = ", ".join(f"{c.algorithm} {c.hexdigest}" for c in item.checksums)
                got = ", ".join(f"{c.algorithm} {digests[c.algorithm]}" for c in item.checksums)
                error = (
                    f"checksum mismatch for {item.filename} from {url}: got {got}, expected "
                    f"{want}; the download is corrupt or the file changed upstream, nothing was "
                    "saved"
                )
                logger.warning("%s", error)
                continue
            if item.unpack:
                unpack_archive(tmp, target, item.filename)
                return target
            destination = target / item.filename
            os.replace(tmp, destination)
            logger.info("downloaded %s from %s", destination, url)
            return destination
    raise DPVisionError(
        f"{name}: {error}; retry, or download {item.filename} manually into {target} "
        f"(or set {ENV_DATA}, or {mirror_env_var(name)} to a mirror)"
    )


@contextlib.contextmanager
def _temporary_file(folder: Path, filename: str) -> Iterator[Path]:
    """A fresh temporary file in ``folder``, removed on exit unless it was renamed away."""
    fd, name = tempfile.mkstemp(prefix=f".{filename}.", suffix=".part", dir=folder)
    os.close(fd)
    path = Path(name)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _fetch(url: str, destination: Path) -> dict[str, str]:
    """Streams ``url`` into ``destination``; returns its MD5 and SHA-256 hex digests."""
    request = urllib.request.Request(url, headers={"User-Agent": f"dpvision/{__version__}"})
    md5 = hashlib.md5(usedforsecurity=False)
    sha256 = hashlib.sha256()
    size = 0
    try:
        with (
            urllib.request.urlopen(request, timeout=DOWNLOAD_TIMEOUT_S) as response,
            destination.open("wb") as out,
        ):
            while chunk := response.read(_CHUNK):
                size += len(chunk)
                if size > MAX_DOWNLOAD_BYTES:
                    raise DPVisionError(
                        f"download from {url} exceeds {MAX_DOWNLOAD_BYTES} bytes; wrong URL?"
                    )
                md5.update(chunk)
                sha256.update(chunk)
                out.write(chunk)
    except urllib.error.HTTPError as exc:
        raise DPVisionError(f"download from {url} failed: HTTP {exc.code} {exc.reason}") from exc
    except urllib.error.URLError as exc:
        raise DPVisionError(f"download from {url} failed: {exc.reason}") from exc
    except (OSError, ValueError) as exc:  # timeouts, resets, malformed URLs, full disk
        raise DPVisionError(f"download from {url} failed: {exc}") from exc
    return {"md5": md5.hexdigest(), "sha256": sha256.hexdigest()}


def unpack_archive(archive: Path, target: Path, filename: str) -> None:
    """Unpacks a ``.tar.gz`` or ``.tar.xz`` into ``target``, one top-level entry at a time,
    atomically; an entry with an absolute path, ``..`` or other than a file or folder is
    refused and nothing is saved.

    The archive is extracted into a temporary folder inside ``target``; each top-level entry is
    then renamed into place (an older incomplete copy is moved aside and deleted).
    """
    staging = Path(tempfile.mkdtemp(prefix=f".{filename}.", suffix=".unpack", dir=target))
    try:
        try:
            with tarfile.open(archive, "r:*") as tar:
                members = tar.getmembers()
                for member in members:
                    parts = PurePosixPath(member.name).parts
                    unsafe = member.name.startswith("/") or ".." in parts
                    # A hard link (tar's way of storing two identical files) is kept: the
                    # data filter refuses one that points outside the target.
                    link = member.islnk() and hasattr(tarfile, "data_filter")
                    if unsafe or not (member.isfile() or member.isdir() or link):
                        raise DPVisionError(
                            f"{filename}: unsafe archive entry {member.name!r}; nothing was saved"
                        )
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(staging, members=members, filter="data")
                else:  # pragma: no cover - Python < 3.11.4; entries were checked above
                    tar.extractall(staging, members=members)
        except (OSError, EOFError, tarfile.TarError) as exc:
            raise DPVisionError(
                f"{filename}: cannot unpack the archive ({exc}); nothing was saved"
            ) from exc
        for entry in sorted(staging.iterdir()):
            destination = target / entry.name
            if destination.exists():
                trash = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".old", dir=target))
                os.replace(destination, trash / entry.name)
                os.replace(entry, destination)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(entry, destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
