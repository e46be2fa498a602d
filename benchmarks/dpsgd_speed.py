"""DP-SGD speed benchmark: time per logical step and peak memory, private vs non-private.

The question: what does privacy cost per training step, and how do dpvision's clipping paths
compare with Opacus on the same work? Every row of a configuration runs the *same* logical
step (same architecture and initialisation, same batch, C = 1, σ = 1, plain SGD without
momentum), timed from the first forward pass to the end of ``optimizer.step()``: forward,
backward, per-example clipping, noise, update. The rows of a configuration are measured in
the same run, so their ratio to the non-private row depends much less on the machine than
seconds do.

Rows (``ROWS``):

* ``non-private``: forward, mean cross-entropy over all input rows, backward, SGD step.
* ``dpvision-bookkeeping``: :class:`dpvision.training.DPSGDStep` with
  ``clipping="bookkeeping"`` (:mod:`dpvision.per_example.bookkeeping`). Where that module is
  missing or fails to import, the row is "not available" with the error: never a number.
* ``dpvision-vmap``: DPSGDStep with ``clipping="vmap"``: ``torch.func`` per-example gradients
  (:func:`dpvision.training.clipped_gradient_sum`).
* ``opacus-hooks``: Opacus ``PrivacyEngine.make_private(grad_sample_mode="hooks")``,
  GradSampleModule hooks and DPOptimizer.
* ``opacus-ghost``: the same with ``grad_sample_mode="ghost"`` (ghost clipping: two backward
  passes, per-example norms without per-example gradients), where Opacus has it.

With augmentation multiplicity K > 1 (inputs (B, K, C, H, W)), the dpvision rows clip each
*example's* gradient averaged over its K views (De et al. 2022). Opacus has no equivalent (it
clips each input row), so its rows are "not supported"; two extra rows,
``opacus-*-views-as-examples``, time Opacus on the B·K views as B·K separate examples. That is
a *different computation* (each view is clipped on its own, so one example moves the sum by
up to K·C): it is listed for scale only and has no ratio in the comparison. The non-private
row with K views runs forward and backward on all B·K rows.

Configurations (``--only cnn|wrn``):

* ``cnn``: Fashion-MNIST Tanh CNN, ``tanh_cnn((1, 28, 28))``, B = 2048, one micro-batch.
* ``wrn-k1``, ``wrn-k4``: WRN-16-4 (GroupNorm, WSConv) on 3×32×32, B = 256, K ∈ {1, 4}. Each
  logical batch is split into micro-batches of ``--wrn-physical-batch`` examples (a memory
  knob; identical for every row, and recorded in the output), with one noise draw and one
  optimizer step per logical batch.

Inputs are random tensors (timing does not depend on the pixel values). q = B/N with the
dataset's N (60 000 or 50 000), so the division by qN is by B.

Method: each row runs in its own child process (so rows cannot share caches or memory), does
``--warmup`` untimed steps, then ``--steps`` timed steps; the table shows the median. Peak
memory on CPU is the child's ``ru_maxrss`` (read by the parent with ``os.wait4``), shown with
the child's resident memory just before its first step (after imports, model and data), so
the difference is what the step itself added. On CUDA it is ``torch.cuda.max_memory_allocated``
over the steps. ``--no-isolation`` runs every row in this process instead (faster, for smoke
tests): CPU peaks are then the process's running peak and are marked as not per row.

* ``timm`` (``--only timm``, needs the models extra): timm's ``vit_small_patch16_224``,
  ``convnext_tiny`` and ``resnet50`` (BatchNorm → GroupNorm) at 3×224×224, B = 8 on the CPU.
* ``gpu`` (``--only gpu``, for an accelerator): the seed-003 setting of Table 13, WRN-16-4
  on 3×32×32 at B = 4096 with K = 16 views, the ViT and ConvNeXt models at B = 1024 and
  the three timm models at 3×224×224, B = 256 (reported as not available without timm); with
  ``--physical-batch auto`` (its default) each row probes the largest micro-batch that fits
  (halving from B on out-of-memory; recorded per row). The WRN row also shows the projected
  wall time of the full run (875 logical steps). The result files are named after the device
  (``dpsgd_speed_gpu_<device>.*``), and the report states the targets (≤ 1.3× non-private,
  faster than Opacus) and whether each configuration meets them.

``--precision bf16`` runs forward and backward of every row under autocast (dpvision keeps
per-example norms, clipping and noise in float32; Opacus rows get the same autocast).

Run (on a quiet machine; several minutes per WRN row on 2 CPU cores):
    python benchmarks/dpsgd_speed.py                    # -> benchmarks/results/dpsgd_speed.*
    python benchmarks/dpsgd_speed.py --device cuda --wrn-physical-batch 256
The accelerator table (one command; run it where a GPU is):
    python benchmarks/dpsgd_speed.py --only gpu --device cuda  # -> dpsgd_speed_gpu_<gpu>.*
Smoke run (tiny models, 2 steps; writes dpsgd_speed_quick.*, marked QUICK):
    python benchmarks/dpsgd_speed.py --quick
"""

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)

