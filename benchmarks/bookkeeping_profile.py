"""Where book-keeping's time goes: one micro-batch, phase by phase and layer kind by kind.

The DP-SGD speed benchmark (``dpsgd_speed.py``) gives the ratio of a private step to a
non-private one; this script says which part of the private step costs what. For one
micro-batch of ``--batch`` examples with ``--views`` K views, it times the non-private
forward + backward, then book-keeping's phases: the forward with the activation tape, the
backward to the layer outputs, each rule's per-example terms (grouped by layer type and
output shape) and each rule's clipped sum. Median of ``--repeats`` runs after one warm-up.

    python benchmarks/bookkeeping_profile.py --model wrn-16-4 --views 4
    # -> benchmarks/results/bookkeeping_profile_wrn-16-4_k4.{json,md}
"""

import argparse
import json
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dpsgd_speed import build_model, write_text_atomic

from dpvision.per_example.layers import layer_terms
from dpvision.per_example.tape import ActivationTape


def _shape(calls: list) -> str:
    grad = calls[0][1]
    grad = grad if isinstance(grad, torch.Tensor) else next(iter(grad.values()))
    return "×".join(str(v) for v in grad.shape[1:])


def profile_once(model, x, y, views: int) -> dict[str, float]:
    """Seconds per phase of one book-keeping pass (terms and sums per layer kind)."""
    times: dict[str, float] = defaultdict(float)
    batch = x.shape[0] // views
    tape = ActivationTape(model, mode="edges")
    started = time.perf_counter()
    with tape.attached():
        losses = F.cross_entropy(model(x), y, reduction="none")
        times["forward (with the tape)"] = time.perf_counter() - started
        started = time.perf_counter()
        grads = torch.autograd.grad(losses.sum() / views, tape.edges, allow_unused=True)
        tape.set_edge_grads(grads)
        times["backward to the layer outputs"] = time.perf_counter() - started
        terms = []
        for _, module, calls in tape.calls():
            key = f"{type(module).__name__} {_shape(calls)}"
            started = time.perf_counter()
            with tape.paused():
                terms.append((key, layer_terms(module, calls, views)))
            times[f"terms: {key}"] += time.perf_counter() - started
        scale = torch.ones(batch)
        for key, layer in terms:
            started = time.perf_counter()
            layer.clipped_sum(scale, None)
            times[f"clipped sum: {key}"] += time.perf_counter() - started
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="wrn-16-4", help="a dpsgd_speed.py model name")
    parser.add_argument("--views", type=int, default=1, help="K views per example")
    parser.add_argument("--batch", type=int, default=64, help="examples in the micro-batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    if min(args.views, args.batch, args.repeats, args.threads) < 1:
        parser.error("--views, --batch, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(args.model)
    shape = (1, 28, 28) if args.model == "tanh-cnn" else (3, 32, 32)
    x = torch.randn(args.batch * args.views, *shape)
    y = torch.randint(0, 10, (args.batch * args.views,))

    def non_private() -> float:
        started = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    non_private()
    profile_once(model, x, y, args.views)
    plain = statistics.median(non_private() for _ in range(args.repeats))
    runs = [profile_once(model, x, y, args.views) for _ in range(args.repeats)]
    phases = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    total = sum(phases.values())
    result = {
        "model": args.model,
        "views": args.views,
        "batch": args.batch,
        "threads": args.threads,
        "repeats": args.repeats,
        "non_private_seconds": plain,
        "bookkeeping_seconds": total,
        "ratio": total / plain,
        "phases": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": shlex.join(["python", *sys.argv]),
        "torch": torch.__version__,
    }
    lines = [
        f"# Book-keeping profile: {args.model}, B = {args.batch}, K = {args.views}",
        "",
        f"One micro-batch, median of {args.repeats} runs after a warm-up, "
        f"{args.threads} torch threads. Non-private forward + backward: "
        f"{plain:.3f} s. Book-keeping, all phases: {total:.3f} s "
        f"(**{total / plain:.2f}×**; without the noise and the optimizer step).",
        "",
        "| phase | s | share |",
        "|---|---:|---:|",
        *(f"| {k} | {v:.3f} | {v / total:.0%} |" for k, v in result["phases"].items()),
        "",
        f"Date: {result['date']}; torch {torch.__version__}. Command:",
        "",
        f"    {result['command']}",
        "",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"bookkeeping_profile_{args.model}_k{args.views}"
    write_text_atomic(out / f"{name}.json", json.dumps(result, indent=2) + "\n")
    write_text_atomic(out / f"{name}.md", "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
