"""End-to-end Tanh CNNs on raw pixels, the CNN baselines of Tramèr & Boneh.

The architectures are those of ``MNIST_CNN`` and ``CIFAR10_CNN`` in the Handcrafted-DP code
(``models.py``) for Tramèr & Boneh (2021), "Differentially Private Learning Needs Better
Features (or Much More Data)", which take the tanh CNNs of Papernot et al. (2021), "Tempered
Sigmoid Activations for Deep Learning with Differential Privacy". They have no normalisation
layer at all, so every example's output depends on that example only.
"""

from collections.abc import Sequence

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models._common import check_num_classes, check_shape

MNIST_SHAPE = (1, 28, 28)
CIFAR10_SHAPE = (3, 32, 32)


def _mnist_layers(num_classes: int) -> tuple[nn.Sequential, nn.Sequential]:
    # 28 → conv 8/2 pad 2 → 13 → pool 2/1 → 12 → conv 4/2 → 5 → pool 2/1 → 4.
    features = nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=8, stride=2, padding=2),
        nn.Tanh(),
        nn.MaxPool2d(kernel_size=2, stride=1),
        nn.Conv2d(16, 32, kernel_size=4, stride=2),
        nn.Tanh(),
        nn.MaxPool2d(kernel_size=2, stride=1),
    )
    classifier = nn.Sequential(
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.Tanh(),
        nn.Linear(32, num_classes),
    )
    return features, classifier


def _cifar10_layers(num_classes: int) -> tuple[nn.Sequential, nn.Sequential]:
    layers: list[nn.Module] = []
    channels = 3
    for spec in (32, 32, "M", 64, 64, "M", 128, 128, "M"):
        if spec == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            assert isinstance(spec, int)
            layers += [nn.Conv2d(channels, spec, kernel_size=3, stride=1, padding=1), nn.Tanh()]
            channels = spec
    # 32 → 16 → 8 → 4 after the three max-pools.
    classifier = nn.Sequential(
        nn.Flatten(),
        nn.Linear(channels * 4 * 4, 128),
        nn.Tanh(),
        nn.Linear(128, num_classes),
    )
    return nn.Sequential(*layers), classifier


class TanhCNN(nn.Module):
    """Tanh CNN for 1×28×28 (MNIST, Fashion-MNIST) or 3×32×32 (CIFAR-10) images.

    Follows ``MNIST_CNN`` and ``CIFAR10_CNN`` of the Handcrafted-DP code (Tramèr & Boneh,
    2021), which come from Papernot et al. (2021):

    * 1×28×28: conv(1→16, 8, stride 2, padding 2) – tanh – maxpool(2, stride 1) –
      conv(16→32, 4, stride 2) – tanh – maxpool(2, stride 1) – flatten (32·4·4 = 512) –
      linear(512→32) – tanh – linear(32→classes). 26,010 parameters for 10 classes.
    * 3×32×32: 3×3 convolutions (padding 1) with channels 32, 32, M, 64, 64, M, 128, 128, M
      (M = maxpool(2, 2)) and tanh after every convolution – flatten (128·4·4 = 2048) –
      linear(2048→128) – tanh – linear(128→classes). 550,570 parameters for 10 classes.

    Args:
        input_shape: (C, H, W) of the images: (1, 28, 28) or (3, 32, 32).
        num_classes: Number of output logits.

    Raises:
        DPVisionError: Another input shape, or fewer than two classes.
    """

    def __init__(self, input_shape: Sequence[int] = MNIST_SHAPE, num_classes: int = 10) -> None:
        super().__init__()
        shape = check_shape(input_shape, "input_shape")
        num_classes = check_num_classes(num_classes)
        if shape == MNIST_SHAPE:
            self.features, self.classifier = _mnist_layers(num_classes)
        elif shape == CIFAR10_SHAPE:
            self.features, self.classifier = _cifar10_layers(num_classes)
        else:
            raise DPVisionError(
                f"TanhCNN takes images of shape {MNIST_SHAPE} (MNIST, Fashion-MNIST) or "
                f"{CIFAR10_SHAPE} (CIFAR-10), got {shape}; resize the images or use "
                "wide_resnet() for other sizes"
            )
        self.input_shape = shape
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps images (N, C, H, W) to logits (N, num_classes)."""
        result: torch.Tensor = self.classifier(self.features(x))
        return result


def tanh_cnn(input_shape: Sequence[int] = MNIST_SHAPE, num_classes: int = 10) -> TanhCNN:
    """Builds the Tanh CNN of Tramèr & Boneh for the given image shape.

    Args:
        input_shape: (C, H, W): (1, 28, 28) gives the MNIST/Fashion-MNIST network, (3, 32, 32)
            the CIFAR-10 network.
        num_classes: Number of output logits.

    Returns:
        The network, in training mode.

    Raises:
        DPVisionError: Another input shape, or fewer than two classes.
    """
    return TanhCNN(input_shape, num_classes)
