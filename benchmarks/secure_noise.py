"""What the secure noise mode costs (``learner.secure_mode``, ``PrivacyEngine(secure_mode=True)``).

Three measurements, each the median of 5 repetitions, seeded generator and secure mode
timed in the same run on the same machine:

* drawing N(0, σ²) noise alone, 10⁶ and 10⁷ float32 values (``gaussian_noise``);
* one DP-SGD step (``DPSGDStep``: clipped sum of a Poisson batch, noise, update) of an MLP
  784-1024-1024-10 (1.86 M parameters) on a batch of 256;
* one DP-LS fit (``DPLeastSquares``) of 20 000 examples × 512 features, 10 classes (its
  noise: G, the 10 class Grams and b, 1.6 M numbers).

Run:  python benchmarks/secure_noise.py   (about a minute on 2 cores)
Results: benchmarks/results/secure_noise.{json,md}
"""

import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.accounting import PrivacyLedger
from dpvision.fileio import write_json_atomic
from dpvision.learners import DPLeastSquares
from dpvision.mechanisms import SecureRandom, gaussian_noise
from dpvision.training import DPSGDStep

RESULTS = Path(__file__).resolve().parent / "results"
REPEATS = 5


def _median_seconds(work: Callable[[], Any]) -> float:
    work()  # warm-up
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _noise(count: int, secure: bool) -> Callable[[], Any]:
    generator = SecureRandom() if secure else torch.Generator().manual_seed(0)
    return lambda: gaussian_noise(
        (count,), l2_sensitivity=1.0, noise_multiplier=1.0, generator=generator
    )


def _dpsgd_step(secure: bool) -> Callable[[], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 10)
    )
    step = DPSGDStep.build(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        sample_rate=0.01,
        num_examples=25_600,
        ledger=PrivacyLedger(),
        generator=SecureRandom() if secure else torch.Generator().manual_seed(0),
    )
    batch = (torch.randn(256, 784), torch.randint(0, 10, (256,)))
    return lambda: step([batch])


def _dp_ls(secure: bool) -> Callable[[], Any]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20_000, 512)).astype(np.float32)
    y = rng.integers(0, 10, 20_000)
    learner = DPLeastSquares(target_epsilon=1.0, num_classes=10, secure_mode=secure, random_state=0)
    return lambda: learner.fit(x, y)


def main() -> int:
    cases: dict[str, Callable[[bool], Callable[[], Any]]] = {
        "noise, 10⁶ values": lambda s: _noise(10**6, s),
        "noise, 10⁷ values": lambda s: _noise(10**7, s),
        "DP-SGD step, MLP 1.86 M parameters, batch 256": _dpsgd_step,
        "DP-LS fit, 20 000 × 512, 10 classes": _dp_ls,
    }
    rows = []
    for name, make in cases.items():
        seeded = _median_seconds(make(False))
        secure = _median_seconds(make(True))
        rows.append(
            {"case": name, "seeded_s": seeded, "secure_s": secure, "ratio": secure / seeded}
        )
        print(f"{name}: seeded {seeded:.4f} s, secure {secure:.4f} s", flush=True)
    machine = {
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    write_json_atomic(RESULTS / "secure_noise.json", {"machine": machine, "rows": rows})
    lines = [
        "# The cost of the secure noise mode (`benchmarks/secure_noise.py`)",
        "",
        f"Median of {REPEATS} runs, seeded generator and secure mode in the same run "
        f"({machine['threads']} threads, CPU, torch {machine['torch']}; generated "
        f"{time.strftime('%Y-%m-%d')}). Secure mode draws every random bit from the OS "
        "CSPRNG and sums four Box–Muller normals per value (`dpvision.mechanisms.secure`).",
        "",
        "| what | seeded (s) | secure (s) | secure / seeded |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['seeded_s']:.4f} | {row['secure_s']:.4f} | "
            f"{row['ratio']:.2f}× |"
        )
    (RESULTS / "secure_noise.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