NAME = "dpsgd_speed"
MAX_GRAD_NORM = 1.0  # C
NOISE_MULTIPLIER = 1.0  # σ; its value does not change the work
LEARNING_RATE = 0.1
SEED = 0

NON_PRIVATE = "non-private"
ROWS = (
    NON_PRIVATE,
    "dpvision-bookkeeping",
    "dpvision-vmap",
    "opacus-hooks",
    "opacus-ghost",
    "opacus-hooks-views-as-examples",
    "opacus-ghost-views-as-examples",
)
LABELS = {
    NON_PRIVATE: "non-private SGD",
    "dpvision-bookkeeping": "dpvision, book-keeping clipping",
    "dpvision-vmap": "dpvision, torch.func vmap",
    "opacus-hooks": "Opacus hooks",
    "opacus-ghost": "Opacus ghost clipping",
    "opacus-hooks-views-as-examples": "Opacus hooks, B·K views as examples (different)",
    "opacus-ghost-views-as-examples": "Opacus ghost, B·K views as examples (different)",
}
VIEWS_AS_EXAMPLES = "-views-as-examples"
ONLY = ("cnn", "wrn", "vit", "convnext", "timm", "gpu")
FULL_RUN_STEPS = 875  # seed 003, Table 13: WRN-16-4 on CIFAR-10, B = 4096, K = 16
AUTO = 0  # physical_batch: probe the largest micro-batch that fits
_START = time.perf_counter()


