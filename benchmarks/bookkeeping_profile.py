"""Where a private step's time goes: the phases of one DP-SGD step under ``torch.profiler``.

The DP-SGD speed benchmark (``dpsgd_speed.py``) gives the ratio of a private step to a
non-private one; this script says which part of the private step costs what. For each model
(and ``--precision``), it runs the real :class:`~dpvision.training.DPSGDStep` (book-keeping
clipping) and a plain SGD step on the same batch under ``torch.profiler`` and reads the
phases the code labels (:mod:`dpvision.profiling`): the forward with the activation tape, the
backward to the layer outputs, the per-example norms of each layer kind, the clip factors,
the clipped sum of each layer kind, the noise and the optimizer. A phase's time is its
operators' own time (on CUDA: the GPU time of the kernels they launched), each operator
counted in the innermost phase open when it started (operators outside every phase: the
loss, the tape's hooks); the shares are scaled to the step time measured without the
profiler, which slows small operators more than large ones.

    python benchmarks/bookkeeping_profile.py --model vit-6 convnext-4 --batch 32
    python benchmarks/bookkeeping_profile.py --model timm:vit_small_patch16_224 --batch 4 \\
        --precision bf16
    # -> benchmarks/results/bookkeeping_profile_<device>_<precision>.{json,md}

Models: the ``dpsgd_speed.py`` names (``tanh-cnn``, ``wrn-16-4``, ``vit-6``, ``convnext-4``)
and ``timm:NAME`` at 3×224×224 (random weights, BatchNorm replaced by GroupNorm; needs the
models extra).
"""

import argparse
import bisect
import json
import shlex
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dpsgd_speed import build_model, device_slug, write_text_atomic

from dpvision.accounting import PrivacyLedger
from dpvision.training import DPSGDStep

try:
    from dpvision.profiling import PREFIX
except ImportError:  # a dpvision before the phases were labelled: the ratio alone
    PREFIX = "dpvision::"

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def model_for(name: str, device: str) -> torch.nn.Module:
    """A ``dpsgd_speed.py`` model (``timm:NAME`` at 224², BatchNorm → GroupNorm)."""
    return build_model(name).to(device)


def input_shape(name: str) -> tuple[int, int, int]:
    if name == "tanh-cnn":
        return (1, 28, 28)
    return (3, 224, 224) if name.startswith("timm:") else (3, 32, 32)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _labelled(name: str) -> Any:
    return torch.profiler.record_function(PREFIX + name)


