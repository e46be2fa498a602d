"""Scale benchmark: DP-LS and one epoch of DP-FC on 1.28M × 768 features, 1000 classes.

The question (from the issue): do ``dp-ls`` and one epoch of ``dp-fc`` finish on this 2-core
machine at ImageNet scale, and what do they cost over the matrix products they cannot avoid?
The benchmark therefore reports each learner's wall time next to the time of those matrix
products, measured in the same run and the same process on the same memory-mapped data, so
the overhead is a ratio that depends much less on how fast the machine is than seconds do
(though not on how busy it is: other processes on the cores slow the threaded
eigendecompositions far more than the matrix products, see the reference stage below).

What is measured, in this order, on a memory map of the training features:

1. ``read pass``: one pass reading 16 384-row chunks and converting them to float64, as the
   learners do. It also warms the page cache, so every later stage reads the same way.
2. ``baseline A`` (the products DP-LS needs): G = XᵀX in float64 over the same chunks, plus
   the per-class Gram matrices Aⱼ of all m classes via :class:`ClassIndex` and
   :func:`class_grams`, a block of classes at a time (the learner's own block size).
   A reference stage (in no baseline) then times one batched eigendecomposition of 16
   symmetric d×d matrices and extrapolates it to m classes: DP-LS's per-class solve is one
   eigendecomposition each, often most of its overhead (and, with 2 threads on a busy
   machine, very sensitive to CPU contention).
3. ``DP-LS``: ``DPLeastSquares(target_epsilon=1, target_delta=1e-6, clip_norm=1).fit``; its
   wall time over baseline A is the overhead (clipping, class sums, noise for G, Aⱼ and bⱼ,
   one eigendecomposition per class).
4. ``baseline B`` (the products one DP-FC epoch needs): the G pass of baseline A (reused,
   not re-run) plus one pass computing scores S = X Wᵀ and Sᵀ X per chunk (W is a random
   (m, d) float64 matrix, S plays the role of the (rows, m) error matrix E).
5. ``DP-FC``: ``DPFeatureCovariance(target_epsilon=1, target_delta=1e-6, epochs=1,
   covariance_clip_norm=1, clip_norm=1).fit``; its wall time over baseline B is the overhead.

Each stage records wall and CPU seconds, the process's peak resident memory
(``ru_maxrss``, which counts the touched pages of the memory map too) and the peak of its
anonymous memory (``RssAnon``, sampled; the memory the process itself allocated). Test
accuracy is measured on a held-out set drawn from the same class means.

The synthetic data (classes learnable: class means N(0, I)/√d·scale, features = mean[label] +
N(0, I)·noise/√d, rescaled so row norms are ≈ 1) are generated once, in chunks, in a child
process (so generation does not count towards this process's memory), and reused when the
parameters match. 1.28M × 768 float32 training features take 3.9 GB of disk.

Run (full size, about 4 GB in /tmp/dpvision-scale):
    python benchmarks/scale_feature_learners.py
Smoke test:
    python benchmarks/scale_feature_learners.py --n 20000 --d 64 --classes 50 --n-test 2000 \
        --data-dir /tmp/dpvision-scale-small --out /tmp/scale-small-results

Memory only (``--memory-only dp-ls``): runs nothing but the DP-LS fit (same data, same
learner settings) in a fresh child process, so that its peak resident memory is the fit's
alone, and writes ``scale_feature_learners_memory.{json,md}``. The child records its
``ru_maxrss`` after the fit (the acceptance measure: it counts the touched pages of the
memory map), its ``VmHWM`` (the peak RSS of the child's own address space: ``ru_maxrss``
of a spawned child is at least the parent's peak at the spawn, which the report states),
and sampled peaks of ``RssAnon`` and ``RssFile``:
    python benchmarks/scale_feature_learners.py --memory-only dp-ls
"""

import argparse
import json
import math
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dpvision
from dpvision.learners import DPFeatureCovariance, DPLeastSquares
from dpvision.learners.statistics import (
    DEFAULT_CHUNK_SIZE,
    ClassIndex,
    class_grams,
    iter_chunks,
)

FORMAT_VERSION = 1
WRITE_CHUNK = 32768  # rows generated and written at a time
CLASS_SCALE = 1.0  # norm of a class mean before rescaling
NOISE_SCALE = 1.0  # norm of the per-example noise before rescaling
TARGET_EPSILON = 1.0
TARGET_DELTA = 1e-6
CLIP_NORM = 1.0
DP_LS_BLOCK_BYTES = 2**28  # DPLeastSquares' default max_block_bytes
EIGH_REFERENCE_COUNT = 16  # d×d eigendecompositions timed for the reference stage
FILES = ("train_features.npy", "train_labels.npy", "test_features.npy", "test_labels.npy")
NAME = "scale_feature_learners"
MEMORY_NAME = "scale_feature_learners_memory"
MEMORY_ONLY = ("dp-ls",)
_START = time.perf_counter()


