"""Test or validation accuracy of the raw and the averaged (EMA) parameters, shared
across ranks.

Privacy: neither the test set nor the validation split is trained on; nothing here touches
the training examples.
"""

import torch
from torch.func import functional_call

from dpvision.averaging import ParameterEMA
from dpvision.data.inputs import LazyInputs, TrainingData
from dpvision.distributed import Workers


@torch.no_grad()
def accuracy(
    model: torch.nn.Module,
    params: dict[str, torch.Tensor] | None,
    x: torch.Tensor | LazyInputs,
    y: torch.Tensor,
    batch: int,
    workers: Workers,
) -> float:
    """Accuracy on (x, y); each rank scores its share of the rows and the counts are summed."""
    start, stop = workers.row_range(len(y))
    correct = 0
    for first in range(start, stop, batch):
        xb, yb = x[first : min(first + batch, stop)], y[first : min(first + batch, stop)]
        out = model(xb) if params is None else functional_call(model, params, (xb,))
        correct += int((out.argmax(1) == yb).sum())
    return workers.sum(correct) / max(workers.sum(stop - start), 1)


def evaluate(
    model: torch.nn.Module,
    ema: ParameterEMA | None,
    data: TrainingData,
    batch_size: int,
    workers: Workers | None = None,
    split: str = "test",
) -> dict[str, float]:
    """Accuracy on ``split`` (``test`` or ``validation``) of the raw parameters and, with an
    EMA, of the averaged ones: ``{split}_accuracy`` and ``{split}_accuracy_ema``.

    Privacy: neither split is trained on; the accuracies are exact statistics of the
    held-out examples (see :mod:`dpvision.data.validation`), not of the training examples.
    """
    workers = workers or Workers()
    x, y = (data.test_x, data.test_y) if split == "test" else (data.validation_x, data.validation_y)
    if x is None or y is None:
        raise ValueError(f"no {split} split")
    out = {f"{split}_accuracy": accuracy(model, None, x, y, batch_size, workers)}
    if ema is not None:
        out[f"{split}_accuracy_ema"] = accuracy(model, ema.shadow, x, y, batch_size, workers)
    return out
