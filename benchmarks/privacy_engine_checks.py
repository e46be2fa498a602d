"""What PrivacyEngine's per-step checks cost: the mixing check, the loss gate and the
check of each step against the loader's chunk.

Every recorded forward pass of :class:`~dpvision.privacy_engine.PrivateModule` is run once
more without gradients (two examples changed, the pass's own random state) to refuse a model
that mixes examples at that step, and the gradient at the output goes through an
:class:`~dpvision.privacy_engine.loss.OutputGate`. This measures one logical step
(forward, backward, book-keeping clipping, noise, update) of ``make_private`` with both,
and with each patched away, in the same run on the same machine: the median of
``--repeats`` steps after two warm-up steps, the three settings taking turns step by step.

Run:  python benchmarks/privacy_engine_checks.py [--device cuda] [--out DIR]
      (about a minute on 2 CPU cores)
Results: benchmarks/results/privacy_engine_checks_<device>.{json,md}
"""

import argparse
import contextlib
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpvision import PrivacyEngine
from dpvision.fileio import write_json_atomic
from dpvision.models.registry import build_model
from dpvision.privacy_engine.loss import OutputGate
from dpvision.privacy_engine.module import PrivateModule
from dpvision.privacy_engine.optimizer import Chunk

RESULTS = Path(__file__).resolve().parent / "results"
# (model, input shape, batch size on the CPU, on a GPU)
CASES = (
    ("wrn-10-1", (3, 32, 32), 64, 512),
    ("vit-4x4-d128-l4", (3, 32, 32), 32, 256),
)


class TinyViT(nn.Module):
    """Patches of 4×4, width 128, 4 encoder layers (no dropout), a class-token-free mean."""

    def __init__(self, classes: int = 10, width: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, width, 4, stride=4)
        self.position = nn.Parameter(torch.zeros(1, 64, width))
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2) + self.position
        return self.head(self.encoder(tokens).mean(1))


def _build(name: str, shape: tuple[int, ...]) -> nn.Module:
    return TinyViT() if name.startswith("vit") else build_model(name, shape, 10)


@contextlib.contextmanager
def checks(which: str) -> Iterator[None]:
    """``all`` as shipped; ``no mixing check``; ``neither`` (no mixing check, the gradient
    at the output passed on unchecked, no check of the step against the loader's chunk)."""
    with contextlib.ExitStack() as stack:
        if which in ("no mixing check", "neither"):
            stack.enter_context(
                mock.patch.object(PrivateModule, "_check_rows_apart", return_value=None)
            )
        if which == "neither":

            def gated(self: OutputGate, output: Any, rows: int, pass_index: int) -> Any:
                self.verified.add(pass_index)
                return output

            stack.enter_context(mock.patch.object(OutputGate, "gated", gated))
            stack.enter_context(mock.patch.object(Chunk, "check", return_value=None))
        yield


def _step_seconds(
    name: str, shape: tuple[int, ...], batch: int, device: str, repeats: int
) -> dict[str, float]:
    """Median seconds of one step in each of the three settings, interleaved step by step
    so that the machine's drift falls on all three alike."""
    torch.manual_seed(0)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    settings = ("neither", "no mixing check", "all")
    runs = {}
    for which in settings:
        model = _build(name, shape).to(device)
        with checks(which):
            private, optimizer, loader = PrivacyEngine().make_private(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
            )  # q = 1: every logical batch is the same `batch` examples
        runs[which] = (private, optimizer, loader)
    seconds: dict[str, list[float]] = {which: [] for which in settings}
    for index in range(repeats + 2):
        for which in settings:
            private, optimizer, loader = runs[which]
            with checks(which):
                for xb, yb in loader:
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    optimizer.zero_grad()
                    F.cross_entropy(private(xb.to(device)), yb.to(device)).backward()
                    optimizer.step()
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    if index >= 2:
                        seconds[which].append(time.perf_counter() - start)
    return {which: statistics.median(seconds[which]) for which in settings}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    where = torch.cuda.get_device_name(args.device) if gpu else platform.processor() or "cpu"
    rows = []
    for name, shape, cpu_batch, gpu_batch in CASES:
        batch = gpu_batch if gpu else cpu_batch
        times = _step_seconds(name, shape, batch, args.device, args.repeats)
        rows.append(
            {
                "model": name,
                "input": "x".join(map(str, shape)),
                "batch": batch,
                "seconds": times,
                "mixing_check_cost": times["all"] / times["no mixing check"] - 1,
                "gate_cost": times["no mixing check"] / times["neither"] - 1,
            }
        )
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    stem = f"privacy_engine_checks_{'cuda' if gpu else 'cpu'}"
    payload = {
        "device": where,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    write_json_atomic(out / f"{stem}.json", payload)
    lines = [
        "# PrivacyEngine's per-step checks: what they cost",
        "",
        f"`python benchmarks/privacy_engine_checks.py --device {args.device}` on {where} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads); one logical step of "
        f"`make_private` (forward, backward, clipping, noise, update), median of {args.repeats}.",
        "",
        "| model | input | batch | step, no checks (s) | + loss gate and chunk check | + mixing "
        "check (as shipped) | gate + chunk cost | mixing-check cost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s = row["seconds"]
        lines.append(
            f"| {row['model']} | {row['input']} | {row['batch']} | {s['neither']:.4f} | "
            f"{s['no mixing check']:.4f} | {s['all']:.4f} | {100 * row['gate_cost']:+.1f} % | "
            f"{100 * row['mixing_check_cost']:+.1f} % |"
        )
    lines += [
        "",
        "The mixing check is one forward pass without gradients per step (the model run again",
        "from the pass's random state with two examples changed); the loss gate compares the",
        "gradient at the output with softmax − one-hot, row by row; the chunk check compares",
        "each input row's size and the labels with the loader's. Timed from the batch in",
        "hand to the end of the step (the loader's sampling not included).",
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
