"""The feature cache: hits and misses, atomic writes, recovery from corrupt files."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from features_testing import isolate_cache, make_dataset, one_torch_thread

from dpvision.features import (
    ENV_CACHE,
    FeatureSpec,
    cache_files,
    default_cache_dir,
    extract_features,
    extractors,
    load_or_extract,
)
from dpvision.features import cache as cache_module

PIXELS = FeatureSpec("pixels")


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own HOME and feature cache under tmp_path, and one torch thread."""
    with one_torch_thread():
        yield isolate_cache(tmp_path, monkeypatch)


class Counter:
    """Wraps ``extractors.extract_into`` and counts its calls (one per split extracted)."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        fail_on_call: int | None = None,
        error: BaseException | None = None,
    ) -> None:
        self.calls = 0
        self.fail_on_call = fail_on_call
        self.error = error if error is not None else RuntimeError("interrupted")
        self._real = extractors.extract_into
        monkeypatch.setattr(extractors, "extract_into", self)

    def __call__(
        self, images: np.ndarray, spec: FeatureSpec, out: np.ndarray, **kwargs: object
    ) -> None:
        self.calls += 1
        if self.calls == self.fail_on_call:
            out[: len(out) // 2] = 1.0  # half-written, then the process "dies"
            raise self.error
        self._real(images, spec, out, **kwargs)  # type: ignore[arg-type]


def entry_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def expected(dataset, spec=PIXELS):
    return (
        extract_features(dataset.train_images, spec, progress=False),
        extract_features(dataset.test_images, spec, progress=False),
    )


def test_default_cache_dir(monkeypatch, tmp_path, isolated_cache):
    assert default_cache_dir() == isolated_cache
    monkeypatch.delenv(ENV_CACHE)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "dpvision" / "features"
    monkeypatch.setenv(ENV_CACHE, "")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "dpvision" / "features"


def test_miss_then_hit(monkeypatch, isolated_cache):
    dataset = make_dataset()
    counter = Counter(monkeypatch)
    train, test = load_or_extract(dataset, PIXELS, progress=False)
    assert counter.calls == 2
    want_train, want_test = expected(dataset)
    np.testing.assert_array_equal(train, want_train)
    np.testing.assert_array_equal(test, want_test)
    files = entry_files(isolated_cache)
    assert len(files) == 3
    assert sum(name.endswith(".json") for name in files) == 1
    assert sum(name.endswith(".train.npy") for name in files) == 1
    assert sum(name.endswith(".test.npy") for name in files) == 1

    again_train, again_test = load_or_extract(dataset, PIXELS, progress=False)
    assert counter.calls == 2  # nothing extracted the second time
    assert isinstance(again_train, np.memmap)
    assert not again_train.flags.writeable
    np.testing.assert_array_equal(again_train, want_train)
    np.testing.assert_array_equal(again_test, want_test)


def test_scatternet_entry_round_trips(monkeypatch, isolated_cache):
    dataset = make_dataset(train=4, test=2, shape=(32, 32, 3))
    spec = FeatureSpec("scatternet", flatten=False)
    counter = Counter(monkeypatch)
    train, test = load_or_extract(dataset, spec, progress=False)
    assert train.shape == (4, 243, 8, 8)
    assert test.shape == (2, 243, 8, 8)
    again, _ = load_or_extract(dataset, spec, progress=False)
    assert counter.calls == 2
    np.testing.assert_array_equal(
        again, extract_features(dataset.train_images, spec, progress=False)
    )
    meta = json.loads(next(isolated_cache.glob("*.json")).read_text())
    assert meta["key"]["kymatio"] == "0.3.0"
    assert meta["key"]["transform"] == "dpvision-1"  # not an entry kymatio's transform made
    assert meta["key"]["spec"]["flatten"] is False
    assert meta["train"]["shape"] == [4, 243, 8, 8]


def test_explicit_cache_dir(tmp_path, isolated_cache):
    folder = tmp_path / "elsewhere"
    load_or_extract(make_dataset(), PIXELS, cache_dir=folder, progress=False)
    assert len(entry_files(folder)) == 3
    assert not isolated_cache.exists()


@pytest.mark.parametrize(
    "change",
    ["spec", "seed", "name", "one pixel", "test split"],
)
def test_key_covers_spec_name_and_data(monkeypatch, change):
    dataset = make_dataset()
    spec = FeatureSpec("pixels", projection_dim=8)
    load_or_extract(dataset, spec, progress=False)
    counter = Counter(monkeypatch)
    if change == "spec":
        spec = FeatureSpec("pixels", projection_dim=8, pool=2)
    elif change == "seed":
        spec = FeatureSpec("pixels", projection_dim=8, projection_seed=1)
    elif change == "name":
        dataset = make_dataset(name="toy-copy")
    else:
        split = "train" if change == "one pixel" else "test"
        images = getattr(dataset, f"{split}_images").copy()
        images[0, 0, 0, 0] ^= 1
        dataset = dataclasses.replace(dataset, **{f"{split}_images": images})
    train, _ = load_or_extract(dataset, spec, progress=False)
    assert counter.calls == 2
    np.testing.assert_array_equal(
        train, extract_features(dataset.train_images, spec, progress=False)
    )


def test_labels_do_not_change_the_key(monkeypatch):
    dataset = make_dataset()
    load_or_extract(dataset, PIXELS, progress=False)
    counter = Counter(monkeypatch)
    relabelled = dataclasses.replace(dataset, train_labels=np.zeros_like(dataset.train_labels))
    load_or_extract(relabelled, PIXELS, progress=False)
    assert counter.calls == 0


@pytest.mark.parametrize("fail_on_call", [1, 2])
@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_interrupted_write_leaves_nothing_readable(
    monkeypatch, isolated_cache, fail_on_call, error
):
    dataset = make_dataset()
    counter = Counter(monkeypatch, fail_on_call=fail_on_call, error=error)
    with pytest.raises(type(error)):
        load_or_extract(dataset, PIXELS, progress=False)
    files = entry_files(isolated_cache)
    assert not any(name.endswith((".tmp", ".json")) for name in files)
    # train (split 1) is complete when split 2 fails; never a half-written file.
    assert len(files) == fail_on_call - 1

    counter.fail_on_call = None
    calls = counter.calls
    train, test = load_or_extract(dataset, PIXELS, progress=False)
    assert counter.calls == calls + 2  # the incomplete entry was not used
    want_train, want_test = expected(dataset)
    np.testing.assert_array_equal(train, want_train)
    np.testing.assert_array_equal(test, want_test)


def test_orphaned_temporary_files_are_never_read_and_old_ones_are_removed(
    monkeypatch, isolated_cache
):
    dataset = make_dataset()
    load_or_extract(dataset, PIXELS, progress=False)
    stem = next(isolated_cache.glob("*.json")).name.removesuffix(".json")
    for path in isolated_cache.iterdir():
        path.unlink()
    # What a writer killed with SIGKILL leaves behind: truncated temporaries.
    fresh = isolated_cache / f".{stem}.train.npy.abc123.tmp"
    old = isolated_cache / f".{stem}.test.npy.def456.tmp"
    for path in (fresh, old):
        path.write_bytes(b"\x93NUMPY truncated")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))

    counter = Counter(monkeypatch)
    train, _ = load_or_extract(dataset, PIXELS, progress=False)
    assert counter.calls == 2
    np.testing.assert_array_equal(train, expected(dataset)[0])
    assert fresh.exists()  # could belong to a live writer
    assert not old.exists()


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt(folder: Path, how: str) -> None:
    meta_path = next(folder.glob("*.json"))
    stem = meta_path.name.removesuffix(".json")
    train = folder / f"{stem}.train.npy"
    test = folder / f"{stem}.test.npy"
    if how == "truncated train":
        _truncate(train)
    elif how == "truncated header":
        train.write_bytes(train.read_bytes()[:20])
    elif how == "empty test":
        test.write_bytes(b"")
    elif how == "missing test":
        test.unlink()
    elif how == "wrong shape":
        np.save(train, np.zeros((3, 5), dtype=np.float32))
    elif how == "wrong dtype":
        np.save(train, np.zeros((12, 784), dtype=np.float64))
    elif how == "garbled json":
        meta_path.write_text("{ not json")
    elif how == "json shape mismatch":
        meta = json.loads(meta_path.read_text())
        meta["train"]["shape"] = [13, 784]
        meta_path.write_text(json.dumps(meta))
    elif how == "json of another entry":
        meta = json.loads(meta_path.read_text())
        meta["digest"] = "0" * 64
        meta_path.write_text(json.dumps(meta))
    elif how == "json missing fields":
        meta_path.write_text(json.dumps({"digest": stem}))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "truncated train",
        "truncated header",
        "empty test",
        "missing test",
        "wrong shape",
        "wrong dtype",
        "garbled json",
        "json shape mismatch",
        "json of another entry",
        "json missing fields",
    ],
)
def test_corrupt_entry_is_extracted_again_with_one_warning(
    monkeypatch, caplog, isolated_cache, how
):
    dataset = make_dataset()
    load_or_extract(dataset, PIXELS, progress=False)
    _corrupt(isolated_cache, how)
    counter = Counter(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="dpvision.features.cache"):
        train, test = load_or_extract(dataset, PIXELS, progress=False)
    assert counter.calls == 2
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "corrupt" in message
    assert "extracting the features again" in message
    assert "\n" not in message
    want_train, want_test = expected(dataset)
    np.testing.assert_array_equal(train, want_train)
    np.testing.assert_array_equal(test, want_test)
    # The rewritten entry is a clean hit.
    caplog.clear()
    load_or_extract(dataset, PIXELS, progress=False)
    assert counter.calls == 2
    assert not caplog.records


def test_unusable_cache_folder_falls_back_to_memory(caplog, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    dataset = make_dataset()
    with caplog.at_level(logging.WARNING, logger="dpvision.features.cache"):
        train, test = load_or_extract(dataset, PIXELS, cache_dir=blocker / "cache", progress=False)
    assert "extracting without caching" in caplog.text
    np.testing.assert_array_equal(train, expected(dataset)[0])
    np.testing.assert_array_equal(test, expected(dataset)[1])


def test_refused_cache_file_falls_back_to_memory(monkeypatch, caplog, isolated_cache):
    def refuse(path, shape):
        raise cache_files.CacheWriteError(str(path)) from OSError(28, "No space left on device")

    monkeypatch.setattr(cache_files, "create_memmap", refuse)
    dataset = make_dataset()
    with caplog.at_level(logging.WARNING, logger="dpvision.features.cache"):
        train, _ = load_or_extract(dataset, PIXELS, progress=False)
    assert "No space left on device" in caplog.text
    np.testing.assert_array_equal(train, expected(dataset)[0])
    assert not any(name.endswith((".tmp", ".json")) for name in entry_files(isolated_cache))


def test_empty_test_split_is_cached(monkeypatch):
    dataset = make_dataset(test=0)
    _, test = load_or_extract(dataset, PIXELS, progress=False)
    assert test.shape == (0, 784)
    counter = Counter(monkeypatch)
    _, test = load_or_extract(dataset, PIXELS, progress=False)
    assert counter.calls == 0
    assert test.shape == (0, 784)


# --- issue 48, finding 5: the log names the folder, never the entry --------------------------


def _private_names(dataset, spec=PIXELS) -> list[str]:
    """What an adversary who knows the dataset but the target computes for D and D + x:
    the cache entry's digest (as the stem holds it), the key's digest and the fingerprint."""
    import hashlib

    key = cache_module.cache_key(dataset, spec)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return [digest[:24], digest, cache_module.dataset_fingerprint(dataset)]


@pytest.mark.parametrize(
    "how",
    [
        "truncated train",
        "truncated header",
        "empty test",
        "missing test",
        "wrong shape",
        "wrong dtype",
        "garbled json",
        "json shape mismatch",
        "json of another entry",
        "json missing fields",
    ],
)
def test_a_corrupt_entry_logs_its_folder_and_no_digest_of_the_data(caplog, isolated_cache, how):
    """Before the fix the warning named ``<folder>/<dataset>-pixels-<digest>``: the adversary
    computed the digest for D and for D + x and matched the published log."""
    dataset = make_dataset()
    neighbour = dataclasses.replace(
        dataset,
        train_images=np.concatenate([dataset.train_images, dataset.test_images[:1]]),
        train_labels=np.concatenate([dataset.train_labels, dataset.test_labels[:1]]),
    )
    load_or_extract(dataset, PIXELS, progress=False)
    stem = next(isolated_cache.glob("*.json")).name.removesuffix(".json")
    _corrupt(isolated_cache, how)
    with caplog.at_level(logging.DEBUG, logger="dpvision"):
        load_or_extract(dataset, PIXELS, progress=False)
    log = caplog.text
    assert "corrupt" in log
    assert str(isolated_cache) in log  # the folder, for the one who keeps the cache
    assert stem not in log
    for name in (*_private_names(dataset), *_private_names(neighbour)):
        assert name not in log
    assert ".npy" not in log
    assert ".json" not in log


def test_a_refused_cache_write_logs_no_file_name(monkeypatch, caplog, isolated_cache):
    def refuse(path, shape):
        raise cache_files.CacheWriteError(str(path)) from OSError(
            28, "No space left on device", str(path)
        )

    monkeypatch.setattr(cache_files, "create_memmap", refuse)
    dataset = make_dataset()
    with caplog.at_level(logging.DEBUG, logger="dpvision"):
        load_or_extract(dataset, PIXELS, progress=False)
    assert "No space left on device" in caplog.text
    assert str(isolated_cache) in caplog.text
    for name in _private_names(dataset):
        assert name not in caplog.text
    assert ".npy" not in caplog.text
