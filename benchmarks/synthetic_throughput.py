"""Synthetic image throughput: images per second of each generator on one CPU thread.

The question: how long does DP-RandP Phase I wait for its synthetic images? For each kind of
:mod:`dpvision.data.synthetic` at 32×32 RGB (CIFAR-sized) and 28×28 grayscale
(Fashion-MNIST-sized), ``generate`` makes a block of images, timed from the call to its
return; each configuration is repeated ``--repeats`` times on different images of the same
stream (start = r·n) and the table shows the median rate. One thread: ``torch.set_num_threads
(1)`` (only ``oriented-filters`` uses torch) and ``OMP_NUM_THREADS=1`` etc. set before numpy
is imported, so the numbers are per core and generation can be spread over worker processes.

The block size n is at least ``--images`` (2000) and large enough for about ``--seconds`` (3)
of work per repeat, from a short untimed pilot run (which also warms up imports and caches).

``--previews`` also writes the preview grids that the documentation shows:
``docs/synthetic/<kind>.png`` (images 0–63 of seed 0, 32×32 RGB, 8 × 8) and
``docs/synthetic/dead-leaves-mixed-gray28.png`` (28×28 grayscale dead leaves). The images
are data-independent: they use no private data and cost no privacy.

Run (on a quiet machine; about two minutes):
    python benchmarks/synthetic_throughput.py --previews  # -> results/synthetic_throughput.*
Smoke run (small blocks; writes synthetic_throughput_quick.*, marked QUICK):
    python benchmarks/synthetic_throughput.py --quick
"""

import os

for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"  # before numpy and torch are imported

import argparse  # noqa: E402 (after the thread settings)
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dpvision.data.synthetic import SYNTHETIC_KINDS, generate, write_preview  # noqa: E402

NAME = "synthetic_throughput"
SHAPES = ((32, 3), (28, 1))  # (size, channels)
ROOT = Path(__file__).resolve().parents[1]
_START = time.perf_counter()


def log(message: str) -> None:
    """Prints one progress line to stderr, with the seconds since the script started."""
    print(f"[{time.perf_counter() - _START:8.1f} s] {message}", file=sys.stderr, flush=True)