def steps(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    views: int,
    precision: torch.dtype | None,
) -> dict[str, Callable[[], None]]:
    """The non-private and the private step on the same batch (same phase labels)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step the same
    flat = x.flatten(0, 1) if views > 1 else x
    labels = y.repeat_interleave(views) if views > 1 else y
    cast = torch.autocast(x.device.type, dtype=precision, enabled=precision is not None)

    def non_private() -> None:
        with _labelled("forward"), cast:
            out = model(flat)
        loss = F.cross_entropy(out.float(), labels)
        with _labelled("backward"):
            loss.backward()
        with _labelled("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    engine = DPSGDStep.build(
        model=model,
        optimizer=optimizer,
        loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="none"),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        sample_rate=len(x) / 50_000,
        num_examples=50_000,
        ledger=PrivacyLedger(),
        generator=torch.Generator(device=x.device).manual_seed(0),
        views=views > 1,
        method="bookkeeping",
        precision=precision,
    )
    return {"non-private": non_private, "dpvision": lambda: engine([(x, y)])}


def timed(step: Callable[[], None], device: torch.device) -> float:
    """Seconds of one step (synchronised on CUDA)."""
    _sync(device)
    started = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - started


def phases(step: Callable[[], None], device: torch.device, repeats: int) -> dict[str, float]:
    """Seconds per step of each ``dpvision::`` phase, over ``repeats`` profiled steps.

    Every operator's own time (CPU time, or on CUDA the GPU time of the kernels it
    launched) goes to the innermost phase open when it started, on any thread: phases run
    inside the backward pass (the layers' norms, computed as their gradients arrive, on the
    autograd engine's thread on CUDA) are not counted in the backward.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = device.type == "cuda"
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(repeats):
            step()
        _sync(device)
    events = prof.events()
    ranges = sorted(
        (e.time_range.start, e.time_range.end, e.name.removeprefix(PREFIX))
        for e in events
        if e.name.startswith(PREFIX)
    )
    starts = [start for start, _, _ in ranges]
    seconds: dict[str, float] = defaultdict(float)
    for event in events:
        if event.name.startswith(PREFIX):
            continue
        micro = event.self_device_time_total if cuda else event.self_cpu_time_total
        if not micro:
            continue
        at = event.time_range.start
        phase = "unlabelled (loss, hooks)"
        for index in range(bisect.bisect_right(starts, at) - 1, -1, -1):
            start, end, name = ranges[index]
            if start <= at < end:  # the innermost open phase
                phase = name
                break
        seconds[phase] += micro / 1e6 / repeats
    return dict(seconds)


def profile(args: argparse.Namespace, name: str, precision: str) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = model_for(name, args.device)
    shape = input_shape(name)
    views = (args.views,) if args.views > 1 else ()
    x = torch.randn(args.batch, *views, *shape, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    result: dict[str, Any] = {"model": name, "precision": precision, "input": list(shape)}
    rows = steps(model, x, y, args.views, PRECISIONS[precision])
    peaks: dict[str, float | None] = {}
    for row, step in rows.items():
        step()  # warm-up (the first private call also verifies the layout and gradients)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            step()
            peaks[row] = torch.cuda.max_memory_allocated(device) / 2**30
        else:
            peaks[row] = None
    # The rows' steps alternate, so that a machine's drift slows both alike.
    times: dict[str, list[float]] = {row: [] for row in rows}
    for _ in range(args.repeats):
        for row, step in rows.items():
            times[row].append(timed(step, device))
    for row, step in rows.items():
        seconds = statistics.median(times[row])
        phases(step, device, 1)  # the profiler's own first-use cost, not counted
        parts = phases(step, device, args.repeats)
        # The profiler slows small operators more than large ones: its shares, scaled to
        # the step time measured without it.
        profiled = sum(parts.values())
        parts = {name: value * seconds / profiled for name, value in parts.items()}
        result[row] = {
            "seconds": seconds,
            "phases": dict(_descending(parts)),
            "peak_gib": peaks[row],
        }
    result["ratio"] = result["dpvision"]["seconds"] / result["non-private"]["seconds"]
    return result


def _group(key: str) -> str:
    """The phase family of a key: ``norms[Linear]`` → ``norms``."""
    return key.split("[", 1)[0]


def _descending(values: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(values.items(), key=lambda kv: -kv[1])


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"# Book-keeping profile: {meta['device_name']}, {meta['precision']}",
        "",
        f"One micro-batch of B = {meta['batch']} examples (K = {meta['views']}), median of "
        f"{meta['repeats']} timed steps after a warm-up, the two rows' steps alternating; "
        f"phases from `torch.profiler` over {meta['repeats']} more steps ({meta['clock']}). "
        "A step is forward, backward, clipping, noise and the optimizer (SGD). Each phase "
        "is its share of the profiled step times the step time measured without the "
        "profiler; '× non-private step' is that time over the whole non-private step, so "
        "the private row's phases add up to its ratio.",
        "",
    ]
    for result in results:
        if "error" in result:
            lines += [f"## {result['model']}", "", f"Failed: {result['error']}", ""]
            continue
        plain, private = result["non-private"], result["dpvision"]
        base = plain["seconds"]
        lines += [
            f"## {result['model']}, {'×'.join(map(str, result['input']))}",
            "",
            f"Non-private step {base:.4f} s; dpvision {private['seconds']:.4f} s "
            f"(**{result['ratio']:.2f}×**).",
            "",
            "| phase | non-private s | dpvision s | dpvision × non-private step |",
            "|---|---:|---:|---:|",
        ]
        keys = list(private["phases"])
        keys += [k for k in plain["phases"] if k not in keys]
        for key in keys:
            a, b = plain["phases"].get(key), private["phases"].get(key)
            cells = [f"{a:.4f}" if a is not None else "", f"{b:.4f}" if b is not None else ""]
            share = f"{b / base:.3f}" if b is not None else ""
            lines.append(f"| {key} | {cells[0]} | {cells[1]} | {share} |")
        families: dict[str, float] = defaultdict(float)
        for key, value in private["phases"].items():
            families[_group(key)] += value
        lines += [
            "",
            "By family (× non-private step): "
            + ", ".join(f"{k} {v / base:.2f}" for k, v in _descending(families))
            + ".",
            "",
        ]
        if plain["peak_gib"] is not None:
            lines += [
                f"Peak GPU memory: non-private {plain['peak_gib']:.2f} GiB, dpvision "
                f"{private['peak_gib']:.2f} GiB.",
                "",
            ]
    lines += [f"Machine: {meta['machine']}. Date: {meta['date']}. Command:", ""]
    lines += [f"    {meta['command']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["wrn-16-4", "vit-6", "convnext-4"])
    parser.add_argument("--views", type=int, default=1, help="K views per example")
    parser.add_argument("--batch", type=int, default=32, help="examples in the micro-batch")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), nargs="+", default=["fp32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--name", default=None, help="result file stem (default from device)")
    args = parser.parse_args(argv)
    if min(args.views, args.batch, args.repeats, args.threads) < 1:
        parser.error("--views, --batch, --repeats and --threads must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    device_name = f"CPU, {args.threads} threads"
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for precision in args.precision:
        results = []
        for name in args.model:
            try:
                results.append(profile(args, name, precision))
            except Exception as error:  # reported in the table, the other models still run
                results.append({"model": name, "precision": precision, "error": str(error)})
        meta = {
            "device_name": device_name,
            "precision": precision,
            "batch": args.batch,
            "views": args.views,
            "repeats": args.repeats,
            "clock": "GPU kernel time" if device.type == "cuda" else "operators' CPU time",
            "machine": f"torch {torch.__version__}, {device_name}",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": shlex.join(["python", *sys.argv]),
        }
        stem = args.name or f"bookkeeping_profile_{device_slug(device_name)}"
        name = f"{stem}_{precision}"
        write_text_atomic(
            out / f"{name}.json", json.dumps({"meta": meta, "results": results}, indent=2) + "\n"
        )
        text = markdown(results, meta)
        write_text_atomic(out / f"{name}.md", text)
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
