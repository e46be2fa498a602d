"""ScatterNet extraction speed on CIFAR-10: dpvision's transform against kymatio's, one run.

Issue 51's target: the 60 000 CIFAR-10 images (J = 2, L = 8, order 2: 243 × 8 × 8 features)
in at most 3 minutes on 2 cores. Three timings, in the same process, on the same images
(the ``cifar10-jpeg`` copy, train then test):

* ``kymatio``: ``kymatio.scattering2d.frontend.torch_frontend.ScatteringTorch2D`` on the
  ImageNet-standardised images in batches of 256, which is what dpvision ran before
  (the transform alone; ``--reference-images`` of them, kymatio takes ~12 min for all);
* ``dpvision transform``: :func:`dpvision.features.scatternet.scatter` on the same images
  and batches, and the largest difference from kymatio's output;
* ``dpvision extraction``: :func:`dpvision.features.extract_features` on all ``--images``
  (uint8 to float, the transform, the flattened float32 matrix): what ``dpvision train``
  spends once before its features are cached.

Threads: the process's default (``torch.get_num_threads()``: every core). Each transform
is warmed on one batch first (filters built, FFT plans made).

Run:  DPVISION_DATA=... python benchmarks/scatternet_speed.py   (about 6 min on 2 cores)
Results: benchmarks/results/scatternet_speed.{json,md}
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from provenance import commit

from dpvision.data import load_dataset
from dpvision.features import FeatureSpec, extract_features
from dpvision.features.scatternet import IMAGENET_MEAN, IMAGENET_STD, scatter
from dpvision.fileio import write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 256
TARGET_SECONDS = 180.0
"""Issue 51: 60 000 CIFAR-10 images in at most 3 minutes on 2 cores."""


def _kymatio(images: torch.Tensor) -> torch.Tensor:
    """What dpvision ran before: kymatio's torch frontend on standardised RGB."""
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

    transform = ScatteringTorch2D(J=2, shape=tuple(images.shape[-2:]), L=8, max_order=2)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    out = [
        transform((images[i : i + BATCH] - mean) / std).flatten(1, 2)
        for i in range(0, len(images), BATCH)
    ]
    return torch.cat(out)


def _dpvision(images: torch.Tensor) -> torch.Tensor:
    return torch.cat([scatter(images[i : i + BATCH]) for i in range(0, len(images), BATCH)])


def _timed(function: Any, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    out = function(*args)
    return out, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=60000, help="images for the extraction")
    parser.add_argument(
        "--reference-images", type=int, default=10000, help="images for the kymatio comparison"
    )
    args = parser.parse_args()
    if not 1 <= args.reference_images <= args.images <= 60000:
        print(
            "scatternet_speed.py: need 1 <= --reference-images <= --images <= 60000",
            file=sys.stderr,
        )
        return 2
    data = load_dataset("cifar10-jpeg", download=False)
    pixels = np.concatenate([data.train_images, data.test_images])[: args.images]
    reference = torch.from_numpy(pixels[: args.reference_images]).permute(0, 3, 1, 2) / 255.0
    reference = reference.contiguous()
    for warm in (_kymatio, _dpvision):
        warm(reference[:BATCH])
    before, kymatio_seconds = _timed(_kymatio, reference)
    after, transform_seconds = _timed(_dpvision, reference)
    difference = float((before - after).abs().max())
    spec = FeatureSpec("scatternet")
    extract_features(pixels[:BATCH], spec)
    features, extraction_seconds = _timed(extract_features, pixels, spec)
    rows = [
        {
            "what": "kymatio (before)",
            "images": args.reference_images,
            "seconds": round(kymatio_seconds, 2),
            "images_per_second": round(args.reference_images / kymatio_seconds, 1),
        },
        {
            "what": "dpvision transform (after)",
            "images": args.reference_images,
            "seconds": round(transform_seconds, 2),
            "images_per_second": round(args.reference_images / transform_seconds, 1),
        },
        {
            "what": "dpvision extraction (after, uint8 to the float32 matrix)",
            "images": args.images,
            "seconds": round(extraction_seconds, 2),
            "images_per_second": round(args.images / extraction_seconds, 1),
        },
    ]
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads",
        "device": "cpu",
        "torch": torch.__version__,
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "dataset": "cifar10-jpeg",
        "features": list(features.shape[1:]),
        "speedup": round(kymatio_seconds / transform_seconds, 2),
        "max_abs_difference": difference,
        "sixty_thousand_seconds": round(extraction_seconds * 60000 / args.images, 1),
        "target_seconds": TARGET_SECONDS,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    write_json_atomic(RESULTS / "scatternet_speed.json", report)
    lines = [
        "# ScatterNet extraction speed (CIFAR-10, J = 2, L = 8, order 2)",
        "",
        f"Made by `benchmarks/scatternet_speed.py` on {report['machine']} (torch "
        f"{report['torch']}, commit {report['commit']}, {report['date']}), on the "
        "`cifar10-jpeg` copy; one run, every timing in the same process.",
        "",
        "| what | images | seconds | images/s |",
        "|---|---|---|---|",
        *(
            f"| {r['what']} | {r['images']} | {r['seconds']:.1f} | {r['images_per_second']:.0f} |"
            for r in rows
        ),
        "",
        f"- The transform is **{report['speedup']:.2f}×** kymatio's on the same images; the "
        f"largest difference between the two outputs is {difference:.1e} (float32 rounding).",
        f"- All 60 000 images: **{report['sixty_thousand_seconds'] / 60:.1f} min** "
        f"(target ≤ {TARGET_SECONDS / 60:.0f} min).",
        "- GPU: not measured here (no GPU was lent to the task that made this page); "
        "`tests/gpu` checks the transform on CUDA against kymatio's.",
    ]
    (RESULTS / "scatternet_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