def measure(kind: str, size: int, channels: int, args: argparse.Namespace) -> dict[str, Any]:
    """Times ``generate`` on one configuration: the pilot, then ``args.repeats`` blocks."""
    pilot_n = 20 if args.quick else 100
    started = time.perf_counter()
    generate(kind, pilot_n, size=size, channels=channels)
    pilot_rate = pilot_n / (time.perf_counter() - started)
    n = max(args.images, math.ceil(args.seconds * pilot_rate / 100) * 100)
    seconds = []
    for r in range(args.repeats):
        started = time.perf_counter()
        images = generate(kind, n, size=size, channels=channels, start=r * n)
        seconds.append(time.perf_counter() - started)
        assert images.shape == (n, size, size, channels)
    rates = [n / s for s in seconds]
    median = statistics.median(rates)
    log(f"{kind} {size}×{size}×{channels}: {median:,.0f} images/s (n = {n})")
    return {
        "kind": kind,
        "size": size,
        "channels": channels,
        "images_per_repeat": n,
        "seconds": seconds,
        "images_per_second": rates,
        "median_images_per_second": median,
        "min_images_per_second": min(rates),
        "max_images_per_second": max(rates),
        "seconds_per_100k": 100_000 / median,
    }


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or the platform's processor string)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(name: str) -> str:
    """The installed version of ``name``, or "not installed"."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, Any]:
    """The machine and library versions the numbers were measured with."""
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "dpvision": package_version("dpvision"),
    }


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def markdown(result: dict[str, Any]) -> str:
    """The markdown report of ``result``: one table over kinds and image shapes."""
    mach, p = result["machine"], result["parameters"]
    lines = ["# Synthetic image throughput (DP-RandP Phase I generators)", ""]
    if result["quick"]:
        lines += [
            "**QUICK SMOKE RUN (`--quick`): small blocks. These numbers only show that the "
            "benchmark runs; they are not a measurement.**",
            "",
        ]
    lines += [
        f"`dpvision.data.synthetic.generate` on one CPU thread (torch threads "
        f"{mach['torch_threads']}, OMP/MKL/OpenBLAS threads 1). Median of {p['repeats']} "
        f"timed blocks of n images (n ≥ {p['images']}, about {p['seconds']:g} s of work or "
        "more per block, after an untimed pilot block); uint8 NHWC output included. "
        "Data-independent images: no private data, no privacy cost.",
        "",
        "| kind | size | channels | images/s (median) | min–max images/s | n per block "
        "| time for 100 000 images |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['kind']} | {r['size']}×{r['size']} | {r['channels']} | "
            f"**{r['median_images_per_second']:,.0f}** | {r['min_images_per_second']:,.0f}–"
            f"{r['max_images_per_second']:,.0f} | {r['images_per_repeat']:,} | "
            f"{_duration(r['seconds_per_100k'])} |"
        )
    lines += [
        "",
        "Kinds: dead leaves (occluding squares, rotated squares, or a mix of circles, squares, "
        "rotated squares, rectangles, triangles and quadrilaterals; radii ∝ r^-3), a random "
        "untrained generator with oriented 3×3 filters (torch), and 1/f^α colour noise "
        "(Baradad et al. 2021). The time grows with the pixel count, and for dead leaves "
        "with the number of shapes needed to cover the image.",
        "",
        f"Machine: {mach['cpu_model']}, {mach['cpu_count']} CPUs (shared; one used), "
        f"{mach['platform']}; Python {mach['python']}, numpy {mach['numpy']}, torch "
        f"{mach['torch']}, dpvision {mach['dpvision']}. Load average at start "
        f"{result['load_average_start']}, at end {result['load_average_end']}.",
        "",
        f"Date: {result['date']}. Total time {result['total_seconds']:.1f} s. Command:",
        "",
        f"    {result['command']}",
        "",
    ]
    if result["previews"]:
        lines += ["Previews (seed 0, images 0–63):", ""]
        lines += [f"* `{path}`" for path in result["previews"]]
        lines.append("")
    return "\n".join(lines)


def write_text_atomic(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and a rename."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_previews(folder: Path) -> list[str]:
    """Writes one 8 × 8 grid per kind (32×32 RGB) and the 28×28 grayscale dead leaves."""
    written = []
    for kind in SYNTHETIC_KINDS:
        written.append(write_preview(kind, folder / f"{kind}.png", n=64, size=32, channels=3))
    written.append(
        write_preview(
            "dead-leaves-mixed",
            folder / "dead-leaves-mixed-gray28.png",
            n=64,
            size=28,
            channels=1,
        )
    )
    for path in written:
        log(f"wrote {path}")
    return [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in written]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (defaults: the full benchmark, no previews)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--images", type=int, help="smallest block per repeat (default 2000)")
    parser.add_argument(
        "--seconds", type=float, help="least work per repeat in seconds (default 3)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed blocks per row")
    parser.add_argument("--kinds", help=f"comma-separated kinds from {', '.join(SYNTHETIC_KINDS)}")
    parser.add_argument("--quick", action="store_true", help="small blocks, _quick files")
    parser.add_argument(
        "--previews", action="store_true", help="also write the preview PNGs into --docs"
    )
    parser.add_argument(
        "--no-timing", action="store_true", help="only write the previews (with --previews)"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results")
    parser.add_argument("--docs", default=str(ROOT / "docs" / "synthetic"), help="previews")
    args = parser.parse_args(argv)
    if args.images is None:
        args.images = 50 if args.quick else 2000
    if args.seconds is None:
        args.seconds = 0.1 if args.quick else 3.0
    if args.images < 1 or args.seconds < 0 or args.repeats < 1:
        parser.error("--images and --repeats must be >= 1 and --seconds >= 0")
    if args.no_timing and not args.previews:
        parser.error("--no-timing without --previews does nothing")
    if args.kinds is None:
        args.kinds = SYNTHETIC_KINDS
    else:
        chosen = [k.strip() for k in args.kinds.split(",") if k.strip()]
        unknown = sorted(set(chosen) - set(SYNTHETIC_KINDS))
        if unknown:
            parser.error(
                f"--kinds: unknown {', '.join(unknown)}; from {', '.join(SYNTHETIC_KINDS)}"
            )
        args.kinds = tuple(k for k in SYNTHETIC_KINDS if k in chosen)
    return args


def main(argv: list[str] | None = None) -> int:
    """Writes the previews (with ``--previews``), times every kind, writes JSON and markdown."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    previews = write_previews(Path(args.docs)) if args.previews else []
    if args.no_timing:
        return 0
    load_start = [round(v, 2) for v in os.getloadavg()]
    machine = machine_info()
    log(f"{machine['cpu_model']}, {machine['cpu_count']} CPUs, load average {load_start}")
    rows = [measure(kind, size, channels, args) for kind in args.kinds for size, channels in SHAPES]
    name = NAME + ("_quick" if args.quick else "")
    result = {
        "name": name,
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": shlex.join(["python", *sys.argv]),
        "parameters": {
            "images": args.images,
            "seconds": args.seconds,
            "repeats": args.repeats,
            "seed": 0,
            "threads": 1,
        },
        "machine": machine,
        "rows": rows,
        "previews": previews,
        "load_average_start": load_start,
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
        "total_seconds": time.perf_counter() - _START,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / f"{name}.json", json.dumps(result, indent=2) + "\n")
    report = markdown(result)
    write_text_atomic(out / f"{name}.md", report)
    print(report)
    log(f"wrote {out}/{name}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
