"""An Opacus training loop with only the import changed: dpvision's wall time against Opacus'.

The loop a practitioner writes from Opacus' tutorials: ``PrivacyEngine().make_private``
on a model, an SGD optimizer and a data loader, 15 epochs of forward, backward and
``optimizer.step()``, and ``privacy_engine.get_epsilon(δ)`` once per epoch for the log line.
The same code runs with ``from opacus import PrivacyEngine`` and with ``from dpvision import
PrivacyEngine``; each run is a fresh process with one torch thread, the two libraries taking
turns, ``--repeats`` runs each. Reported: the wall time of the loop (make_private to the last
``get_epsilon``), the part of it spent in ``get_epsilon``, and the last ε.

The data are the digits' 1 797 8×8 images (scikit-learn's copy, no download), 1 500 for
training; the model an MLP 64-256-256-10; B 64 (Poisson, q = 64/1500), σ 1.0, C 1.0, SGD
lr 0.1. Opacus' default accountant is PRV; dpvision's PLD (``"prv"`` is taken as ``pld``).

Run:  python benchmarks/opacus_loop.py   (about 4 minutes on 2 cores; needs opacus)
Results: benchmarks/results/opacus_loop.{json,md}
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
EPOCHS, BATCH, SIGMA, CLIP, LR, DELTA = 15, 64, 1.0, 1.0, 0.1, 1e-5


def one_run(library: str) -> dict[str, Any]:
    """The loop once, with ``library``'s PrivacyEngine (this process: one thread)."""
    import torch
    import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    if library == "opacus":
        from opacus import PrivacyEngine
    else:
        from dpvision import PrivacyEngine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x[:1500] / 16, dtype=torch.float32), torch.tensor(y[:1500]))
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    started = time.perf_counter()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
    )
    accounting, epsilon = 0.0, 0.0
    for _ in range(EPOCHS):
        for inputs, targets in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
        clock = time.perf_counter()
        epsilon = engine.get_epsilon(DELTA)
        accounting += time.perf_counter() - clock
    return {
        "library": library,
        "wall_seconds": time.perf_counter() - started,
        "accounting_seconds": accounting,
        "epsilon": float(epsilon),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each library")
    parser.add_argument("--one", choices=["dpvision", "opacus"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one)))
        return 0
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    runs: list[dict[str, Any]] = []
    load = os.getloadavg()
    for _ in range(args.repeats):
        for library in ("dpvision", "opacus"):
            done = subprocess.run(
                [sys.executable, __file__, "--one", library],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
    rows = []
    for library in ("dpvision", "opacus"):
        mine = [r for r in runs if r["library"] == library]
        walls = [r["wall_seconds"] for r in mine]
        rows.append(
            {
                "library": library,
                "wall_median_s": statistics.median(walls),
                "wall_min_s": min(walls),
                "wall_max_s": max(walls),
                "accounting_median_s": statistics.median(r["accounting_seconds"] for r in mine),
                "epsilon": mine[-1]["epsilon"],
            }
        )
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": 1,
        "load_average_start": [round(v, 2) for v in load],
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
    }
    out = {"machine": machine, "runs": runs, "rows": rows}
    (RESULTS / "opacus_loop.json").write_text(json.dumps(out, indent=1) + "\n")
    ratio = rows[0]["wall_median_s"] / rows[1]["wall_median_s"]
    lines = [
        "# An Opacus loop with only the import changed (`benchmarks/opacus_loop.py`)",
        "",
        f"{EPOCHS} epochs of the digits (1 500 images, MLP 64-256-256-10, B {BATCH} Poisson, "
        f"σ {SIGMA}, C {CLIP}, SGD lr {LR}), `get_epsilon({DELTA:g})` once per epoch; each "
        f"run a fresh process with one torch thread, the libraries taking turns, "
        f"{args.repeats} runs each. {platform.platform()}, {os.cpu_count()} CPUs, load "
        f"average {machine['load_average_start'][0]} at the start and "
        f"{machine['load_average_end'][0]} at the end; generated {time.strftime('%Y-%m-%d')}.",
        "",
        "| library | wall time, median (s) | min–max (s) | in get_epsilon, median (s) | last ε |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['library']} | {row['wall_median_s']:.2f} | {row['wall_min_s']:.2f}–"
            f"{row['wall_max_s']:.2f} | {row['accounting_median_s']:.2f} | "
            f"{row['epsilon']:.4f} |"
        )
    lines += [
        "",
        f"dpvision / Opacus wall time: **{ratio:.2f}×**. ε differ by accountant: dpvision's "
        "PLD, Opacus' PRV (both numerical accountants of the same steps).",
    ]
    (RESULTS / "opacus_loop.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
