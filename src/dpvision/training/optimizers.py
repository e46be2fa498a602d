"""The torch optimizer of a DP-SGD run, over the model's trainable parameters.

Privacy: the optimizer only post-processes the privatised gradient.
"""

import torch

from dpvision.training.options import DPSGDOptions


def make_optimizer(options: DPSGDOptions, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer named by ``options`` over ``model``'s trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if options.optimizer == "adam":
        return torch.optim.Adam(params, lr=options.learning_rate, weight_decay=options.weight_decay)
    return torch.optim.SGD(
        params,
        lr=options.learning_rate,
        momentum=options.momentum,
        nesterov=options.nesterov,
        weight_decay=options.weight_decay,
    )
