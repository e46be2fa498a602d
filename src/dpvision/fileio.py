"""Files dpvision writes and reads: atomically written, read without running code.

Every result, checkpoint and encoder is written through :func:`atomic_open`: a temporary
file beside the target, flushed and fsynced, then renamed over it, so a file is either the
old one or the whole new one, never half-written.

A checkpoint or encoder may come from someone else or sit in a shared folder. ``torch.load``
without ``weights_only`` unpickles arbitrary objects, so opening such a file would run
whatever code it names. Every torch file dpvision reads goes through :func:`load_torch`:
only tensors, the plain containers (dict, list, tuple), numbers, strings and None are
accepted, and anything else (a pickled function, class or ``os.system`` call) is an error.
"""

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from dpvision.errors import DPVisionError


def load_torch(path: str | Path) -> Any:
    """The object saved at ``path`` by ``torch.save``, read with ``weights_only=True``.

    Raises:
      Exception: whatever ``torch.load`` raises for a file that is missing, damaged, or that
        asks to run code (``pickle.UnpicklingError``); callers turn it into a one-line error.
    """
    return torch.load(path, map_location="cpu", weights_only=True)


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", *, private: bool = False) -> Iterator[IO[Any]]:
    """Opens a temporary file beside ``path`` that replaces it only when the block succeeds.

    The data are flushed and fsynced before the rename, so ``path`` is either the old file
    or the whole new one, never half-written; on any error the temporary file is removed.
    ``private``: the file stays readable by its owner only (mode 0600), as a checkpoint
    holding the run's secret randomness must.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise DPVisionError(f"cannot write {path}: folder {folder} does not exist")
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    if not private:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
    try:
        with os.fdopen(handle, mode) as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(folder, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> None:
    """Writes JSON to ``path`` through a temporary file and a rename: never half-written."""
    with atomic_open(path) as out:
        json.dump(data, out, indent=2, default=_json_default)
        out.write("\n")


def differing_keys(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The dotted keys (``learner.epochs``) whose values differ between two nested dicts,
    sorted; what a refused checkpoint or a stale result names."""
    mine, other = _flatten(ours), _flatten(theirs)
    return sorted(
        k for k in set(mine) | set(other) if mine.get(k, _MISSING) != other.get(k, _MISSING)
    )


_MISSING = object()


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of the bytes of the file at ``path`` (hexadecimal), read in 1 MiB chunks:
    what a cache key or a result records of an encoder or weights file.

    Raises:
      OSError: the file is missing or cannot be read; callers turn it into a one-line
        error that names the file's role.
    """
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def settings_fingerprint(settings: dict[str, Any]) -> str:
    """A short hash of a run's settings (JSON with sorted keys)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def save_session(path: Path, kind: str, settings: dict[str, Any], state: dict[str, Any]) -> None:
    """Writes a resumable run's ``state`` atomically, tagged with its ``kind`` (a format
    name) and the fingerprint of its ``settings``."""
    payload = {
        "format": kind,
        "fingerprint": settings_fingerprint(settings),
        "options": settings,
        **state,
    }
    with atomic_open(path, "wb") as out:
        torch.save(payload, out)


def load_session(path: Path, kind: str, settings: dict[str, Any], what: str) -> dict[str, Any]:
    """The state :func:`save_session` wrote, read without running code; one-line errors
    for an unreadable file, another kind of file, or other settings (the file is left
    untouched in every case).

    Args:
      path: the checkpoint.
      kind: the format name it must carry.
      settings: this run's settings; the checkpoint's must be the same.
      what: how the messages name the run (``"Phase I"``, ``"pre-training"``).
    """
    try:
        payload = load_torch(path)
    except Exception as error:
        raise DPVisionError(
            f"cannot read checkpoint {path} ({type(error).__name__}); it was left untouched"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != kind:
        raise DPVisionError(f"{path} is not a dpvision {what} checkpoint; it was left untouched")
    if payload["fingerprint"] != settings_fingerprint(settings):
        theirs = payload.get("options")
        differ = differing_keys(settings, theirs) if isinstance(theirs, dict) else []
        raise DPVisionError(
            f"checkpoint {path} was written with other {what} options (differs in: "
            f"{', '.join(differ) or 'unknown'}); resume with the same options or give "
            "another --checkpoint path (the file is left untouched)"
        )
    return payload