def log(message: str) -> None:
    """Prints one progress line to stderr, with the seconds since the script started."""
    print(f"[{time.perf_counter() - _START:8.1f} s] {message}", file=sys.stderr, flush=True)


# --- synthetic data ----------------------------------------------------------------------


def data_parameters(args: argparse.Namespace) -> dict[str, Any]:
    """Everything that determines the generated files (compared before reusing them)."""
    return {
        "format_version": FORMAT_VERSION,
        "n": args.n,
        "d": args.d,
        "classes": args.classes,
        "n_test": args.n_test,
        "seed": args.seed,
        "class_scale": CLASS_SCALE,
        "noise_scale": NOISE_SCALE,
        "write_chunk": WRITE_CHUNK,
        "dtype": "float32",
    }


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_text_atomic(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and a rename."""
    temporary = _temporary(path)
    try:
        with open(temporary, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_array_atomic(path: Path, array: np.ndarray) -> None:
    """Saves a (small) array as ``.npy`` through a temporary file and a rename."""
    temporary = _temporary(path)
    try:
        with open(temporary, "wb") as out:
            np.save(out, array)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_features(
    path: Path,
    labels: np.ndarray,
    means: np.ndarray,
    rng: np.random.Generator,
    noise_std: float,
    rescale: float,
) -> None:
    """Writes mean[label] + noise, rescaled, chunk by chunk into a memory-mapped ``.npy``."""
    rows, d = len(labels), means.shape[1]
    temporary = _temporary(path)
    try:
        out = np.lib.format.open_memmap(temporary, mode="w+", dtype=np.float32, shape=(rows, d))
        for start in range(0, rows, WRITE_CHUNK):
            part = labels[start : start + WRITE_CHUNK]
            noise = rng.standard_normal((len(part), d), dtype=np.float32)
            out[start : start + len(part)] = (means[part] + noise_std * noise) * rescale
        out.flush()
        del out
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def generate_dataset(data_dir: str, params: dict[str, Any]) -> None:
    """Generates train and test features and labels into ``data_dir``, then the params JSON.

    The JSON is written last, so its presence means that every file is complete.
    """
    folder = Path(data_dir)
    d, m = params["d"], params["classes"]
    rng = np.random.default_rng(params["seed"])
    means = (rng.standard_normal((m, d)) * (params["class_scale"] / math.sqrt(d))).astype(
        np.float32
    )
    noise_std = params["noise_scale"] / math.sqrt(d)
    rescale = 1.0 / math.hypot(params["class_scale"], params["noise_scale"])  # row norms ≈ 1
    for split, rows in (("train", params["n"]), ("test", params["n_test"])):
        labels = rng.integers(0, m, size=rows, dtype=np.int64)
        write_array_atomic(folder / f"{split}_labels.npy", labels)
        log(f"generating {split} features: {rows} × {d} float32 ...")
        write_features(folder / f"{split}_features.npy", labels, means, rng, noise_std, rescale)
    write_text_atomic(folder / "params.json", json.dumps(params, indent=2) + "\n")


def dataset_is_current(folder: Path, params: dict[str, Any]) -> bool:
    """Whether ``folder`` holds complete files generated with exactly ``params``."""
    try:
        if json.loads((folder / "params.json").read_text()) != params:
            return False
        shapes = {
            "train_features.npy": ((params["n"], params["d"]), np.float32),
            "train_labels.npy": ((params["n"],), np.int64),
            "test_features.npy": ((params["n_test"], params["d"]), np.float32),
            "test_labels.npy": ((params["n_test"],), np.int64),
        }
        for name, (shape, dtype) in shapes.items():
            array = np.load(folder / name, mmap_mode="r")
            if array.shape != shape or array.dtype != dtype:
                return False
    except (OSError, ValueError):
        return False
    return True


def ensure_dataset(folder: Path, params: dict[str, Any]) -> dict[str, Any]:
    """Reuses matching data in ``folder`` or generates it in a child process.

    Returns:
      ``{"generated": bool, "seconds": float, "bytes": int}``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    generated = not dataset_is_current(folder, params)
    if generated:
        needed = 4 * (params["n"] + params["n_test"]) * (params["d"] + 2)
        free = shutil.disk_usage(folder).free
        if free < 1.05 * needed:
            sys.exit(f"error: {folder} has {free / 2**30:.1f} GiB free, needs {needed / 2**30:.1f}")
        (folder / "params.json").unlink(missing_ok=True)
        log(f"generating data in {folder} (about {needed / 1e9:.2f} GB) in a child process")
        # A separate process: its touched pages never count towards this process's memory.
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            pool.submit(generate_dataset, str(folder), params).result()
    else:
        log(f"reusing data in {folder}")
    size = sum((folder / name).stat().st_size for name in FILES)
    return {"generated": generated, "seconds": time.perf_counter() - started, "bytes": size}


# --- measurement -------------------------------------------------------------------------


def _status_fields(*keys: str) -> dict[str, int]:
    """``kB`` fields of /proc/self/status (Linux); missing ones are left out."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key = line.split(":", 1)[0]
                if key in keys:
                    found[key] = int(line.split()[1])
    except OSError:
        pass
    return found


def _status_kb(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status (Linux), or None."""
    return _status_fields(key).get(key)


class AnonPeakSampler:
    """Samples the process's anonymous resident memory (RssAnon) in a background thread.

    It also keeps the peak of the file-backed resident memory (RssFile: the touched pages of
    memory maps and of the loaded libraries) in ``peak_file_kb``.
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak_kb = 0
        self.peak_file_kb = 0
        self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        fields = _status_fields("RssAnon", "RssFile")
        self.peak_kb = max(self.peak_kb, fields.get("RssAnon", 0))
        self.peak_file_kb = max(self.peak_file_kb, fields.get("RssFile", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "AnonPeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


@dataclass
class Stage:
    """Wall and CPU time and memory of one measured stage."""

    name: str
    wall_s: float = 0.0
    cpu_s: float = 0.0
    max_rss_mb: float = 0.0  # ru_maxrss of the process after the stage (a running peak)
    peak_anon_mb: float = 0.0  # peak RssAnon sampled during the stage
    extra: dict[str, Any] = field(default_factory=dict)


@contextmanager
def measure(name: str, stages: list[Stage]) -> Iterator[Stage]:
    """Times the ``with`` body and appends its :class:`Stage` (with memory) to ``stages``."""
    stage = Stage(name)
    log(f"{name} ...")
    wall, cpu = time.perf_counter(), time.process_time()
    with AnonPeakSampler() as sampler:
        yield stage
    stage.wall_s = time.perf_counter() - wall
    stage.cpu_s = time.process_time() - cpu
    stage.max_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    stage.peak_anon_mb = sampler.peak_kb / 1024
    stages.append(stage)
    log(
        f"{name}: {stage.wall_s:.2f} s wall, {stage.cpu_s:.2f} s CPU, "
        f"max RSS {stage.max_rss_mb:.0f} MB, peak anon {stage.peak_anon_mb:.0f} MB"
    )


def read_pass(features: np.ndarray) -> float:
    """Reads every chunk as float64 (as the learners do); returns a checksum."""
    total = 0.0
    for x, _ in iter_chunks(features, chunk_size=DEFAULT_CHUNK_SIZE):
        total += float(x[:, 0].sum())
    return total


def gram_pass(features: np.ndarray) -> torch.Tensor:
    """G = XᵀX in float64, accumulated over the learners' chunks."""
    d = features.shape[1]
    gram = torch.zeros(d, d, dtype=torch.float64)
    for x, _ in iter_chunks(features, chunk_size=DEFAULT_CHUNK_SIZE):
        gram.addmm_(x.T, x)
    return gram


def all_class_grams(features: np.ndarray, index: ClassIndex, num_classes: int) -> float:
    """Computes every Aⱼ, in DP-LS's class blocks, discarding each block; returns a checksum."""
    d = features.shape[1]
    block = max(1, DP_LS_BLOCK_BYTES // (8 * d * d))
    trace = 0.0
    for first in range(0, num_classes, block):
        classes = range(first, min(first + block, num_classes))
        grams = class_grams(features, index, classes, clip_norm=CLIP_NORM)
        trace += float(grams.diagonal(dim1=-2, dim2=-1).sum())
        del grams
    return trace


def scores_gradient_pass(features: np.ndarray, num_classes: int, seed: int) -> torch.Tensor:
    """One pass of S = X Wᵀ and Sᵀ X per chunk: the products of one DP-FC gradient step."""
    d = features.shape[1]
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_classes, d, dtype=torch.float64, generator=generator) / d
    grad = torch.zeros(num_classes, d, dtype=torch.float64)
    for x, _ in iter_chunks(features, chunk_size=DEFAULT_CHUNK_SIZE):
        scores = x @ weight.T  # (rows, m): stands in for the error matrix E
        grad.addmm_(scores.T, x)
    return grad


def eigh_reference(d: int, num_classes: int, seed: int) -> dict[str, float]:
    """Times one batched eigendecomposition of symmetric d×d matrices, as DP-LS's solve does.

    Not part of either baseline: it shows how much of DP-LS's overhead is its one
    eigendecomposition per class (``solve_psd``), extrapolated to all classes.
    """
    count = min(EIGH_REFERENCE_COUNT, num_classes)
    generator = torch.Generator().manual_seed(seed)
    matrices = torch.randn(count, d, d, dtype=torch.float64, generator=generator)
    matrices = matrices + matrices.transpose(-1, -2)
    started = time.perf_counter()
    torch.linalg.eigh(matrices)
    per_matrix = (time.perf_counter() - started) / count
    return {
        "matrices": count,
        "seconds_per_matrix": per_matrix,
        "extrapolated_to_all_classes_s": per_matrix * num_classes,
    }


def fit_and_score(
    make: Callable[[], DPLeastSquares | DPFeatureCovariance],
    data: dict[str, np.ndarray],
    stages: list[Stage],
    name: str,
) -> dict[str, Any]:
    """Fits (timed as stage ``name``), then scores on the test set (timed separately)."""
    model = make()
    with measure(name, stages):
        model.fit(data["x_train"], data["y_train"])
    started = time.perf_counter()
    accuracy = float(model.score(data["x_test"], data["y_test"]))
    result = {
        "test_accuracy": accuracy,
        "epsilon": float(model.epsilon_),
        "delta": TARGET_DELTA,
        "noise_multiplier": model.noise_multiplier_,
        "score_seconds": time.perf_counter() - started,
        "privacy_ledger": model.privacy_ledger_.to_dict(),
    }
    log(
        f"{name}: test accuracy {accuracy:.4f}, ε {model.epsilon_:.4f}, "
        f"σ {model.noise_multiplier_:.4f}"
    )
    return result


def make_dp_ls(num_classes: int) -> DPLeastSquares:
    """The DP-LS learner both modes measure."""
    return DPLeastSquares(
        target_epsilon=TARGET_EPSILON,
        target_delta=TARGET_DELTA,
        clip_norm=CLIP_NORM,
        random_state=0,
        num_classes=num_classes,
    )


def load_data(folder: Path) -> dict[str, np.ndarray]:
    """Training and test features as read-only memory maps, labels in memory."""
    return {
        "x_train": np.load(folder / "train_features.npy", mmap_mode="r"),
        "y_train": np.load(folder / "train_labels.npy"),
        "x_test": np.load(folder / "test_features.npy", mmap_mode="r"),
        "y_test": np.load(folder / "test_labels.npy"),
    }


def _busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has been busy since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal: everything but idle and iowait
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def dp_ls_memory_child(data_dir: str, num_classes: int) -> dict[str, Any]:
    """In a fresh (spawned) process: loads the data, fits DP-LS, scores; returns the numbers.

    Memory is read right after the fit, before scoring: ``ru_maxrss`` and ``VmHWM`` are the
    peaks up to then; RssAnon and RssFile are sampled every 20 ms during the fit.
    """
    started_kb = _status_fields("VmRSS", "RssAnon", "RssFile")
    data = load_data(Path(data_dir))
    model = make_dp_ls(num_classes)
    busy, usage = _busy_cpu_seconds(), resource.getrusage(resource.RUSAGE_SELF)
    wall, cpu = time.perf_counter(), time.process_time()
    with AnonPeakSampler() as sampler:
        model.fit(data["x_train"], data["y_train"])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    busy_after, usage_after = _busy_cpu_seconds(), resource.getrusage(resource.RUSAGE_SELF)
    others = None if busy is None or busy_after is None else busy_after - busy - cpu
    fit_maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    fit_hwm_kb = _status_kb("VmHWM") or 0
    after_fit_kb = _status_fields("VmRSS", "RssAnon", "RssFile")
    scored = time.perf_counter()
    accuracy = float(model.score(data["x_test"], data["y_test"]))
    return {
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "user_cpu_seconds": usage_after.ru_utime - usage.ru_utime,
        "system_cpu_seconds": usage_after.ru_stime - usage.ru_stime,
        "other_processes_cpu_seconds": others,
        "max_rss_mb": fit_maxrss_kb / 1024,
        "vm_hwm_mb": fit_hwm_kb / 1024,
        "peak_anon_mb": sampler.peak_kb / 1024,
        "peak_file_mb": sampler.peak_file_kb / 1024,
        "before_fit_mb": {key: value / 1024 for key, value in started_kb.items()},
        "after_fit_mb": {key: value / 1024 for key, value in after_fit_kb.items()},
        "max_rss_mb_after_score": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "test_accuracy": accuracy,
        "score_seconds": time.perf_counter() - scored,
        "epsilon": float(model.epsilon_),
        "delta": TARGET_DELTA,
        "noise_multiplier": model.noise_multiplier_,
        "privacy_ledger": model.privacy_ledger_.to_dict(),
        "torch_num_threads": torch.get_num_threads(),
    }


def run_memory_only(folder: Path, num_classes: int) -> dict[str, Any]:
    """Runs :func:`dp_ls_memory_child` in a fresh spawned process and returns its numbers."""
    parent_maxrss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    log(f"DP-LS fit alone in a fresh child process (parent peak RSS {parent_maxrss_mb:.0f} MB)")
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        child = pool.submit(dp_ls_memory_child, str(folder), num_classes).result()
    log(
        f"DP-LS fit: {child['wall_seconds']:.2f} s wall, {child['cpu_seconds']:.2f} s CPU, "
        f"max RSS {child['max_rss_mb']:.0f} MB (VmHWM {child['vm_hwm_mb']:.0f} MB), "
        f"peak anon {child['peak_anon_mb']:.0f} MB, peak file {child['peak_file_mb']:.0f} MB; "
        f"test accuracy {child['test_accuracy']:.4f}, ε {child['epsilon']:.4f}; other "
        f"processes used {child['other_processes_cpu_seconds'] or 0:.0f} CPU s meanwhile"
    )
    return {"dp_ls": child, "parent_max_rss_mb_at_spawn": parent_maxrss_mb}


def run_stages(data: dict[str, np.ndarray], num_classes: int, seed: int) -> dict[str, Any]:
    """Runs every measured stage in order; returns stages, learner results and ratios."""
    stages: list[Stage] = []
    x = data["x_train"]
    with measure("read pass (float64 chunks, warms the page cache)", stages):
        read_pass(x)
    with measure("baseline A: G = XᵀX", stages) as gram_stage:
        gram_pass(x)
    with measure("baseline A: ClassIndex", stages) as index_stage:
        index = ClassIndex(data["y_train"], num_classes)
    with measure("baseline A: class_grams (all classes)", stages) as class_stage:
        all_class_grams(x, index, num_classes)
    del index
    baseline_a = gram_stage.wall_s + index_stage.wall_s + class_stage.wall_s
    with measure("reference: batched eigh of d×d matrices (not in a baseline)", stages) as ref:
        ref.extra = eigh_reference(x.shape[1], num_classes, seed)
    dp_ls = fit_and_score(lambda: make_dp_ls(num_classes), data, stages, "DP-LS fit")
    with measure("baseline B: S = X Wᵀ and Sᵀ X", stages) as pass_stage:
        scores_gradient_pass(x, num_classes, seed)
    baseline_b = gram_stage.wall_s + pass_stage.wall_s
    dp_fc = fit_and_score(
        lambda: DPFeatureCovariance(
            target_epsilon=TARGET_EPSILON,
            target_delta=TARGET_DELTA,
            epochs=1,
            covariance_clip_norm=CLIP_NORM,
            clip_norm=CLIP_NORM,
            random_state=0,
            num_classes=num_classes,
        ),
        data,
        stages,
        "DP-FC fit (1 epoch)",
    )
    walls = {stage.name: stage.wall_s for stage in stages}
    return {
        "stages": [asdict(stage) for stage in stages],
        "baseline_a_seconds": baseline_a,
        "baseline_b_seconds": baseline_b,
        "dp_ls": {**dp_ls, "wall_seconds": walls["DP-LS fit"]},
        "dp_fc": {**dp_fc, "wall_seconds": walls["DP-FC fit (1 epoch)"]},
        "ratios": {
            "dp_ls_over_baseline_a": walls["DP-LS fit"] / baseline_a,
            "dp_fc_over_baseline_b": walls["DP-FC fit (1 epoch)"] / baseline_b,
        },
    }


# --- report ------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """The machine and library versions the numbers were measured with."""
    return {
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "dpvision": dpvision.__version__,
        "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        "thread_env": {
            key: os.environ.get(key)
            for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
        },
    }


