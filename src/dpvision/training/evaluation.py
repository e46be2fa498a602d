"""Test accuracy of the raw and the averaged (EMA) parameters, shared across ranks.

Privacy: the test set is not private training data; nothing here touches the training
examples.
"""

import torch
from torch.func import functional_call

from dpvision.data.inputs import LazyInputs, TrainingData
from dpvision.distributed import Workers
from dpvision.training.engine import ParameterEMA


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
) -> dict[str, float]:
    """Test accuracy of the raw parameters and, with an EMA, of the averaged ones.

    Privacy: the test set is not private training data; nothing here touches the
    training examples.
    """
    workers = workers or Workers()
    batch = batch_size
    out = {"test_accuracy": accuracy(model, None, data.test_x, data.test_y, batch, workers)}
    if ema is not None:
        out["test_accuracy_ema"] = accuracy(
            model, ema.shadow, data.test_x, data.test_y, batch, workers
        )
    return out
