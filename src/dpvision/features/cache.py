"""An on-disk cache of extracted features, reused across runs and safe against interruption.

An entry holds the train and test features of one dataset under one
:class:`~dpvision.features.FeatureSpec`, in three files of the cache folder::

    <dataset>-<extractor>-<digest>.train.npy    float32 features, memory-mapped when read
    <dataset>-<extractor>-<digest>.test.npy
    <dataset>-<extractor>-<digest>.json         the key and the array shapes (written last)

The digest is the SHA-256 of the key: the dataset's name, a fingerprint of its images (the
SHA-256 of their shapes and bytes), every field of the spec, :data:`FEATURE_VERSION`, for
ScatterNet the kymatio version (its filter bank) and the transform's
(:data:`~dpvision.features.scatternet.TRANSFORM`) and, for ``encoder`` features, the SHA-256
of the encoder file's bytes (a re-trained encoder is a new entry). Any change to one of them
is a different entry.

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

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dpvision.data.core import ImageDataset
from dpvision.data.datasets import PATH_PREFIXES, same_dataset
from dpvision.features import extractors
from dpvision.features.backbone import encoder_digest, feature_source
from dpvision.features.cache_files import (
    SPLITS,
    CacheWriteError,
    read_entry,
    reason,
    remove_stale_temporaries,
    write_entry,
)
from dpvision.features.extractors import FEATURE_VERSION, feature_shape
from dpvision.features.scatternet import TRANSFORM
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
    for split in SPLITS:
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
        (for ScatterNet) the kymatio version and the transform's, (for ``encoder``) the
        encoder file's SHA-256 and (for images brought to one size as they were loaded) the
        geometry (:mod:`dpvision.data.resize`).

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
    if spec.name == "scatternet":  # kymatio's transform made the entries keyed without it
        key["transform"] = TRANSFORM
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
    cached = read_entry(folder, stem, digest)
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
        for split in SPLITS
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # e.g. a read-only file system or a file in the way
        logger.warning(
            "cannot create the feature cache folder %s (%s); extracting without caching",
            folder,
            reason(error),
        )
        return _extract_in_memory(shapes, extract)
    remove_stale_temporaries(folder, stem)
    try:
        return write_entry(folder, stem, key, digest, shapes, extract)
    except CacheWriteError as error:
        logger.warning(
            "cannot write the feature cache in %s (%s); extracting without caching",
            folder,
            reason(error.__cause__ or error),
        )
        return _extract_in_memory(shapes, extract)


def _extract_in_memory(
    shapes: dict[str, tuple[int, ...]], extract: Callable[[str, np.ndarray], None]
) -> tuple[np.ndarray, np.ndarray]:
    """Extracts both splits into ordinary arrays (the fallback when nothing can be cached)."""
    arrays = []
    for split in SPLITS:
        out = np.empty(shapes[split], dtype=np.float32)
        extract(split, out)
        arrays.append(out)
    return arrays[0], arrays[1]


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
