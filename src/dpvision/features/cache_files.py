"""The feature cache's entry files: read whole and checked, written atomically (a temporary
file in the same folder, flushed, ``fsync``-ed, renamed), stale temporaries removed, and
the one-line reasons its warnings give.

Privacy:
  The files hold features of private data (not a release; created mode 0600 like the
  cache's other files). A warning names the cache folder and the kind of failure only,
  never an entry's name, whose digest is a fingerprint of the private images.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

# The cache's one logger (its warnings are the cache's, wherever they are raised).
logger = logging.getLogger("dpvision.features.cache")

SPLITS = ("train", "test")
STALE_SECONDS = 3600.0
"""Age after which an orphaned temporary file is deleted by the next write."""


class CacheWriteError(Exception):
    """A cache file could not be created, reserved, synced or renamed (not an extraction
    error: those propagate unchanged)."""


class CorruptEntryError(Exception):
    """An entry that cannot be used; its message is one of a few fixed texts."""


def read_entry(folder: Path, stem: str, digest: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Loads a complete, consistent entry, or returns ``None`` (warning if it is corrupt).

    Privacy: the warning names the cache folder and the kind of failure only, never the
    entry (its name holds a digest of the private images), a file or a shape.
    """
    meta_path = folder / f"{stem}.json"
    if not meta_path.is_file():
        return None
    try:
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except ValueError:
            raise CorruptEntryError("its JSON is garbled") from None
        if not isinstance(meta, dict) or meta.get("digest") != digest:
            raise CorruptEntryError("its JSON describes another entry")
        arrays = []
        for split in SPLITS:
            try:
                expected = tuple(int(size) for size in meta[split]["shape"])
            except (KeyError, TypeError, ValueError):
                raise CorruptEntryError("its JSON lacks the arrays' shapes") from None
            try:
                array = np.load(folder / f"{stem}.{split}.npy", mmap_mode="r", allow_pickle=False)
            except (ValueError, EOFError):
                raise CorruptEntryError(f"its {split} array is truncated or garbled") from None
            if array.shape != expected or array.dtype != np.float32:
                raise CorruptEntryError(f"its {split} array does not match its JSON")
            arrays.append(array)
    except (CorruptEntryError, OSError) as error:
        logger.warning(
            "a feature cache entry in %s is corrupt (%s); extracting the features again",
            folder,
            reason(error),
        )
        return None
    return arrays[0], arrays[1]


def write_entry(
    folder: Path,
    stem: str,
    key: dict[str, Any],
    digest: str,
    shapes: dict[str, tuple[int, ...]],
    extract: Callable[[str, np.ndarray], None],
) -> tuple[np.ndarray, np.ndarray]:
    """Extracts both splits into temporary files, then renames them into place, JSON last.

    Raises:
        CacheWriteError: If the file system refuses a cache file; errors of the extraction
            itself propagate unchanged.
    """
    # Without its JSON an entry is incomplete: nothing reads the arrays while they change.
    try:
        (folder / f"{stem}.json").unlink(missing_ok=True)
    except OSError as error:
        raise CacheWriteError(str(folder / f"{stem}.json")) from error
    started = time.perf_counter()
    for split in SPLITS:
        with atomic_file(folder, folder / f"{stem}.{split}.npy") as temporary:
            out = create_memmap(temporary, shapes[split])
            extract(split, out)
            out.flush()
            del out
    meta = {
        "digest": digest,
        "key": key,
        "extract_seconds": round(time.perf_counter() - started, 3),
        **{split: {"shape": list(shapes[split]), "dtype": "float32"} for split in SPLITS},
    }
    meta_path = folder / f"{stem}.json"
    with atomic_file(folder, meta_path) as temporary:
        temporary.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    fsync_folder(folder)
    entry = read_entry(folder, stem, digest)
    if entry is None:  # the files were just written: only a failing disk gets here
        raise CacheWriteError(folder / stem) from CorruptEntryError("it could not be read back")
    return entry


@contextlib.contextmanager
def atomic_file(folder: Path, target: Path) -> Iterator[Path]:
    """Yields a temporary path in ``folder``; on success fsyncs it and renames it to ``target``.

    On any exception (including ``KeyboardInterrupt``) the temporary file is deleted and
    ``target`` is left as it was.

    Raises:
        CacheWriteError: If the file system refuses the temporary file, the sync or the rename.
    """
    try:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError as error:
        raise CacheWriteError(str(target)) from error
    temporary = Path(name)
    try:
        yield temporary
        try:
            with open(temporary, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        except OSError as error:
            raise CacheWriteError(str(target)) from error
    finally:
        temporary.unlink(missing_ok=True)


def create_memmap(path: Path, shape: tuple[int, ...]) -> np.memmap[Any, np.dtype[np.float32]]:
    """Creates a ``float32`` ``.npy`` file of ``shape`` at ``path``, memory-mapped for writing.

    Its disk blocks are allocated up front, so a full disk is an error here rather than a
    ``SIGBUS`` while the map is being filled.

    Raises:
        CacheWriteError: If the file cannot be created or its space reserved.
    """
    try:
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
        if hasattr(os, "posix_fallocate"):
            with open(path, "rb+") as handle:
                try:
                    os.posix_fallocate(handle.fileno(), 0, path.stat().st_size)
                except OSError as error:
                    if error.errno not in _FALLOCATE_UNSUPPORTED:
                        raise
    except OSError as error:
        raise CacheWriteError(str(path)) from error
    return out


_FALLOCATE_UNSUPPORTED = frozenset(
    getattr(errno, name) for name in ("EOPNOTSUPP", "ENOTSUP", "EINVAL") if hasattr(errno, name)
)
"""errno values meaning the file system cannot preallocate (then the write goes ahead)."""


def remove_stale_temporaries(folder: Path, stem: str) -> None:
    """Deletes this entry's temporary files left more than an hour ago by a killed writer."""
    deadline = time.time() - STALE_SECONDS
    for path in folder.glob(f".{stem}.*.tmp"):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime < deadline:
                path.unlink()


def fsync_folder(folder: Path) -> None:
    """Makes the renames durable (best effort: not every platform can open a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def reason(error: BaseException) -> str:
    """What went wrong, on one line, without a file name: an ``OSError``'s ``strerror``
    (its ``str`` names the file, whose name holds a digest of the private images), or the
    fixed text of this module's own errors.

    >>> reason(OSError(28, "No space left on device", "/cache/x-pixels-0123abcd.json"))
    'No space left on device'
    """
    if isinstance(error, OSError):
        return error.strerror or type(error).__name__
    if isinstance(error, CorruptEntryError):
        return str(error)
    return "a cache file could not be written"
