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
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Opens a temporary file beside ``path`` that replaces it only when the block succeeds.

    The data are flushed and fsynced before the rename, so ``path`` is either the old file
    or the whole new one, never half-written; on any error the temporary file is removed.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise DPVisionError(f"cannot write {path}: folder {folder} does not exist")
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
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
