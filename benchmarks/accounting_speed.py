"""What ε costs inside a training loop: ``get_epsilon`` after every few steps of one (σ, q).

A loop that shows ε in its progress bar asks for it after every step. Four ways to answer,
timed in the same run, one thread each, on the same schedule: a call after every
``--every`` steps of T steps of Poisson-sampled Gaussian noise (σ, q):

* ``dpvision``: ``PrivacyLedger.epsilon`` (PLD), with the step's PLD and transforms cached
  per (σ, q) (``dpvision.accounting.repeated``);
* ``dpvision after make_private``: the same, with the step prepared in a background thread
  by ``PrivacyEngine.make_private`` (``prepare_steps``) before the first call;
* ``dpvision before the cache``: dp-accounting's RDP accountant (to size the discretisation)
  and PLD accountant built afresh at each call, as dpvision computed ε before; the same ε
  up to round-off;
* ``Opacus PRV`` and ``Opacus RDP``: ``opacus.accountants``' ``step`` per step and
  ``get_epsilon(δ)`` at each call (Opacus' default accountant is PRV).

Each row: the first call, the median and the mean of the calls after it, the whole loop's
accounting time, and the last ε.

Run:  python benchmarks/accounting_speed.py   (about 3 minutes on 2 cores; needs opacus)
Results: benchmarks/results/accounting_speed.{json,md}
"""

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")  # one thread each, as the loop comparison

import argparse  # noqa: E402 (after the thread settings, which numpy reads on import)
import platform  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from dp_accounting import pld, rdp  # noqa: E402

from dpvision.accounting import PrivacyLedger, poisson_gaussian_event  # noqa: E402
from dpvision.accounting.accountants import (  # noqa: E402
    RDP_ORDERS,
    Accountant,
    _pld_interval,
    prepare_steps,
)
from dpvision.accounting.repeated import runs_epsilon, step_pld  # noqa: E402
from dpvision.fileio import write_json_atomic  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIGMA, RATE, DELTA = 1.0, 256 / 60000, 1e-5
"""The schedule: an MNIST-sized DP-SGD run (B 256 of 60 000), Opacus' example."""


def _dpvision() -> tuple[Callable[[int], None], Callable[[float], float]]:
    ledger = PrivacyLedger()

    def step(count: int) -> None:
        ledger.record(noise_multiplier=SIGMA, sample_rate=RATE, count=count, released="DP-SGD")

    return step, ledger.epsilon


def _prepared() -> tuple[Callable[[int], None], Callable[[float], float]]:
    """As after ``PrivacyEngine.make_private``, which prepares the step in a background
    thread while the first steps train (its time is not counted: it overlaps them)."""
    step_pld.cache_clear()
    runs_epsilon.cache_clear()
    prepare_steps(SIGMA, RATE, Accountant.PLD)
    for thread in threading.enumerate():
        if thread.name == "dpvision-accounting":
            thread.join()
    return _dpvision()


def _before() -> tuple[Callable[[int], None], Callable[[float], float]]:
    steps = [0]

    def step(count: int) -> None:
        steps[0] += count

    def epsilon(delta: float) -> float:
        event = poisson_gaussian_event(noise_multiplier=SIGMA, sample_rate=RATE, steps=steps[0])
        scale = rdp.RdpAccountant(list(RDP_ORDERS))
        scale.compose(event)
        accountant = pld.PLDAccountant(
            value_discretization_interval=_pld_interval(float(scale.get_epsilon(delta)))
        )
        accountant.compose(event)
        return float(accountant.get_epsilon(delta))

    return step, epsilon


def _opacus(kind: str) -> tuple[Callable[[int], None], Callable[[float], float]]:
    from opacus.accountants import PRVAccountant, RDPAccountant  # optional: the bench extra

    accountant = PRVAccountant() if kind == "prv" else RDPAccountant()

    def step(count: int) -> None:
        for _ in range(count):
            accountant.step(noise_multiplier=SIGMA, sample_rate=RATE)

    return step, lambda delta: float(accountant.get_epsilon(delta))


def _time(make: Callable[[], Any], steps: int, every: int) -> dict[str, Any]:
    step, epsilon = make()
    calls, value = [], 0.0
    for _ in range(steps // every):
        step(every)
        started = time.perf_counter()
        value = epsilon(DELTA)
        calls.append(time.perf_counter() - started)
    return {
        "first_ms": 1000 * calls[0],
        "median_ms": 1000 * statistics.median(calls[1:]),
        "mean_ms": 1000 * statistics.fmean(calls[1:]),
        "total_s": sum(calls),
        "calls": len(calls),
        "epsilon": value,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="T (default 2000)")
    parser.add_argument("--every", type=int, default=20, help="steps between calls")
    args = parser.parse_args()
    if args.steps < 2 * args.every or args.every < 1:
        parser.error("--steps must be at least twice --every, --every at least 1")
    ways: dict[str, Callable[[], Any]] = {
        "dpvision": _dpvision,
        "dpvision after make_private": _prepared,
        "dpvision before the cache": _before,
        "Opacus PRV": lambda: _opacus("prv"),
        "Opacus RDP": lambda: _opacus("rdp"),
    }
    rows, load_start = [], os.getloadavg()
    for name, make in ways.items():
        row = {"way": name, **_time(make, args.steps, args.every)}
        rows.append(row)
        print(
            f"{name}: first {row['first_ms']:.1f} ms, median {row['median_ms']:.1f} ms, "
            f"total {row['total_s']:.2f} s, ε {row['epsilon']:.4f}",
            flush=True,
        )
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "threads": 1,
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }
    setting = {"sigma": SIGMA, "sample_rate": RATE, "delta": DELTA, **vars(args)}
    write_json_atomic(
        RESULTS / "accounting_speed.json", {"machine": machine, "setting": setting, "rows": rows}
    )
    calls = rows[0]["calls"]
    lines = [
        "# What ε costs in a training loop (`benchmarks/accounting_speed.py`)",
        "",
        f"`get_epsilon(δ = {DELTA:g})` after every {args.every} of {args.steps} steps of "
        f"Poisson-sampled Gaussian noise, σ = {SIGMA:g}, q = 256/60000 ({calls} calls), each "
        "way in the same run, one thread; the time of the calls only (not the steps). "
        f"{platform.platform()}, {os.cpu_count()} CPUs, load average "
        f"{machine['load_average_start'][0]} at the start and "
        f"{machine['load_average_end'][0]} at the end (other work shares the CPUs: compare "
        f"the rows, which shared them alike); generated {time.strftime('%Y-%m-%d')}.",
        "",
        "| way | first call (ms) | median call after it (ms) | mean (ms) | all calls (s) "
        "| last ε |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['way']} | {row['first_ms']:.1f} | {row['median_ms']:.1f} | "
            f"{row['mean_ms']:.1f} | {row['total_s']:.2f} | {row['epsilon']:.4f} |"
        )
    lines += [
        "",
        "dpvision's first call builds the step's privacy loss distribution (dp-accounting's "
        "`from_gaussian_mechanism`) unless `PrivacyEngine.make_private` prepared it in the "
        "background while the first steps trained; later calls of the same (σ, q) reuse it "
        "and its Fourier transforms (`dpvision.accounting.repeated`). Its ε is dp-accounting's PLD "
        "accountant's up to round-off; Opacus' PRV and RDP are other accountants, so their ε "
        "differ.",
    ]
    (RESULTS / "accounting_speed.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
