"""Small tanh multi-layer perceptrons on flattened images.

The model of choice when many small private trainings must run at once (privacy auditing,
:mod:`dpvision.audit`) and for inputs no convolutional model here takes (scikit-learn's 8×8
``digits``). ``hidden = 0`` is multinomial logistic regression on the pixels.
"""

from collections.abc import Sequence

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models._common import check_num_classes, check_shape


class MLP(nn.Module):
    """flatten – linear(C·H·W → hidden) – tanh – linear(hidden → classes); no hidden layer
    when ``hidden = 0``.

    Args:
        input_shape: (C, H, W) of the images.
        num_classes: Number of output logits.
        hidden: Width of the hidden layer (0: a linear model).

    Raises:
        DPVisionError: A bad shape, fewer than two classes, or a negative width.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int = 10, hidden: int = 32) -> None:
        super().__init__()
        channels, height, width = check_shape(input_shape, "input_shape")
        num_classes = check_num_classes(num_classes)
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 0:
            raise DPVisionError(f"hidden must be a whole number >= 0, got {hidden!r}")
        inputs = channels * height * width
        layers: list[nn.Module] = [nn.Flatten()]
        if hidden:
            layers += [nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, num_classes)]
        else:
            layers.append(nn.Linear(inputs, num_classes))
        self.layers = nn.Sequential(*layers)
        self.input_shape = (channels, height, width)
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps images (N, C, H, W) to logits (N, num_classes)."""
        result: torch.Tensor = self.layers(x)
        return result


def mlp(input_shape: Sequence[int], num_classes: int = 10, hidden: int = 32) -> MLP:
    """Builds a tanh MLP (``hidden = 0``: logistic regression) for images of ``input_shape``.

    >>> import torch
    >>> mlp((1, 8, 8), num_classes=10, hidden=16)(torch.zeros(3, 1, 8, 8)).shape
    torch.Size([3, 10])
    """
    return MLP(input_shape, num_classes, hidden)
