"""An on-disk cache of extracted features, reused across runs and safe against interruption.

An entry holds the train and test features of one dataset under one
:class:`~dpvision.features.FeatureSpec`, in three files of the cache folder::

    <dataset>-<extractor>-<digest>.train.npy    float32 features, memory-mapped when read
    <dataset>-<extractor>-<digest>.test.npy
    <dataset>-<extractor>-<digest>.json         the key and the array shapes (written last)

The digest is the SHA-256 of the key: the dataset's name, a fingerprint of its images (the
SHA-256 of their shapes and bytes), every field of the spec, :data:`FEATURE_VERSION`, for
ScatterNet the kymatio version and, for ``encoder`` features, the SHA-256 of the encoder
file's bytes (a re-trained encoder is a new entry). Any change to one of them is a different
entry.

Every file is written to a temporary file in the same folder, flushed, ``fsync``-ed and
renamed into place with ``os.replace``; the JSON, which marks the entry complete, is renamed
last. An interrupted write therefore leaves at most a hidden ``.tmp`` file, which is never
read (and is deleted by a later write once it is an hour old). An entry that fails to load
(truncated or garbled file, shapes that disagree with the JSON) is logged as one warning and
extracted again.

The entry names hold a digest of a fingerprint of every image of the dataset: an adversary
who knows all but one example can compute it for each candidate dataset and match. A run's
log is published, so its messages name the cache *folder* and the kind of failure, never an
entry's name, a file name in the folder or the shapes it holds; ``dpvision cache list``, a
local command on the (private) cache, shows the names.

The folder is ``$DPVISION_CACHE`` when that is set, else ``~/.cache/dpvision/features``.
Files are created readable by their owner only (mode 0600): they hold features of private
data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dpvision.data.core import ImageDataset
from dpvision.data.datasets import PATH_PREFIXES, same_dataset
from dpvision.features import extractors
from dpvision.features.backbone import encoder_digest, feature_source
from dpvision.features.extractors import FEATURE_VERSION, feature_shape
from dpvision.features.spec import ENCODER_ONLY, NETWORK_FEATURES, FeatureSpec

__all__ = [
    "ENV_CACHE",
    "CacheEntry",
    "cache_entries",
    "cache_key",
    "dataset_fingerprint",
    "default_cache_dir",
    "load_or_extract",
]

logger = logging.getLogger(__name__)

ENV_CACHE = "DPVISION_CACHE"
"""Environment variable naming the feature cache folder."""

_SPLITS = ("train", "test")
_STALE_SECONDS = 3600.0
"""Age after which an orphaned temporary file is deleted by the next write."""


def default_cache_dir() -> Path:
    """The feature cache folder: ``$DPVISION_CACHE``, else ``~/.cache/dpvision/features``."""
    configured = os.environ.get(ENV_CACHE, "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "dpvision" / "features"


def dataset_fingerprint(dataset: ImageDataset) -> str:
    """SHA-256 of the shapes and bytes of the train and test images (labels do not matter).

    Hashing every byte costs well under 0.1 s per 100 MB, far less than extraction.

    Args:
        dataset: The dataset.

    Returns:
        A hex digest.

    Privacy:
        The digest is only written to the local cache, next to the features themselves; it is
        not a release. Like the cached features, treat it as private.
    """
    hasher = hashlib.sha256()
    for split in _SPLITS:
        images: np.ndarray = getattr(dataset, f"{split}_images")
        hasher.update(f"{split}:{images.dtype.str}:{images.shape};".encode())
        hasher.update(np.ascontiguousarray(images).data)
    return hasher.hexdigest()


def cache_key(dataset: ImageDataset, spec: FeatureSpec) -> dict[str, Any]:
    """Everything the cached features depend on, as a JSON-compatible dict.

    Args:
        dataset: The dataset.
        spec: What is extracted.

    Returns:
        A dict with the dataset name and fingerprint, the spec's fields, the feature version,
        (for ScatterNet) the kymatio version, (for ``encoder``) the encoder file's SHA-256 and
        (for images brought to one size as they were loaded) the geometry
        (:mod:`dpvision.data.resize`).

    Raises:
        DPVisionError: An ``encoder`` spec's file does not exist.
    """
    fields = spec.to_dict()
    if spec.name not in NETWORK_FEATURES:  # the keys of older entries stay as they were
        for name in ENCODER_ONLY:
            del fields[name]
    elif spec.name == "encoder" and spec.tokens == "mean":
        for name in ("model", "weights", "tokens"):
            del fields[name]
    key = {
        "feature_version": FEATURE_VERSION,
        "dataset": dataset.name,
        "fingerprint": dataset_fingerprint(dataset),
        "spec": fields,
        "kymatio": _kymatio_version() if spec.name == "scatternet" else None,
    }
    source = feature_source(spec) if spec.name in NETWORK_FEATURES else None
    if source is not None:
        key["encoder_sha256"] = encoder_digest(source)
    if dataset.geometry is not None:  # resized images (the keys of others stay as they were)
        key["geometry"] = dataset.geometry
    return key


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One entry of the feature cache (``dpvision cache list``).

    ``complete`` is False for leftovers of an interrupted write (no JSON, or ``.tmp``
    files); ``spec`` is the spec in text form, or ``?`` when the JSON cannot be read.
    ``dataset`` is the dataset's name as the entry's JSON records it (``npz:/data/x.npz``),
    or, for an entry without a readable JSON, the file-name form of it that begins the
    stem (``npz_data_x.npz``).
    """

    stem: str
    dataset: str
    spec: str
    files: tuple[Path, ...]
    size: int
    modified: float
    complete: bool

    def belongs_to(self, dataset: str) -> bool:
        """Whether this entry holds features of ``dataset`` (a name as ``--dataset`` takes
        it: aliases, case and the path of ``npz:``/``npy:``/``imagefolder:`` as
        :func:`~dpvision.data.datasets.same_dataset` compares them; an entry without a
        readable JSON by the file-name form of the name)."""
        if same_dataset(self.dataset, dataset):
            return True
        if self.complete:
            return False
        text = dataset.strip()
        prefix = next((p for p in PATH_PREFIXES if text.lower().startswith(p)), None)
        if prefix is not None:  # entries are named by the resolved path (as runs load it)
            text = prefix + str(Path(text[len(prefix) :]).expanduser().resolve())
        return self.dataset in (_slug(dataset), _slug(text))


