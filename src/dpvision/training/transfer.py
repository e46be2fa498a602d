"""DP-RandP Phases II and III: the head first, then every parameter (Tang et al. 2023).

The split N₁ is a choice of the public schedule made from σ, q and the step counts only.
Both phases add the same noise at the same rate, so the whole run is one composition of
Poisson-sampled Gaussian steps whatever N₁ is.
"""

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from dpvision.accounting import PrivacyLedger, calibrate_steps
from dpvision.errors import DPVisionError
from dpvision.models.encoder import EncoderInfo
from dpvision.training.optimizers import make_optimizer
from dpvision.training.options import DPSGDOptions

DEFAULT_PHASE2_STEPS = 96  # Tang et al.: 8 epochs of 12 steps on CIFAR-10 (App. E)


@dataclasses.dataclass
class TransferPlan:
    """Where a dp-randp run starts from and where Phase II ends."""

    encoder: Path
    info: EncoderInfo
    phase2_steps: int
    steps: int
    phase2_epsilon: float | None
    pretrain: dict[str, Any] | None
    head: list[str] = dataclasses.field(default_factory=list)

    def summary(self, epsilon: float) -> dict[str, Any]:
        fraction = None
        if self.phase2_epsilon is not None and math.isfinite(epsilon) and epsilon > 0:
            fraction = self.phase2_epsilon / epsilon
        return {
            "encoder": str(self.encoder),
            "encoder_trained_on": self.info.metadata.get("trained_on"),
            "phase2_steps": self.phase2_steps,
            "phase3_steps": self.steps - self.phase2_steps,
            "phase2_epsilon": self.phase2_epsilon,
            "phase2_epsilon_fraction": fraction,
            "phase2_parameters": list(self.head),
            "pretrain": self.pretrain,
        }


def phase_optimizer(
    options: DPSGDOptions, model: torch.nn.Module, plan: TransferPlan | None, step: int
) -> torch.optim.Optimizer:
    """A fresh optimizer for the phase that ``step`` falls in.

    Phase II (steps before N₁) trains the head only: the other parameters are frozen, so
    the clipped sums, the noise and the updates cover the head's parameters alone. Phase III
    trains every parameter, with a new optimizer, as in TAN/DP-RandP's second
    ``make_private``.
    """
    phase2 = plan is not None and step < plan.phase2_steps
    if plan is not None:  # without a plan, what trains is learner.finetune's (already set)
        for name, param in model.named_parameters():
            param.requires_grad_(not phase2 or name in plan.head)
    rate = options.learning_rate
    if phase2 and options.phase2_learning_rate is not None:
        rate = options.phase2_learning_rate
    return make_optimizer(dataclasses.replace(options, learning_rate=rate), model)


def phase2_steps_for(
    options: DPSGDOptions,
    sigma: float,
    sample_rate: float,
    steps: int,
    prior: PrivacyLedger,
    *,
    delta: float,
    accountant: str | None,
) -> int:
    """N₁: ``learner.phase2_steps``, else the most steps whose ε is at most
    ``phase2_fraction`` of the whole run's, else 96 (at most ``steps``).

    The split is a choice of the public schedule, made from σ, q and the step counts only:
    it looks at no data. Both phases add the same noise at the same rate, so the whole run
    is one composition of ``steps`` Poisson-sampled Gaussian steps whatever N₁ is.
    """
    if options.phase2_steps is not None:
        if options.phase2_steps > steps:
            raise DPVisionError(
                f"learner.phase2_steps = {options.phase2_steps} exceeds the run's {steps} steps"
            )
        return options.phase2_steps
    if options.phase2_fraction is None:
        return min(DEFAULT_PHASE2_STEPS, steps)
    if options.phase2_fraction >= 1:
        return steps
    if sigma == 0:
        raise DPVisionError(
            "learner.phase2_fraction needs a private run (with the noise off, give "
            "learner.phase2_steps)"
        )

    def epsilon(count: int) -> float:
        ledger = PrivacyLedger(prior.entries)
        ledger.record(
            noise_multiplier=sigma,
            sample_rate=sample_rate,
            count=count,
            released="DP-SGD clipped gradient sum",
        )
        return ledger.epsilon(delta, accountant)

    budget = options.phase2_fraction * epsilon(steps)
    if options.phase2_fraction == 0 or epsilon(1) > budget:
        return 0
    return calibrate_steps(
        target_epsilon=budget,
        target_delta=delta,
        noise_multiplier=sigma,
        sample_rate=sample_rate,
        accountant=accountant,
        preceding_event=prior.dp_event() if len(prior) else None,
        max_steps=steps,
    )