def log(message: str) -> None:
    """Prints one progress line to stderr, with the seconds since the script started."""
    print(f"[{time.perf_counter() - _START:8.1f} s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Setup:
    """One configuration: a model, an input shape and a logical batch.

    Attributes:
      name: identifier in the results ("cnn", "wrn-k1", ...).
      description: one line for the report.
      model: "tanh-cnn" or "wrn-DEPTH-WIDTH".
      image_shape: (C, H, W).
      batch_size: B, examples per logical step.
      views: K, augmented views per example (1: inputs (B, C, H, W); K > 1: (B, K, C, H, W)).
      physical_batch: examples per micro-batch (B: no split; ``AUTO``: the largest that
        fits, probed by each row).
      num_examples: N of the dataset, for q = B/N.
      full_run_steps: logical steps of the published run this setting comes from (its
        projected wall time is reported), or None.
    """

    name: str
    description: str
    model: str
    image_shape: tuple[int, int, int]
    batch_size: int
    views: int
    physical_batch: int
    num_examples: int
    full_run_steps: int | None = None

    @property
    def micro_batches(self) -> int:
        """Micro-batches per logical step (0 while the size is still to be probed)."""
        if self.physical_batch == AUTO:
            return 0
        return -(-self.batch_size // self.physical_batch)


def setups(args: argparse.Namespace) -> list[Setup]:
    """The configurations selected by ``--quick``, ``--only`` and ``--wrn-physical-batch``."""
    if args.quick:
        cnn = Setup(
            name="cnn",
            description="QUICK: Tanh CNN, 1×28×28, B = 32",
            model="tanh-cnn",
            image_shape=(1, 28, 28),
            batch_size=32,
            views=1,
            physical_batch=32,
            num_examples=60_000,
        )
        wrn = [
            Setup(
                name=f"wrn-k{k}",
                description=f"QUICK: WRN-10-1, 3×32×32, B = 8, K = {k}",
                model="wrn-10-1",
                image_shape=(3, 32, 32),
                batch_size=8,
                views=k,
                physical_batch=4,
                num_examples=50_000,
            )
            for k in (1, 2)
        ]
    else:
        cnn = Setup(
            name="cnn",
            description="Fashion-MNIST Tanh CNN, 1×28×28, B = 2048",
            model="tanh-cnn",
            image_shape=(1, 28, 28),
            batch_size=2048,
            views=1,
            physical_batch=2048,
            num_examples=60_000,
        )
        wrn = [
            Setup(
                name=f"wrn-k{k}",
                description=f"WRN-16-4, 3×32×32, B = 256, K = {k}",
                model="wrn-16-4",
                image_shape=(3, 32, 32),
                batch_size=256,
                views=k,
                physical_batch=min(args.wrn_physical_batch, 256),
                num_examples=50_000,
            )
            for k in (1, 4)
        ]
    transformers = [
        Setup(
            name="vit",
            description=(
                "ViT-Tiny-like (patch 4, width 192, 3 heads), 3×32×32, B = 8"
                if args.quick
                else "ViT-Tiny-like (patch 4, width 192, 3 heads, depth 6), 3×32×32, B = 128"
            ),
            model="vit-1" if args.quick else "vit-6",
            image_shape=(3, 32, 32),
            batch_size=8 if args.quick else 128,
            views=1,
            physical_batch=8 if args.quick else 128,
            num_examples=50_000,
        ),
        Setup(
            name="convnext",
            description=(
                "ConvNeXt-like (stem 2, width 64), 3×32×32, B = 8"
                if args.quick
                else "ConvNeXt-like (stem 2, width 64, 4 blocks of depthwise 7×7 + LayerNorm + "
                "MLP + layer scale), 3×32×32, B = 128"
            ),
            model="convnext-1" if args.quick else "convnext-4",
            image_shape=(3, 32, 32),
            batch_size=8 if args.quick else 128,
            views=1,
            physical_batch=8 if args.quick else 128,
            num_examples=50_000,
        ),
    ]
    if args.only == "gpu":
        return gpu_setups(args)
    chosen = {
        "cnn": [cnn],
        "wrn": wrn,
        "vit": transformers[:1],
        "convnext": transformers[1:],
        "timm": timm_setups(batch=2 if args.quick else 8, physical=2 if args.quick else 8),
        None: [cnn, *wrn, *transformers],
    }
    return chosen[args.only]


# The models people fine-tune, at 224²: timm's ViT-S/16, ConvNeXt-T and ResNet-50 (its
# BatchNorm replaced by GroupNorm), random weights (needs the models extra).
TIMM_MODELS = {
    "vit-s16": ("timm:vit_small_patch16_224", "timm vit_small_patch16_224"),
    "convnext-t": ("timm:convnext_tiny", "timm convnext_tiny"),
    "resnet50-gn": ("timm:resnet50", "timm resnet50, BatchNorm → GroupNorm"),
}


def timm_setups(batch: int, physical: int) -> list[Setup]:
    """The three timm rows at 3×224×224 with B = ``batch`` (``physical``: micro-batch, or
    ``AUTO``)."""
    return [
        Setup(
            name=name,
            description=f"{label}, 3×224×224, B = {batch}",
            model=model,
            image_shape=(3, 224, 224),
            batch_size=batch,
            views=1,
            physical_batch=physical,
            num_examples=50_000,
        )
        for name, (model, label) in TIMM_MODELS.items()
    ]


def gpu_setups(args: argparse.Namespace) -> list[Setup]:
    """The accelerator table: seed 003's WRN-16-4 at B = 4096, K = 16, the ViT and ConvNeXt
    models at B = 1024 (tiny versions with ``--quick``), and the timm models at 224² with
    B = 256 (B = 2 with ``--quick``)."""
    physical = AUTO if args.physical_batch == "auto" else int(args.physical_batch)
    quick = args.quick
    batch = 8 if quick else 1024
    return [
        Setup(
            name="seed003",
            description=(
                "QUICK: WRN-10-1, 3×32×32, B = 8, K = 2"
                if quick
                else "Seed 003, Table 13: WRN-16-4, 3×32×32, B = 4096, K = 16"
            ),
            model="wrn-10-1" if quick else "wrn-16-4",
            image_shape=(3, 32, 32),
            batch_size=8 if quick else 4096,
            views=2 if quick else 16,
            physical_batch=physical,
            num_examples=50_000,
            full_run_steps=FULL_RUN_STEPS,
        ),
        Setup(
            name="vit",
            description=f"{'QUICK: ' if quick else ''}ViT-Tiny-like, 3×32×32, B = {batch}",
            model="vit-1" if quick else "vit-6",
            image_shape=(3, 32, 32),
            batch_size=batch,
            views=1,
            physical_batch=physical,
            num_examples=50_000,
        ),
        Setup(
            name="convnext",
            description=f"{'QUICK: ' if quick else ''}ConvNeXt-like, 3×32×32, B = {batch}",
            model="convnext-1" if quick else "convnext-4",
            image_shape=(3, 32, 32),
            batch_size=batch,
            views=1,
            physical_batch=physical,
            num_examples=50_000,
        ),
        *timm_setups(batch=2 if quick else 256, physical=physical),
    ]


def build_model(name: str) -> torch.nn.Module:
    """The model called ``name``: "tanh-cnn" (1×28×28), "wrn-DEPTH-WIDTH", "vit-DEPTH" or
    "convnext-DEPTH" (3×32×32, :mod:`speed_models`)."""
    from dpvision.models import tanh_cnn, wide_resnet

    if name.startswith("timm:"):  # BatchNorm → GroupNorm, validated for DP-SGD
        from dpvision.models.registry import build_model as build_dpvision

        return build_dpvision(name, (3, 224, 224), 10)
    if name == "tanh-cnn":
        return tanh_cnn((1, 28, 28), num_classes=10)
    if name.startswith(("vit-", "convnext-")):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import speed_models

        kind, depth = name.split("-")
        if kind == "vit":
            return speed_models.ViT(depth=int(depth))
        return speed_models.ConvNeXt(depth=int(depth))
    if name.startswith("wrn-"):
        depth, width = (int(v) for v in name.removeprefix("wrn-").split("-"))
        return wide_resnet(depth, width, num_classes=10)
    raise ValueError(f"unknown model {name!r}")


def make_batch(
    setup: Setup, *, seed: int, device: str, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random logical batch: inputs (B, C, H, W) or (B, K, C, H, W), labels (B,)."""
    generator = torch.Generator().manual_seed(seed)
    view_dims = (setup.views,) if setup.views > 1 else ()
    shape = (setup.batch_size, *view_dims, *setup.image_shape)
    inputs = torch.randn(shape, generator=generator, dtype=dtype)
    targets = torch.randint(0, 10, (setup.batch_size,), generator=generator)
    return inputs.to(device), targets.to(device)


def per_example_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with reduction "none", the loss contract of dpvision's DP-SGD."""
    return F.cross_entropy(outputs, targets, reduction="none")


def unavailable(row: str, setup: Setup) -> tuple[str, str] | None:
    """(status, reason) when ``row`` cannot run for ``setup`` here, else None.

    Checked in the parent, so that a row that cannot run costs no child process.
    """
    if setup.model.startswith("timm:") and importlib.util.find_spec("timm") is None:
        return "not available", "timm not installed (pip install -c constraints.txt -e '.[models]')"
    if row.startswith("opacus"):
        if row.endswith(VIEWS_AS_EXAMPLES) and setup.views == 1:
            return "skipped", "K = 1: the plain Opacus row is the same computation"
        if not row.endswith(VIEWS_AS_EXAMPLES) and setup.views > 1:
            return "not supported", (
                "Opacus clips each input row; it has no per-example clipping of the gradient "
                f"averaged over K = {setup.views} augmented views"
            )
        if importlib.util.find_spec("opacus") is None:
            return (
                "not available",
                "opacus not installed (pip install -c constraints.txt -e '.[bench]')",
            )
    if row == "dpvision-bookkeeping":
        try:
            from dpvision.per_example.bookkeeping import clip_and_sum  # noqa: F401
        except Exception as error:  # absent or broken: reported in the row, never timed
            return (
                "not available",
                f"dpvision.per_example.bookkeeping: {type(error).__name__}: {error}",
            )
    return None


# --- one logical step per row ------------------------------------------------------------


def split(
    inputs: torch.Tensor, targets: torch.Tensor, size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches (views of the logical batch, no copies)."""
    return list(zip(inputs.split(size), targets.split(size), strict=True))


def autocast(device: torch.device, precision: torch.dtype | None) -> Any:
    """Autocast to ``precision`` (None: float32, no autocast)."""
    if precision is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision)


def non_private_step(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    setup: Setup,
    lr: float,
    precision: torch.dtype | None = None,
) -> Callable[[], None]:
    """Mean cross-entropy over all B·K input rows, accumulated over micro-batches, SGD step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if setup.views > 1:
        inputs = inputs.flatten(0, 1)
        targets = targets.repeat_interleave(setup.views)
    rows = len(inputs)
    parts = split(inputs, targets, setup.physical_batch * setup.views)

    def step() -> None:
        for x, y in parts:
            with autocast(x.device, precision):
                out = model(x)
            loss = F.cross_entropy(out.float(), y, reduction="sum") / rows
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def dpvision_step(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    setup: Setup,
    *,
    clipping: str,
    lr: float,
    noise_multiplier: float,
    seed: int,
    precision: torch.dtype | None = None,
) -> tuple[Callable[[], None], str]:
    """One :class:`dpvision.training.DPSGDStep` logical step with ``clipping``, and its path."""
    from dpvision.accounting import PrivacyLedger
    from dpvision.training import DPSGDStep

    engine = DPSGDStep.build(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        loss_fn=per_example_loss,
        noise_multiplier=noise_multiplier,
        max_grad_norm=MAX_GRAD_NORM,
        sample_rate=setup.batch_size / setup.num_examples,
        num_examples=setup.num_examples,
        ledger=PrivacyLedger(),
        generator=torch.Generator(device=inputs.device).manual_seed(seed),
        views=setup.views > 1,
        method=clipping,
        precision=precision,
    )
    parts = split(inputs, targets, setup.physical_batch)
    return (lambda: engine(parts)), f"DPSGDStep.build(method={clipping!r})"


def opacus_step(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    setup: Setup,
    *,
    mode: str,
    lr: float,
    noise_multiplier: float,
    seed: int,
    precision: torch.dtype | None = None,
) -> tuple[Callable[[], None], str]:
    """One Opacus logical step (``mode`` "hooks" or "ghost"), virtual steps over micro-batches.

    ``make_private`` gets a loader whose dataset is the logical batch's size, so Opacus's
    expected batch size is B (q = 1 for its own accountant, which the timing ignores). The
    loader itself is never iterated: the step runs on the tensors already on the device.
    Micro-batches use Opacus's own virtual-step protocol (``signal_skip_step``, as in its
    BatchMemoryManager): clip and accumulate per micro-batch, noise and step on the last.
    """
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    physical = setup.physical_batch
    if setup.views > 1:  # views as separate examples: a different computation (see module doc)
        inputs = inputs.flatten(0, 1)
        targets = targets.repeat_interleave(setup.views)
        physical *= setup.views
    rows = len(inputs)
    if any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules()):
        from opacus.validators import ModuleValidator  # DPMultiheadAttention, same weights

        model = ModuleValidator.fix(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loader = DataLoader(TensorDataset(torch.zeros(rows, 1)), batch_size=rows)
    with warnings.catch_warnings():
        # Opacus warns that secure_mode is off; timing does not need a CSPRNG.
        warnings.filterwarnings("ignore", message="Secure RNG turned off", category=UserWarning)
        engine = PrivacyEngine()
    made = engine.make_private(
        module=model,
        optimizer=optimizer,
        criterion=torch.nn.CrossEntropyLoss(),
        data_loader=loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=MAX_GRAD_NORM,
        poisson_sampling=False,  # the batch is given; Poisson sampling would forbid virtual steps
        grad_sample_mode=mode,
        noise_generator=torch.Generator(device=inputs.device).manual_seed(seed),
    )
    if mode == "ghost":
        private_model, dp_optimizer, criterion, _ = made
    else:
        private_model, dp_optimizer, _ = made
        criterion = torch.nn.CrossEntropyLoss()
    parts = split(inputs, targets, physical)

    def step() -> None:
        for index, (x, y) in enumerate(parts):
            with autocast(x.device, precision):
                out = private_model(x)
            loss = criterion(out.float(), y)
            loss.backward()
            if len(parts) > 1:
                dp_optimizer.signal_skip_step(do_skip=index < len(parts) - 1)
            dp_optimizer.step()
            dp_optimizer.zero_grad(set_to_none=True)

    return step, f"opacus PrivacyEngine.make_private(grad_sample_mode={mode!r})"


def make_step(
    row: str,
    setup: Setup,
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    lr: float = LEARNING_RATE,
    noise_multiplier: float = NOISE_MULTIPLIER,
    seed: int = SEED,
    precision: torch.dtype | None = None,
) -> tuple[Callable[[], None], str]:
    """The closure that runs one logical step of ``row`` on the fixed batch, and its path."""
    if row == NON_PRIVATE:
        step = non_private_step(model, inputs, targets, setup, lr, precision)
        return step, "forward + backward + SGD"
    if row.startswith("dpvision-"):
        clipping = row.removeprefix("dpvision-")
        return dpvision_step(
            model,
            inputs,
            targets,
            setup,
            clipping=clipping,
            lr=lr,
            noise_multiplier=noise_multiplier,
            seed=seed,
            precision=precision,
        )
    if row.startswith("opacus-"):
        mode = row.removeprefix("opacus-").removesuffix(VIEWS_AS_EXAMPLES)
        return opacus_step(
            model,
            inputs,
            targets,
            setup,
            mode=mode,
            lr=lr,
            noise_multiplier=noise_multiplier,
            seed=seed,
            precision=precision,
        )
    raise ValueError(f"unknown row {row!r}")


# --- timing ------------------------------------------------------------------------------


def resident_mb() -> float:
    """This process's resident memory now (VmRSS), in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)


def _sizes(setup: Setup) -> list[int]:
    """The micro-batch sizes to try: the setup's, or B, B/2, … 1 when it is ``AUTO``."""
    if setup.physical_batch != AUTO:
        return [setup.physical_batch]
    sizes, size = [], setup.batch_size
    while size >= 1:
        sizes.append(size)
        size //= 2
    return sizes


def run_row(
    setup: Setup,
    row: str,
    *,
    steps: int,
    warmup: int,
    device: str,
    threads: int | None,
    precision: str = "fp32",
) -> dict[str, Any]:
    """Builds the model and batch, runs ``warmup`` + ``steps`` logical steps, times each.

    With ``setup.physical_batch == AUTO`` the first warm-up step also probes the micro-batch
    size: the largest of B, B/2, … whose step runs without running out of memory.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    inputs, targets = make_batch(setup, seed=SEED + 1, device=device)
    cuda = device.startswith("cuda")
    dtype = PRECISIONS[precision]
    seconds: list[float] = []
    for size in _sizes(setup):
        trial = replace(setup, physical_batch=size)
        torch.manual_seed(SEED)  # the same initialisation in every row and trial
        model = build_model(setup.model).to(device)
        step, path = make_step(row, trial, model, inputs, targets, precision=dtype)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before_mb = torch.cuda.memory_allocated() / 2**20
        else:
            before_mb = resident_mb()
        try:
            seconds = _timed(step, warmup + steps, cuda)
            break
        except RuntimeError as error:
            if not (_out_of_memory(error) and setup.physical_batch == AUTO and size > 1):
                raise
            del step, model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            log(f"{setup.name} / {row}: micro-batch {size} does not fit; trying {size // 2}")
    seconds = seconds[warmup:]
    result: dict[str, Any] = {
        "path": path,
        "physical_batch": trial.physical_batch,
        "micro_batches": trial.micro_batches,
        "precision": precision,
        "seconds": seconds,
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch_threads": torch.get_num_threads(),
        "memory_before_steps_mb": before_mb,
    }
    if cuda:
        result["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
        result["memory_kind"] = "torch.cuda.max_memory_allocated"
    else:
        # ru_maxrss is in KiB on Linux; the parent replaces it by the child's own, from wait4.
        result["peak_memory_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        result["memory_kind"] = "ru_maxrss of this process (running peak, not per row)"
    return result


def _timed(step: Callable[[], None], count: int, cuda: bool) -> list[float]:
    """Seconds of each of ``count`` calls of ``step`` (synchronised on CUDA)."""
    seconds = []
    for _ in range(count):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds


def run_isolated(
    setup: Setup,
    row: str,
    *,
    steps: int,
    warmup: int,
    device: str,
    threads: int | None,
    precision: str = "fp32",
) -> dict[str, Any]:
    """:func:`run_row` in a child process; its peak RSS comes from ``os.wait4``."""
    spec = {
        "setup": asdict(setup),
        "row": row,
        "steps": steps,
        "warmup": warmup,
        "device": device,
        "threads": threads,
        "precision": precision,
    }
    with tempfile.TemporaryDirectory(prefix="dpsgd-speed-") as folder:
        result_path, stderr_path = Path(folder) / "result.json", Path(folder) / "stderr.txt"
        spec["result_path"] = str(result_path)
        with open(stderr_path, "w") as stderr:
            child = subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
            )
            _, status, usage = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0 or not result_path.exists():
            tail = stderr_path.read_text(errors="replace").strip().splitlines()[-5:]
            reason = f"child exited with {child.returncode}"
            if child.returncode < 0:
                reason = f"child killed by signal {-child.returncode} (out of memory?)"
            return {
                "status": "error",
                "reason": reason + (": " + " | ".join(tail) if tail else ""),
                "child_max_rss_mb": usage.ru_maxrss / 1024,
            }
        result = json.loads(result_path.read_text())
    result["child_max_rss_mb"] = usage.ru_maxrss / 1024
    if not device.startswith("cuda"):
        result["peak_memory_mb"] = usage.ru_maxrss / 1024
        result["memory_kind"] = "ru_maxrss of the row's own child process (os.wait4)"
    return result


def worker(spec_json: str) -> int:
    """Entry point of a child process: runs one row and writes its result JSON."""
    spec = json.loads(spec_json)
    # Every child imports the same libraries, so their resident memory before the first step
    # is comparable across rows (otherwise the non-private row would look smaller by the size
    # of dpvision's and Opacus's imports).
    import dpvision.training  # noqa: F401

    if importlib.util.find_spec("opacus") is not None:
        import opacus  # noqa: F401
    setup_fields = dict(spec["setup"])
    setup_fields["image_shape"] = tuple(setup_fields["image_shape"])
    result = run_row(
        Setup(**setup_fields),
        spec["row"],
        steps=spec["steps"],
        warmup=spec["warmup"],
        device=spec["device"],
        threads=spec["threads"],
        precision=spec["precision"],
    )
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


def _added_mb(row: dict[str, Any]) -> float:
    """Memory the steps added: peak minus the memory before the first step."""
    return float(row["peak_memory_mb"] - row["memory_before_steps_mb"])


def run_setup(setup: Setup, rows: tuple[str, ...], args: argparse.Namespace) -> dict[str, Any]:
    """Every row of one configuration, with ratios to its non-private row."""
    results = []
    for row in rows:
        entry: dict[str, Any] = {"row": row, "label": LABELS[row]}
        skip = unavailable(row, setup)
        if skip is not None:
            entry["status"], entry["reason"] = skip
            if entry["status"] != "skipped":
                log(f"{setup.name} / {row}: {entry['status']}: {entry['reason']}")
                results.append(entry)
            continue
        log(f"{setup.name} / {row}: {args.warmup} warm-up + {args.steps} timed steps ...")
        kwargs = {
            "steps": args.steps,
            "warmup": args.warmup,
            "device": args.device,
            "threads": args.threads,
            "precision": args.precision,
        }
        try:
            measured = (
                run_row(setup, row, **kwargs)
                if args.no_isolation
                else run_isolated(setup, row, **kwargs)
            )
        except Exception as error:  # reported in the row, never as a number
            measured = {"status": "error", "reason": f"{type(error).__name__}: {error}"}
        entry.update({"status": "ok", **measured})
        if entry["status"] == "ok":
            log(
                f"{setup.name} / {row}: median {entry['median_s']:.4f} s/step, peak "
                f"{entry['peak_memory_mb']:.0f} MB"
            )
        else:
            log(f"{setup.name} / {row}: {entry['status']}: {entry['reason']}")
        results.append(entry)
    baseline = next((r for r in results if r["row"] == NON_PRIVATE and r["status"] == "ok"), None)
    # In one shared process the CPU peak is a running peak: no ratio of peaks per row.
    per_row_memory = not args.no_isolation or args.device.startswith("cuda")
    for entry in results:
        if baseline is not None and entry["status"] == "ok":
            entry["time_ratio"] = entry["median_s"] / baseline["median_s"]
            if setup.full_run_steps:
                entry["projected_full_run_hours"] = entry["median_s"] * setup.full_run_steps / 3600
            if per_row_memory:
                entry["memory_ratio"] = entry["peak_memory_mb"] / baseline["peak_memory_mb"]
                entry["added_memory_ratio"] = _added_mb(entry) / max(_added_mb(baseline), 1e-9)
    return {**asdict(setup), "micro_batches": setup.micro_batches, "rows": results}


# --- report ------------------------------------------------------------------------------


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


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    """The machine and library versions the numbers were measured with."""
    info = {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": args.threads if args.threads is not None else torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "opacus": package_version("opacus"),
        "dpvision": package_version("dpvision"),
        "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        "device": args.device,
    }
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(args.device)
    return info


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` → ``nvidia-h100-80gb-hbm3`` (for file names)."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def markdown(result: dict[str, Any]) -> str:
    """The markdown report of ``result``: one table per configuration."""
    mach, p = result["machine"], result["parameters"]
    cuda = mach["device"].startswith("cuda")
    memory = "peak CUDA MB" if cuda else "peak RSS MB"
    device = mach.get("gpu") or mach["device"]
    lines = [f"# DP-SGD speed: time per logical step and peak memory ({device})", ""]
    if result["quick"]:
        lines += [
            "**QUICK SMOKE RUN (`--quick`): tiny models and 2 steps. These numbers only show "
            "that the benchmark runs; they are not a measurement.**",
            "",
        ]
    lines += [
        f"Median of {p['steps']} timed steps after {p['warmup']} warm-up steps; C = "
        f"{p['max_grad_norm']:g}, σ = {p['noise_multiplier']:g}, SGD lr {p['learning_rate']:g} "
        "(no momentum); random inputs; same initialisation and batch in every row. A step is "
        "forward + backward + clipping + noise + optimizer step. × non-private: ratio to the "
        "non-private row of the same configuration, measured in the same run."
        + (
            f" Precision {p.get('precision')}: forward and backward under autocast."
            if p.get("precision", "fp32") != "fp32"
            else ""
        ),
        "",
    ]
    for setup in result["setups"]:
        split_note = (
            f"{setup['micro_batches']} micro-batches of {setup['physical_batch']} examples "
            "(virtual steps; the same split in every row, one noise draw per logical step)"
            if setup["micro_batches"] > 1
            else "one micro-batch"
        )
        if setup["physical_batch"] == AUTO:
            split_note = (
                "micro-batches as large as fit, probed per row (column 'micro-batch'; one "
                "noise draw per logical step)"
            )
        lines += [
            f"## {setup['description']}",
            "",
            f"`{setup['name']}`: {setup['model']}, {split_note}, q = B/N with N = "
            f"{setup['num_examples']:,}.",
            "",
            f"| row | s / step (median) | × non-private | min–max s | {memory} | × non-private "
            "| added by the steps MB | × non-private | micro-batch | path |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in setup["rows"]:
            if r["status"] != "ok":
                lines.append(f"| {r['label']} | {r['status']} | | | | | | | | {r['reason']} |")
                continue
            comparable = not r["row"].endswith(VIEWS_AS_EXAMPLES)
            ratio = r.get("time_ratio") if comparable else None
            memory_ratio = r.get("memory_ratio") if comparable else None
            added_ratio = r.get("added_memory_ratio") if comparable else None
            lines.append(
                f"| {r['label']} | {r['median_s']:.4f} | "
                f"{'**' + _cell(ratio, '.2f') + '**' if ratio is not None else '—'} | "
                f"{r['min_s']:.4f}–{r['max_s']:.4f} | {r['peak_memory_mb']:.0f} | "
                f"{_cell(memory_ratio, '.2f')} | {_added_mb(r):.0f} | "
                f"{_cell(added_ratio, '.2f')} | {r.get('physical_batch', '—')} | {r['path']} |"
            )
        lines.append("")
        lines += _full_run_lines(setup) + _target_lines(setup)
    isolation = (
        "All rows ran in this one process: CPU peaks are the process's running peak, NOT per row"
        if p["no_isolation"]
        else "Each row ran in its own child process"
    )
    memory_note = (
        "Peak memory: torch.cuda.max_memory_allocated over warm-up and timed steps; 'added "
        "by the steps' is the peak minus the memory allocated once the model and batch were "
        "built."
        if cuda
        else "Peak memory: the row's peak resident set (ru_maxrss), including the Python "
        "interpreter and the libraries (every row imports the same ones); 'added by the "
        "steps' is the peak minus the resident memory once the imports, model and batch were "
        "in place."
    )
    lines += [
        f"{isolation}. {memory_note}",
        "",
        "Rows 'views as examples' (K > 1 only) clip each of the B·K views as its own example: "
        "a different, weaker privacy unit than the per-example clipping over K views of the "
        "dpvision rows, listed for scale and not compared.",
        "",
        f"Machine: {mach['cpu_model']}, {mach['cpu_count']} CPUs, torch threads "
        f"{mach['torch_threads']}, {mach['memory_gb']:.0f} GB RAM"
        + (f", GPU {mach['gpu']}" if cuda else "")
        + f", {mach['platform']}; Python {mach['python']}, torch {mach['torch']}, opacus "
        f"{mach['opacus']}, dpvision {mach['dpvision']}. Load average at start "
        f"{result['load_average_start']}, at end {result['load_average_end']}.",
        "",
        f"Date: {result['date']}. Total time {result['total_seconds']:.1f} s. Command:",
        "",
        f"    {result['command']}",
        "",
    ]
    return "\n".join(lines)


def _full_run_lines(setup: dict[str, Any]) -> list[str]:
    """The projected wall time of the published run, per row that has it."""
    rows = [r for r in setup["rows"] if "projected_full_run_hours" in r]
    if not rows:
        return []
    parts = [f"{r['label']} {r['projected_full_run_hours']:.2f} h" for r in rows]
    return [
        f"Projected wall time of the full run ({setup['full_run_steps']} logical steps × the "
        f"median step): {'; '.join(parts)}.",
        "",
    ]


def _target_lines(setup: dict[str, Any]) -> list[str]:
    """Whether dpvision's book-keeping row meets the targets: ≤ 1.3× non-private and faster
    than the fastest Opacus row of the same computation."""
    rows = {r["row"]: r for r in setup["rows"] if r["status"] == "ok"}
    ours = rows.get("dpvision-bookkeeping")
    if ours is None or "time_ratio" not in ours:
        return ["Targets: the book-keeping row did not run; nothing to compare.", ""]
    ratio = ours["time_ratio"]
    verdict = [f"× non-private {ratio:.2f} ({'meets' if ratio <= 1.3 else 'misses'} ≤ 1.3)"]
    opacus = [
        r for name, r in rows.items() if name.startswith("opacus") and VIEWS_AS_EXAMPLES not in name
    ]
    if opacus:
        fastest = min(opacus, key=lambda r: r["median_s"])
        faster = ours["median_s"] < fastest["median_s"]
        verdict.append(
            f"{fastest['median_s'] / ours['median_s']:.2f}× the speed of {fastest['label']} "
            f"({'faster' if faster else 'slower'})"
        )
    else:
        verdict.append("no comparable Opacus row (see the rows' reasons)")
    return [f"Targets (dpvision book-keeping): {'; '.join(verdict)}.", ""]


def write_text_atomic(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and a rename."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (defaults: the full benchmark on CPU)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, help="timed logical steps per row (default 10)")
    parser.add_argument("--warmup", type=int, help="untimed warm-up steps per row (default 2)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads in every row")
    parser.add_argument(
        "--only", choices=ONLY, help="run one configuration family (its own result files)"
    )
    parser.add_argument(
        "--rows",
        help=f"comma-separated rows to run (non-private always runs); from {', '.join(ROWS)}",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (or cuda:N)")
    parser.add_argument(
        "--wrn-physical-batch",
        type=int,
        default=64,
        help="examples per micro-batch on WRN (a memory knob, the same in every row)",
    )
    parser.add_argument(
        "--physical-batch",
        default="auto",
        help="--only gpu: examples per micro-batch, or auto (default): the largest that fits",
    )
    parser.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default="fp32",
        help="fp32 (default) or bf16: forward and backward of every row under autocast",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny smoke run: small models, 2 steps, _quick files"
    )
    parser.add_argument(
        "--no-isolation",
        action="store_true",
        help="run the rows in this process (faster; CPU memory is then not per row)",
    )
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results"), help="results folder"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.quick else 10
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.wrn_physical_batch < 1:
        parser.error("--wrn-physical-batch must be >= 1")
    if args.physical_batch != "auto" and not (
        args.physical_batch.isdigit() and int(args.physical_batch) >= 1
    ):
        parser.error(
            f"--physical-batch must be auto or a whole number >= 1, got {args.physical_batch!r}"
        )
    if args.only == "gpu" and args.physical_batch == "auto" and args.warmup < 1:
        parser.error("--physical-batch auto probes during the first warm-up step: --warmup >= 1")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.rows is None:
        args.rows = ROWS
    else:
        chosen = [r.strip() for r in args.rows.split(",") if r.strip()]
        unknown = sorted(set(chosen) - set(ROWS))
        if unknown:
            parser.error(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(ROWS)}")
        args.rows = tuple(r for r in ROWS if r == NON_PRIVATE or r in chosen)
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs every selected configuration and row, writes the JSON and markdown."""
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    load_start = [round(v, 2) for v in os.getloadavg()]
    machine = machine_info(args)
    log(
        f"{machine['cpu_model']}, {machine['cpu_count']} CPUs, torch threads "
        f"{machine['torch_threads']}, load average {load_start}, opacus {machine['opacus']}"
    )
    results = [run_setup(setup, args.rows, args) for setup in setups(args)]
    family = f"_{args.only}" if args.only not in (None, "cnn") else ""
    if args.only == "gpu":  # the files are named after the device the table was measured on
        family += "_" + device_slug(machine.get("gpu") or "cpu")
    if args.precision != "fp32":
        family += f"_{args.precision}"
    name = NAME + family + ("_quick" if args.quick else "")
    result = {
        "name": name,
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": shlex.join(["python", *sys.argv]),
        "parameters": {
            "steps": args.steps,
            "warmup": args.warmup,
            "threads": args.threads,
            "device": args.device,
            "no_isolation": args.no_isolation,
            "max_grad_norm": MAX_GRAD_NORM,
            "noise_multiplier": NOISE_MULTIPLIER,
            "learning_rate": LEARNING_RATE,
            "seed": SEED,
            "wrn_physical_batch": args.wrn_physical_batch,
            "physical_batch": args.physical_batch,
            "precision": args.precision,
        },
        "machine": machine,
        "setups": results,
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