def cache_entries(cache_dir: Path | str | None = None) -> list[CacheEntry]:
    """The entries of the feature cache folder, oldest first (no folder: none)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not folder.is_dir():
        return []
    groups: dict[str, list[Path]] = {}
    for path in folder.iterdir():
        # STEM.train.npy, STEM.test.npy, STEM.json, and .STEM.<part>.<random>.tmp leftovers
        match = _ENTRY_FILE.fullmatch(path.name) or _TEMPORARY_FILE.fullmatch(path.name)
        if match and path.is_file():
            groups.setdefault(match["stem"], []).append(path)
    entries = []
    for stem, files in groups.items():
        meta_path = folder / f"{stem}.json"
        # The stem is SLUG-FEATURES-DIGEST; the slug keeps "." and "-" (npz:/data/my.set.npz)
        dataset, spec, complete = stem.rsplit("-", 2)[0], "?", meta_path.is_file()
        if complete:
            try:
                key = json.loads(meta_path.read_text(encoding="utf-8"))["key"]
                dataset = str(key["dataset"])
                spec = _spec_text(key["spec"])
            except (OSError, ValueError, KeyError, TypeError):
                complete = False
        complete = complete and all(not f.name.startswith(".") for f in files)
        stats = [f.stat() for f in files]
        entries.append(
            CacheEntry(
                stem=stem,
                dataset=dataset,
                spec=spec,
                files=tuple(sorted(files)),
                size=sum(st.st_size for st in stats),
                modified=max(st.st_mtime for st in stats),
                complete=complete,
            )
        )
    return sorted(entries, key=lambda e: e.modified)


_STEM = r"(?P<stem>[^.].*-[a-z]+-[0-9a-f]+)"
"""An entry's stem, ``SLUG-FEATURES-DIGEST``: the slug of a dataset name may hold "." and
"-" (``npz_data_my.set.npz``), so the stem is found by its end, not by its first dot."""
_ENTRY_FILE = re.compile(_STEM + r"\.(?:train\.npy|test\.npy|json)")
_TEMPORARY_FILE = re.compile(r"\." + _STEM + r"\.(?:train\.npy|test\.npy|json)\.[^.]+\.tmp")


def _spec_text(fields: dict[str, Any]) -> str:
    defaults = FeatureSpec(name=str(fields["name"])).to_dict()
    changed = {k: v for k, v in fields.items() if k != "name" and defaults.get(k) != v}
    options = ",".join(f"{k}={v}" for k, v in sorted(changed.items()))
    return f"{fields['name']}:{options}" if options else str(fields["name"])


def load_or_extract(
    dataset: ImageDataset,
    spec: FeatureSpec,
    *,
    cache_dir: Path | str | None = None,
    progress: bool = True,
    batch_size: int = extractors.DEFAULT_BATCH_SIZE,
    device: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The train and test features of ``dataset``, from the cache or freshly extracted.

    On a miss the features are extracted straight into temporary memory-mapped files, which
    then become the cache entry, so the full feature arrays never need to fit in memory.
    If the cache folder cannot be written, the features are extracted in memory and
    returned uncached (with a warning).

    Args:
        dataset: The dataset whose ``train_images`` and ``test_images`` are featurised.
        spec: What to extract.
        cache_dir: The cache folder; default :func:`default_cache_dir`.
        progress: Show a progress line on stderr while extracting.
        batch_size: Images per extraction batch.
        device: torch device for extraction (default ``"cpu"``); not part of the cache key.

    Returns:
        ``(train_features, test_features)``: read-only ``float32`` arrays (memory-mapped
        from the cache files) of shapes ``(N, ...)`` and ``(M, ...)``.

    Raises:
        DPVisionError: If the images do not suit the extractor.

    Privacy:
        Extraction is data-independent (see :func:`dpvision.features.extract_features`) and
        costs no privacy. The cache files hold features of the private data: they are not a
        release, and should be protected like the dataset itself.
    """
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    # Privacy: the stem holds a digest of the private images; the log names the folder only.
    key = cache_key(dataset, spec)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    stem = f"{_slug(dataset.name)}-{spec.name}-{digest[:24]}"
    cached = _read_entry(folder, stem, digest)
    if cached is not None:
        return cached

    def extract(split: str, out: np.ndarray) -> None:
        extractors.extract_into(
            getattr(dataset, f"{split}_images"),
            spec,
            out,
            batch_size=batch_size,
            progress=progress,
            device=device,
            desc=f"{spec.name} {dataset.name} {split}",
        )

    shapes = {
        split: (len(getattr(dataset, f"{split}_images")), *feature_shape(dataset.image_shape, spec))
        for split in _SPLITS
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # e.g. a read-only file system or a file in the way
        logger.warning(
            "cannot create the feature cache folder %s (%s); extracting without caching",
            folder,
            _reason(error),
        )
        return _extract_in_memory(shapes, extract)
    _remove_stale_temporaries(folder, stem)
    try:
        return _write_entry(folder, stem, key, digest, shapes, extract)
    except _CacheWriteError as error:
        logger.warning(
            "cannot write the feature cache in %s (%s); extracting without caching",
            folder,
            _reason(error.__cause__ or error),
        )
        return _extract_in_memory(shapes, extract)


class _CacheWriteError(Exception):
    """A cache file could not be created, reserved, synced or renamed (not an extraction
    error: those propagate unchanged)."""


class _CorruptEntryError(Exception):
    """An entry that cannot be used; its message is one of a few fixed texts."""


def _read_entry(folder: Path, stem: str, digest: str) -> tuple[np.ndarray, np.ndarray] | None:
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
            raise _CorruptEntryError("its JSON is garbled") from None
        if not isinstance(meta, dict) or meta.get("digest") != digest:
            raise _CorruptEntryError("its JSON describes another entry")
        arrays = []
        for split in _SPLITS:
            try:
                expected = tuple(int(size) for size in meta[split]["shape"])
            except (KeyError, TypeError, ValueError):
                raise _CorruptEntryError("its JSON lacks the arrays' shapes") from None
            try:
                array = np.load(folder / f"{stem}.{split}.npy", mmap_mode="r", allow_pickle=False)
            except (ValueError, EOFError):
                raise _CorruptEntryError(f"its {split} array is truncated or garbled") from None
            if array.shape != expected or array.dtype != np.float32:
                raise _CorruptEntryError(f"its {split} array does not match its JSON")
            arrays.append(array)
    except (_CorruptEntryError, OSError) as error:
        logger.warning(
            "a feature cache entry in %s is corrupt (%s); extracting the features again",
            folder,
            _reason(error),
        )
        return None
    return arrays[0], arrays[1]


def _write_entry(
    folder: Path,
    stem: str,
    key: dict[str, Any],
    digest: str,
    shapes: dict[str, tuple[int, ...]],
    extract: Callable[[str, np.ndarray], None],
) -> tuple[np.ndarray, np.ndarray]:
    """Extracts both splits into temporary files, then renames them into place, JSON last.

    Raises:
        _CacheWriteError: If the file system refuses a cache file; errors of the extraction
            itself propagate unchanged.
    """
    # Without its JSON an entry is incomplete: nothing reads the arrays while they change.
    try:
        (folder / f"{stem}.json").unlink(missing_ok=True)
    except OSError as error:
        raise _CacheWriteError(str(folder / f"{stem}.json")) from error
    started = time.perf_counter()
    for split in _SPLITS:
        with _atomic_file(folder, folder / f"{stem}.{split}.npy") as temporary:
            out = _create_memmap(temporary, shapes[split])
            extract(split, out)
            out.flush()
            del out
    meta = {
        "digest": digest,
        "key": key,
        "extract_seconds": round(time.perf_counter() - started, 3),
        **{split: {"shape": list(shapes[split]), "dtype": "float32"} for split in _SPLITS},
    }
    meta_path = folder / f"{stem}.json"
    with _atomic_file(folder, meta_path) as temporary:
        temporary.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _fsync_folder(folder)
    entry = _read_entry(folder, stem, digest)
    if entry is None:  # the files were just written: only a failing disk gets here
        raise _CacheWriteError(folder / stem) from _CorruptEntryError("it could not be read back")
    return entry


@contextlib.contextmanager
def _atomic_file(folder: Path, target: Path) -> Iterator[Path]:
    """Yields a temporary path in ``folder``; on success fsyncs it and renames it to ``target``.

    On any exception (including ``KeyboardInterrupt``) the temporary file is deleted and
    ``target`` is left as it was.

    Raises:
        _CacheWriteError: If the file system refuses the temporary file, the sync or the rename.
    """
    try:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError as error:
        raise _CacheWriteError(str(target)) from error
    temporary = Path(name)
    try:
        yield temporary
        try:
            with open(temporary, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        except OSError as error:
            raise _CacheWriteError(str(target)) from error
    finally:
        temporary.unlink(missing_ok=True)


def _create_memmap(path: Path, shape: tuple[int, ...]) -> np.memmap[Any, np.dtype[np.float32]]:
    """Creates a ``float32`` ``.npy`` file of ``shape`` at ``path``, memory-mapped for writing.

    Its disk blocks are allocated up front, so a full disk is an error here rather than a
    ``SIGBUS`` while the map is being filled.

    Raises:
        _CacheWriteError: If the file cannot be created or its space reserved.
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
        raise _CacheWriteError(str(path)) from error
    return out


_FALLOCATE_UNSUPPORTED = frozenset(
    getattr(errno, name) for name in ("EOPNOTSUPP", "ENOTSUP", "EINVAL") if hasattr(errno, name)
)
"""errno values meaning the file system cannot preallocate (then the write goes ahead)."""


def _extract_in_memory(
    shapes: dict[str, tuple[int, ...]], extract: Callable[[str, np.ndarray], None]
) -> tuple[np.ndarray, np.ndarray]:
    """Extracts both splits into ordinary arrays (the fallback when nothing can be cached)."""
    arrays = []
    for split in _SPLITS:
        out = np.empty(shapes[split], dtype=np.float32)
        extract(split, out)
        arrays.append(out)
    return arrays[0], arrays[1]


def _remove_stale_temporaries(folder: Path, stem: str) -> None:
    """Deletes this entry's temporary files left more than an hour ago by a killed writer."""
    deadline = time.time() - _STALE_SECONDS
    for path in folder.glob(f".{stem}.*.tmp"):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime < deadline:
                path.unlink()


def _fsync_folder(folder: Path) -> None:
    """Makes the renames durable (best effort: not every platform can open a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _kymatio_version() -> str | None:
    """The installed kymatio version, read from package metadata (does not import it)."""
    try:
        return importlib.metadata.version("kymatio")
    except importlib.metadata.PackageNotFoundError:
        return None


def _slug(name: str) -> str:
    """A short file-name-safe form of a dataset name (the digest keeps entries apart)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-")[:40]
    return slug or "dataset"


def _reason(error: BaseException) -> str:
    """What went wrong, on one line, without a file name: an ``OSError``'s ``strerror``
    (its ``str`` names the file, whose name holds a digest of the private images), or the
    fixed text of this module's own errors.

    >>> _reason(OSError(28, "No space left on device", "/cache/x-pixels-0123abcd.json"))
    'No space left on device'
    """
    if isinstance(error, OSError):
        return error.strerror or type(error).__name__
    if isinstance(error, _CorruptEntryError):
        return str(error)
    return "a cache file could not be written"
