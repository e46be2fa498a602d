"""Work run by every rank under ``torchrun`` in the distributed tests (not a test module).

    python -m torch.distributed.run --standalone --nproc_per_node N distributed_worker.py \
        CASE OUT_DIR [FEATURES.npy LABELS.npy]

Each rank writes what it computed to ``OUT_DIR/CASE-rank{R}.pt``. The tests import the same
functions to compute the single-process reference in their own process.
"""

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpvision.accounting import PrivacyLedger
from dpvision.distributed import Workers, current, init_from_env, shutdown
from dpvision.learners import LEARNERS
from dpvision.training import DPSGDStep, privatize_gradients

LEARNER_OPTIONS: dict[str, dict[str, Any]] = {
    "dp-ls": {"clip_norm": 1.0, "max_block_bytes": 2 * 8 * 12 * 12},  # 2 classes per block
    "dp-fc": {"epochs": 3, "clip_norm": 1.0},
    "dp-newton": {"iterations": 2},
    "dp-sgd-linear": {"batch_size": 150, "epochs": 2},
}

NOISE_MULTIPLIER, CLIP_NORM = 2.0, 0.5


def fit_learners(features: np.ndarray, labels: np.ndarray) -> dict[str, dict[str, Any]]:
    """Every feature learner fitted at σ = 1.5 with a fixed seed."""
    out = {}
    for name, options in LEARNER_OPTIONS.items():
        learner = LEARNERS[name](
            noise_multiplier=1.5, random_state=11, num_classes=5, chunk_size=100, **options
        )
        learner.fit(features, labels)
        out[name] = {
            "coef": torch.from_numpy(learner.coef_),
            "intercept": torch.from_numpy(learner.intercept_),
            "ledger": learner.privacy_ledger_.to_json(),
        }
    return out


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(40, 25)  # 1025 parameters


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def noise_of_steps(steps: int, workers: Workers) -> torch.Tensor:
    """(steps, parameters): the noise each logical DP-SGD step added, on this rank.

    Every rank's share of each batch is empty, so the released sum is pure noise; with SGD
    at learning rate 1 and qN = 1 a step moves the parameters by minus that noise.
    """
    model = _model()
    step = DPSGDStep.build(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"),
        noise_multiplier=NOISE_MULTIPLIER,
        max_grad_norm=CLIP_NORM,
        sample_rate=0.1,
        num_examples=10,
        ledger=PrivacyLedger(),
        generator=torch.Generator().manual_seed(7),
        workers=workers,
    )
    rows = []
    for _ in range(steps):
        before = _flat(model)
        step([])
        rows.append(before - _flat(model))
    return torch.stack(rows)


def noise_added_per_worker(steps: int, workers: Workers) -> torch.Tensor:
    """The mistake the design rules out, for the test to show it is caught: each worker
    draws its own noise onto its share before the sums are reduced."""
    model = _model()
    rows = []
    generator = torch.Generator().manual_seed(7 + workers.rank)
    for _ in range(steps):
        params = list(model.parameters())
        privatize_gradients(
            [(torch.zeros_like(p), p) for p in params],
            l2_sensitivity=CLIP_NORM,
            noise_multiplier=NOISE_MULTIPLIER,
            divisor=1.0,
            generator=generator,
            released="wrong",
        )
        grads = [p.grad for p in params]
        assert all(g is not None for g in grads)
        workers.all_reduce_(grads)  # type: ignore[arg-type]
        rows.append(torch.cat([g.reshape(-1) for g in grads]))  # type: ignore[union-attr]
    return torch.stack(rows)


def sensitivities(workers: Workers) -> dict[str, tuple[float, str | None]]:
    """check_sensitivity of the DP-SGD engine and of DP-LS, each rank holding its share."""
    from dpvision.learners import DPLeastSquares
    from dpvision.testing import check_sensitivity, dpsgd_release

    rng = np.random.default_rng(0)
    x, y = torch.from_numpy(rng.standard_normal((11, 5))), torch.from_numpy(rng.integers(0, 3, 11))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
    ).double()
    out = {}
    for name, release in [
        ("dp-sgd", dpsgd_release(model, max_grad_norm=1.0, physical_batch_size=2, workers=workers)),
        ("dp-ls", DPLeastSquares(num_classes=3, clip_norm=0.7, random_state=0)),
    ]:
        report = check_sensitivity(
            release,
            (x, y) if name == "dp-sgd" else (x.numpy(), y.numpy()),
            positions=[0, 5, 11],
            scale=30.0,
        )
        out[name] = (report.max_ratio if report.ok else float("inf"), report.refusal)
    return out


def main(case: str, out_dir: str, *paths: str) -> None:
    workers = init_from_env()
    assert current() == workers
    if case == "learners":
        features = np.load(paths[0], mmap_mode="r")
        result: Any = fit_learners(features, np.load(paths[1]))
    elif case == "noise":
        result = noise_of_steps(40, workers)
    elif case == "noise-per-worker":
        result = noise_added_per_worker(40, workers)
    elif case == "sensitivity":
        result = sensitivities(workers)
    else:
        raise SystemExit(f"unknown case {case}")
    torch.save(
        {"world_size": workers.world_size, "result": result},
        Path(out_dir) / f"{case}-rank{workers.rank}.pt",
    )
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as python -m dpvision does under torchrun: gloo may abort a normal exit


if __name__ == "__main__":
    main(*sys.argv[1:])
