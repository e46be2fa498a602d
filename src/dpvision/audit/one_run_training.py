"""Auditing anyone's training function in one run: canaries in, one training, one bound.

>>> import torch
>>> from torch import nn
>>> def train(dataset):  # a user's loop; here it ignores its data (perfectly private)
...     return nn.Linear(4, 2)
>>> base = (torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))
>>> canaries = (torch.eye(4).repeat(25, 1), torch.ones(100, dtype=torch.long))
>>> report = audit_training(train, base=base, canaries=canaries, epsilon=1.0, delta=1e-5,
...                         guess_in=10, guess_out=10)
>>> report["epsilon_lower_bound"] <= 1.0, report["canaries"], report["guesses"]
(True, 100, 20)

The audited function gets a :class:`torch.utils.data.TensorDataset` of the base examples
and the included canaries (each included with probability ½, in a shuffled order) and
returns the trained model. Each canary is scored by the model (by default its negative
cross-entropy loss: higher means "more likely trained on"), and the scores and the coins go
to :func:`dpvision.audit.one_run.audit_one_run`.
"""

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpvision.audit.one_run import audit_one_run
from dpvision.errors import DPVisionError

Scorer = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def negative_loss(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """−cross-entropy of each canary under ``model`` (in eval mode, without gradients)."""
    model.eval()
    with torch.no_grad():
        return -torch.nn.functional.cross_entropy(model(inputs), labels, reduction="none")


def audit_training(
    train: Callable[[TensorDataset], torch.nn.Module],
    *,
    base: tuple[torch.Tensor, torch.Tensor],
    canaries: tuple[torch.Tensor, torch.Tensor],
    epsilon: float,
    delta: float,
    guess_in: int,
    guess_out: int,
    score: Scorer = negative_loss,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """Runs ``train`` once on ``base`` plus a random half of ``canaries`` and returns the
    one-run audit of its claim (ε, δ): the counts, the ε lower bound and ``violation``
    (bound above the claim: the training is not (ε, δ)-DP, with probability ≥ confidence).

    Fix ``guess_in`` and ``guess_out`` before looking at any scores.
    """
    base_x, base_y = base
    canary_x, canary_y = canaries
    m = len(canary_x)
    if len(canary_y) != m or len(base_x) != len(base_y):
        raise DPVisionError("inputs and labels must have the same length")
    if m < 1 or guess_in + guess_out > m:
        raise DPVisionError(f"need guess_in + guess_out <= {m} canaries")
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    chosen = torch.from_numpy(np.flatnonzero(included))
    inputs = torch.cat([base_x, canary_x[chosen]])
    labels = torch.cat([base_y, canary_y[chosen]])
    order = torch.from_numpy(rng.permutation(len(inputs)))
    model = train(TensorDataset(inputs[order], labels[order]))
    scores = score(model, canary_x, canary_y).detach().cpu().numpy().astype(np.float64)
    report: dict[str, Any] = audit_one_run(
        scores,
        included,
        guess_in=guess_in,
        guess_out=guess_out,
        delta=delta,
        confidence=confidence,
    )
    report.update(
        claimed_epsilon=float(epsilon),
        delta=float(delta),
        confidence=float(confidence),
        violation=bool(report["epsilon_lower_bound"] > epsilon),
    )
    return report
