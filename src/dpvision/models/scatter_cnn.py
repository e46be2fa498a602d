"""CNN heads on ScatterNet features, the "ScatterNet + CNN" models of Tramèr & Boneh.

The architectures are those of ``MNIST_CNN`` and ``CIFAR10_CNN`` for ScatterNet inputs
(``in_channels`` 81 and 243) in the Handcrafted-DP code (``models.py``) for Tramèr & Boneh
(2021), "Differentially Private Learning Needs Better Features (or Much More Data)", with the
``input_norm="GroupNorm"`` option: a data-independent group normalisation of each example's
features (``nn.GroupNorm(groups, K, affine=False)``), which costs no privacy budget.
"""

from collections.abc import Sequence

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models._common import check_num_classes, check_shape

MNIST_FEATURE_SHAPE = (81, 7, 7)
CIFAR10_FEATURE_SHAPE = (243, 8, 8)


class ScatterCNN(nn.Module):
    """Tanh CNN on ScatterNet features (K, h, w), with group normalisation in front.

    Follows the ScatterNet CNNs of the Handcrafted-DP code (Tramèr & Boneh, 2021):

    * (81, 7, 7) (MNIST, Fashion-MNIST): GroupNorm(groups, 81, affine=False) –
      conv(81→16, 3, stride 2, padding 1) – tanh – conv(16→32, 3, padding 1) – tanh –
      flatten (32·4·4 = 512) – linear(512→32) – tanh – linear(32→classes).
      33,066 parameters for 10 classes.
    * (243, 8, 8) (CIFAR-10): GroupNorm(groups, 243, affine=False) –
      conv(243→64, 3, padding 1) – tanh – maxpool(2, 2) – conv(64→64, 3, padding 1) – tanh –
      flatten (64·4·4 = 1024) – linear(1024→classes). 187,210 parameters for 10 classes.

    The forward pass also takes features flattened to (N, K·h·w), as the Handcrafted-DP code
    does.

    Args:
        feature_shape: (K, h, w) of the ScatterNet features: (81, 7, 7) or (243, 8, 8).
        num_classes: Number of output logits.
        groups: Groups of the input GroupNorm (27 in Tramèr & Boneh); must divide K. 0 means
            no input norm, for features normalised beforehand (PrivDataNorm, "BN" in the
            paper).

    Raises:
        DPVisionError: Another feature shape, ``groups`` not dividing K, or fewer than two
            classes.
    """

    def __init__(
        self,
        feature_shape: Sequence[int] = MNIST_FEATURE_SHAPE,
        num_classes: int = 10,
        groups: int = 27,
    ) -> None:
        super().__init__()
        shape = check_shape(feature_shape, "feature_shape")
        num_classes = check_num_classes(num_classes)
        channels = shape[0]
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
            raise DPVisionError(f"groups must be a non-negative integer, got {groups!r}")
        if groups and channels % groups:
            raise DPVisionError(
                f"groups={groups} does not divide the {channels} feature channels; pick a "
                f"divisor of {channels} (Tramèr & Boneh use 27)"
            )
        # groups = 0: no input norm (the features were normalised before, e.g. privately).
        self.norm: nn.Module = (
            nn.GroupNorm(groups, channels, affine=False) if groups else nn.Identity()
        )
        if shape == MNIST_FEATURE_SHAPE:
            # 7 → conv 3/2 pad 1 → 4 → conv 3/1 pad 1 → 4.
            self.features = nn.Sequential(
                nn.Conv2d(channels, 16, kernel_size=3, stride=2, padding=1),
                nn.Tanh(),
                nn.Conv2d(16, 32, kernel_size=3, stride=1, padding=1),
                nn.Tanh(),
            )
            self.classifier: nn.Module = nn.Sequential(
                nn.Flatten(),
                nn.Linear(32 * 4 * 4, 32),
                nn.Tanh(),
                nn.Linear(32, num_classes),
            )
        elif shape == CIFAR10_FEATURE_SHAPE:
            # 8 → conv 3/1 pad 1 → 8 → maxpool 2/2 → 4 → conv 3/1 pad 1 → 4.
            self.features = nn.Sequential(
                nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1),
                nn.Tanh(),
                nn.MaxPool2d(kernel_size=2, stride=2),
                nn.Conv2d(64, 64, kernel_size=3, stride=1, padding=1),
                nn.Tanh(),
            )
            self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, num_classes))
        else:
            raise DPVisionError(
                f"ScatterCNN takes ScatterNet features of shape {MNIST_FEATURE_SHAPE} "
                f"(28×28 grayscale) or {CIFAR10_FEATURE_SHAPE} (32×32 RGB), got {shape}; "
                "extract them with the default scatternet features (J=2, L=8, no pooling)"
            )
        self.feature_shape = shape
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps features (N, K, h, w) or (N, K·h·w) to logits (N, num_classes)."""
        x = x.reshape(x.shape[0], *self.feature_shape)
        result: torch.Tensor = self.classifier(self.features(self.norm(x)))
        return result


def scatter_cnn(
    feature_shape: Sequence[int] = MNIST_FEATURE_SHAPE, num_classes: int = 10, groups: int = 27
) -> ScatterCNN:
    """Builds the ScatterNet + CNN model of Tramèr & Boneh for the given feature shape.

    Args:
        feature_shape: (K, h, w): (81, 7, 7) for MNIST/Fashion-MNIST, (243, 8, 8) for CIFAR-10.
        num_classes: Number of output logits.
        groups: Groups of the data-independent input GroupNorm; must divide K.

    Returns:
        The network, in training mode.

    Raises:
        DPVisionError: Another feature shape, ``groups`` not dividing K, or fewer than two
            classes.
    """
    return ScatterCNN(feature_shape, num_classes, groups)