def markdown(result: dict[str, Any]) -> str:
    """A short markdown report of ``result``."""
    p, r, mach = result["parameters"], result["results"], result["machine"]
    rows = [
        "| stage | wall s | CPU s | max RSS MB (ru_maxrss) | peak anon MB |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in r["stages"]:
        rows.append(
            f"| {s['name']} | {s['wall_s']:.2f} | {s['cpu_s']:.2f} | "
            f"{s['max_rss_mb']:.0f} | {s['peak_anon_mb']:.0f} |"
        )
    ls, fc, ratios = r["dp_ls"], r["dp_fc"], r["ratios"]
    learners = [
        "| learner | wall s | baseline s | wall / baseline | test accuracy | ε | σ |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| DP-LS | {ls['wall_seconds']:.2f} | A = {r['baseline_a_seconds']:.2f} | "
        f"**{ratios['dp_ls_over_baseline_a']:.2f}** | {ls['test_accuracy']:.4f} | "
        f"{ls['epsilon']:.4f} | {ls['noise_multiplier']:.4f} |",
        f"| DP-FC (1 epoch) | {fc['wall_seconds']:.2f} | B = {r['baseline_b_seconds']:.2f} | "
        f"**{ratios['dp_fc_over_baseline_b']:.2f}** | {fc['test_accuracy']:.4f} | "
        f"{fc['epsilon']:.4f} | {fc['noise_multiplier']:.4f} |",
    ]
    data = result["data"]
    eigh = next(s["extra"] for s in r["stages"] if s["name"].startswith("reference: batched"))
    return "\n".join(
        [
            "# Scale benchmark: DP-LS and one epoch of DP-FC",
            "",
            f"n = {p['n']:,} training rows, d = {p['d']}, m = {p['classes']} classes, "
            f"{p['n_test']:,} test rows (synthetic, float32, memory-mapped, seed {p['seed']}); "
            f"ε = {TARGET_EPSILON:g}, δ = {TARGET_DELTA:g}, clip norm {CLIP_NORM:g}. "
            f"Chance accuracy {1 / p['classes']:.4f}.",
            "",
            *learners,
            "",
            "Baseline A = G = XᵀX pass + ClassIndex + class_grams for all classes (the products "
            "DP-LS needs). Baseline B = the same G pass + one pass of S = X Wᵀ and Sᵀ X (the "
            "products of one DP-FC epoch). All measured in the same run and process.",
            "",
            *rows,
            "",
            f"Reference: one eigendecomposition of a {p['d']}×{p['d']} matrix took "
            f"{eigh['seconds_per_matrix']:.4f} s (batch of {eigh['matrices']}); DP-LS does one "
            f"per class, about {eigh['extrapolated_to_all_classes_s']:.1f} s for all "
            f"{p['classes']} classes.",
            "",
            "The synthetic classes are well separated, so the accuracies only show that the "
            "private models work at this scale; they say nothing about how the learners compare "
            "(see the Fashion-MNIST results for that).",
            "",
            "max RSS is the process's running peak, including the touched pages of the memory "
            "map (file-backed); peak anon is the peak of the memory the process allocated "
            "itself during the stage (sampled every 20 ms).",
            "",
            f"Data: {data['bytes'] / 1e9:.2f} GB in `{data['dir']}`, "
            + (f"generated in {data['seconds']:.1f} s." if data["generated"] else "reused."),
            "",
            f"Machine: {mach['cpu_count']} CPUs, torch threads {mach['torch_num_threads']}, "
            f"{mach['memory_gb']:.0f} GB RAM, {mach['platform']}; torch {mach['torch']}, "
            f"numpy {mach['numpy']}, dpvision {mach['dpvision']}. Load average at start "
            f"{result['load_average_start']}, at end {result['load_average_end']}.",
            "",
            f"Date: {result['date']}. Total time {result['total_seconds']:.1f} s. Command:",
            "",
            f"    {result['command']}",
            "",
        ]
    )


MEMORY_LIMIT_MB = 4000  # the acceptance bound on the fit's peak RSS (4 GB)


def previous_full_run(out: Path, params: dict[str, Any]) -> dict[str, Any] | None:
    """The DP-LS stage of ``scale_feature_learners.json`` in ``out``, if on the same data."""
    try:
        previous = json.loads((out / f"{NAME}.json").read_text())
    except (OSError, ValueError):
        return None
    same = all(previous["parameters"].get(key) == params[key] for key in ("n", "d", "classes"))
    stage = next((s for s in previous["results"]["stages"] if s["name"] == "DP-LS fit"), None)
    if not same or stage is None:
        return None
    return {
        "date": previous["date"],
        "wall_s": stage["wall_s"],
        "max_rss_mb": stage["max_rss_mb"],
        "peak_anon_mb": stage["peak_anon_mb"],
    }


def memory_markdown(result: dict[str, Any]) -> str:
    """A short markdown report of a ``--memory-only dp-ls`` run."""
    p, r, mach = result["parameters"], result["results"], result["machine"]
    ls = r["dp_ls"]
    under = ls["max_rss_mb"] < MEMORY_LIMIT_MB
    lines = [
        "# Scale benchmark, memory: the DP-LS fit alone",
        "",
        f"n = {p['n']:,} training rows, d = {p['d']}, m = {p['classes']} classes, "
        f"{p['n_test']:,} test rows (synthetic, float32, read-only memory map "
        f'`np.load(..., mmap_mode="r")`, seed {p["seed"]}); '
        f"`DPLeastSquares(target_epsilon={TARGET_EPSILON:g}, target_delta={TARGET_DELTA:g}, "
        f"clip_norm={CLIP_NORM:g}).fit`, in a fresh child process.",
        "",
        "| wall s | CPU s (user + sys) | peak RSS MB (ru_maxrss) | VmHWM MB | peak anon MB | "
        "peak file MB | test accuracy | ε | σ |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {ls['wall_seconds']:.2f} | {ls['cpu_seconds']:.2f} "
        f"({ls['user_cpu_seconds']:.1f} + {ls['system_cpu_seconds']:.1f}) | "
        f"**{ls['max_rss_mb']:.0f}** | "
        f"{ls['vm_hwm_mb']:.0f} | {ls['peak_anon_mb']:.0f} | {ls['peak_file_mb']:.0f} | "
        f"{ls['test_accuracy']:.4f} | {ls['epsilon']:.4f} | {ls['noise_multiplier']:.4f} |",
        "",
        f"Peak RSS {ls['max_rss_mb']:.0f} MB is "
        + (f"**under** the {MEMORY_LIMIT_MB} MB bound." if under else "**over** the bound.")
        + f" The training features alone are {4 * p['n'] * p['d'] / 1e6:.0f} MB.",
        "",
        "peak RSS is the child's `ru_maxrss` right after the fit (before scoring); it counts "
        "the touched pages of the memory map (file-backed) as well as the memory the process "
        "allocated (anonymous). A spawned child's `ru_maxrss` is at least its parent's peak "
        f"at the spawn, here {r['parent_max_rss_mb_at_spawn']:.0f} MB; VmHWM is the peak RSS "
        "of the child's own address space. peak anon and peak file are the peaks of RssAnon "
        "and RssFile (which includes the loaded libraries), sampled every 20 ms during the "
        f"fit. Before the fit the child had {ls['before_fit_mb'].get('VmRSS', 0):.0f} MB "
        f"resident (libraries and interpreter); after it, "
        f"{ls['after_fit_mb'].get('RssFile', 0):.0f} MB file-backed.",
    ]
    if ls["other_processes_cpu_seconds"] is not None:
        lines += [
            "",
            f"Other processes used {ls['other_processes_cpu_seconds']:.0f} CPU seconds during "
            f"the fit's {ls['wall_seconds']:.0f} s (on average "
            f"{ls['other_processes_cpu_seconds'] / ls['wall_seconds']:.2f} of the "
            f"{mach['cpu_count']} CPUs): the wall time is only comparable between runs on an "
            "equally busy machine (the eigendecompositions suffer most from contention).",
        ]
    old = r.get("previous_full_run")
    if old is not None:
        lines += [
            "",
            f"For comparison, the DP-LS stage of the full benchmark of {old['date']} "
            "(`scale_feature_learners.md`; measured in one process after the baseline stages, "
            "so its max RSS is that process's running peak): "
            f"{old['wall_s']:.2f} s wall, max RSS {old['max_rss_mb']:.0f} MB, "
            f"peak anon {old['peak_anon_mb']:.0f} MB.",
        ]
    data = result["data"]
    lines += [
        "",
        f"Data: {data['bytes'] / 1e9:.2f} GB in `{data['dir']}`, "
        + (f"generated in {data['seconds']:.1f} s." if data["generated"] else "reused."),
        "",
        f"Machine: {mach['cpu_count']} CPUs, torch threads {ls['torch_num_threads']}, "
        f"{mach['memory_gb']:.0f} GB RAM, {mach['platform']}; torch {mach['torch']}, "
        f"numpy {mach['numpy']}, dpvision {mach['dpvision']}; thread environment "
        f"{mach['thread_env']}. Load average at start {result['load_average_start']}, at end "
        f"{result['load_average_end']}.",
        "",
        f"Date: {result['date']}. Code: commit {result['git_commit']}. "
        f"Total time {result['total_seconds']:.1f} s. Command:",
        "",
        f"    {result['command']}",
        "",
    ]
    return "\n".join(lines)


def git_commit() -> str | None:
    """The checked-out commit of this script's repository (``+dirty`` if files changed)."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if changed else "")


def write_memory_result(
    args: argparse.Namespace,
    params: dict[str, Any],
    machine: dict[str, Any],
    data_info: dict[str, Any],
    load_start: list[float],
) -> int:
    """Runs the ``--memory-only`` measurement and writes its JSON and markdown."""
    out = Path(args.out)
    results = run_memory_only(Path(args.data_dir), args.classes)
    results["previous_full_run"] = previous_full_run(out, params)
    result = {
        "name": MEMORY_NAME,
        "learner": args.memory_only,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "git_commit": git_commit(),
        "command": shlex.join(["python", *sys.argv]),
        "parameters": {
            **params,
            "target_epsilon": TARGET_EPSILON,
            "target_delta": TARGET_DELTA,
            "clip_norm": CLIP_NORM,
            "chunk_size": DEFAULT_CHUNK_SIZE,
            "memory_limit_mb": MEMORY_LIMIT_MB,
        },
        "machine": machine,
        "data": data_info,
        "results": results,
        "load_average_start": load_start,
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
        "total_seconds": time.perf_counter() - _START,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / f"{MEMORY_NAME}.json", json.dumps(result, indent=2) + "\n")
    write_text_atomic(out / f"{MEMORY_NAME}.md", memory_markdown(result))
    peak = results["dp_ls"]["max_rss_mb"]
    log(f"DP-LS peak RSS {peak:.0f} MB (bound {MEMORY_LIMIT_MB} MB); wrote {out}/{MEMORY_NAME}.*")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (defaults: the full 1.28M × 768, 1000-class benchmark)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=1_280_000, help="training rows")
    parser.add_argument("--d", type=int, default=768, help="feature dimension")
    parser.add_argument("--classes", type=int, default=1000, help="number of classes m")
    parser.add_argument("--n-test", type=int, default=50_000, help="held-out test rows")
    parser.add_argument("--data-dir", default="/tmp/dpvision-scale", help="generated data")
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results"), help="results folder"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    parser.add_argument(
        "--memory-only",
        choices=MEMORY_ONLY,
        help="run only this learner's fit, in a fresh child process, and write "
        f"{MEMORY_NAME}.{{json,md}} (peak resident memory of the fit alone)",
    )
    args = parser.parse_args(argv)
    if min(args.n, args.d, args.n_test) < 1 or args.classes < 2:
        parser.error("--n, --d and --n-test must be >= 1 and --classes >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    """Generates or reuses the data, runs every stage, writes the JSON and markdown."""
    args = parse_args(argv)
    load_start = [round(v, 2) for v in os.getloadavg()]
    machine = machine_info()
    log(
        f"machine: {machine['cpu_count']} CPUs, torch threads {machine['torch_num_threads']}, "
        f"load average {load_start}"
    )
    params = data_parameters(args)
    folder = Path(args.data_dir)
    data_info = {**ensure_dataset(folder, params), "dir": str(folder.resolve())}
    if args.memory_only:
        return write_memory_result(args, params, machine, data_info, load_start)
    results = run_stages(load_data(folder), args.classes, args.seed)
    result = {
        "name": NAME,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": shlex.join(["python", *sys.argv]),
        "parameters": {
            **params,
            "target_epsilon": TARGET_EPSILON,
            "target_delta": TARGET_DELTA,
            "clip_norm": CLIP_NORM,
            "chunk_size": DEFAULT_CHUNK_SIZE,
        },
        "machine": machine,
        "data": data_info,
        "results": results,
        "load_average_start": load_start,
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
        "total_seconds": time.perf_counter() - _START,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / f"{NAME}.json", json.dumps(result, indent=2) + "\n")
    write_text_atomic(out / f"{NAME}.md", markdown(result))
    ratios = results["ratios"]
    log(
        f"DP-LS / baseline A = {ratios['dp_ls_over_baseline_a']:.2f}, "
        f"DP-FC / baseline B = {ratios['dp_fc_over_baseline_b']:.2f}; wrote {out}/{NAME}.*"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
