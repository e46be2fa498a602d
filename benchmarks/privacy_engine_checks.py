"""What PrivacyEngine's per-step checks cost: the mixing check and the loss gate.

Every recorded forward pass of :class:`~dpvision.privacy_engine.PrivateModule` is run once
more without gradients (example 0 changed, the pass's own random state) to refuse a model
that mixes examples at that step, and the gradient at the output goes through an
:class:`~dpvision.privacy_engine.loss.OutputGate`. This measures one logical step
(forward, backward, book-keeping clipping, noise, update) of ``make_private`` with both,
and with each patched away, in the same run on the same machine: the median of
``--repeats`` steps after two warm-up steps.

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
    """``all`` as shipped; ``no mixing check``; ``neither`` (gate passes gradients on)."""
    with contextlib.ExitStack() as stack:
        if which in ("no mixing check", "neither"):
            stack.enter_context(
                mock.patch.object(PrivateModule, "_check_rows_apart", return_value=None)
            )
        if which == "neither":

            def watch(self: OutputGate, output: Any, rows: int, pass_index: int) -> None:
                self.verified.add(pass_index)

            stack.enter_context(mock.patch.object(OutputGate, "watch", watch))
        yield


def _step_seconds(
    name: str, shape: tuple[int, ...], batch: int, device: str, repeats: int
) -> dict[str, float]:
    torch.manual_seed(0)
    n = batch * 4
    x, y = torch.randn(n, *shape), torch.randint(0, 10, (n,))
    times: dict[str, float] = {}
    for which in ("neither", "no mixing check", "all"):
        model = _build(name, shape).to(device)
        engine = PrivacyEngine()
        with checks(which):
            private, optimizer, _ = engine.make_private(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
            )
            optimizer.declare_sampling(batch / n)  # the same rows every step: timing only
            xb, yb = x[:batch].to(device), y[:batch].to(device)
            seconds = []
            for index in range(repeats + 2):
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                start = time.perf_counter()
                optimizer.zero_grad()
                F.cross_entropy(private(xb), yb).backward()
                optimizer.step()
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                if index >= 2:
                    seconds.append(time.perf_counter() - start)
        times[which] = statistics.median(seconds)
    return times


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
        "| model | input | batch | step, neither (s) | + loss gate | + mixing check (as "
        "shipped) | gate cost | mixing-check cost |",
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
        "from the pass's random state with example 0 changed); the loss gate compares the",
        "gradient at the output with softmax − one-hot, row by row.",
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
