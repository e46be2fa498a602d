"""Model inputs from images: uint8 (N, H, W, C) → float (N, C, H, W), standardised with
public per-dataset constants, a batch at a time when the images are larger than memory.

Privacy: every map here is per example with public constants; nothing is released.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dpvision.accounting import PrivacyLedger
from dpvision.data.core import images_to_tensor
from dpvision.devices import available_memory
from dpvision.errors import DPVisionError

# Published per-dataset channel statistics, used as public constants (as in every paper of
# the field); ``normalization = "none"`` keeps pixels in [0, 1] instead.
DATASET_STATISTICS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),  # jax_privacy
    "cifar10-jpeg": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),  # CIFAR-10's own
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


class LazyInputs:
    """Model inputs (N, C, H, W) made from uint8 images (N, H, W, C) a batch at a time.

    The images may be memory-mapped (``npy:DIR`` datasets) and larger than memory: only the
    rows indexed are read and converted (to float in [0, 1], then each of ``transforms``).
    Indexing with a tensor of indices or a slice returns a float32 tensor on ``device``.
    On an accelerator (:meth:`to`) the uint8 images are moved there once when they fit,
    so a batch is gathered, converted and augmented on the device; otherwise each batch is
    converted on the host and copied over.

    Privacy: a fixed per-example map with public constants; releases nothing.
    """

    def __init__(
        self,
        images: np.ndarray | torch.Tensor,
        transforms: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = (),
        device: torch.device | None = None,
    ) -> None:
        self.images = images
        self.transforms = transforms
        self.device = device or torch.device("cpu")

    @property
    def shape(self) -> torch.Size:
        count, height, width, channels = self.images.shape
        return torch.Size((count, channels, height, width))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: torch.Tensor | slice) -> torch.Tensor:
        if isinstance(self.images, torch.Tensor):  # uint8 on the device: convert there
            rows = index.to(self.images.device) if isinstance(index, torch.Tensor) else index
            inputs = self.images[rows].permute(0, 3, 1, 2).to(torch.float32).div_(255.0)
        else:
            rows = index.cpu().numpy() if isinstance(index, torch.Tensor) else index
            inputs = images_to_tensor(np.ascontiguousarray(self.images[rows]))
            inputs = inputs.to(self.device, non_blocking=True)
        for transform in self.transforms:
            inputs = transform(inputs)
        return inputs.contiguous()

    def map(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> "LazyInputs":
        """The same inputs followed by ``transform`` (applied per batch)."""
        return LazyInputs(self.images, (*self.transforms, transform), self.device)

    def to(self, device: torch.device) -> "LazyInputs":
        """These inputs made on ``device``; the uint8 images go there once if they take at
        most half of its free memory (on the CPU nothing moves)."""
        if device.type == "cpu":
            return LazyInputs(self.images, self.transforms, device)
        images = self.images
        free = available_memory(device)
        if isinstance(images, np.ndarray) and free is not None and images.nbytes <= free // 2:
            images = torch.from_numpy(np.ascontiguousarray(images)).to(device)
        return LazyInputs(images, self.transforms, device)


Statistics = tuple[tuple[float, ...], tuple[float, ...]]
"""Per-channel ``(mean, std)`` of pixels in [0, 1]: public constants."""


def dataset_statistics(dataset: str) -> Statistics:
    """The published statistics of ``dataset`` (``learner.normalization = "dataset"``)."""
    if dataset not in DATASET_STATISTICS:
        raise DPVisionError(
            f"no published statistics for {dataset}; set learner.normalization = 'none' "
            f"(known: {', '.join(DATASET_STATISTICS)})"
        )
    return DATASET_STATISTICS[dataset]


def lazy_pixel_inputs(
    images: np.ndarray, dataset: str, normalization: str | Statistics | None
) -> LazyInputs:
    """:func:`pixel_inputs`, made a batch at a time when indexed."""
    statistics = _statistics(dataset, normalization)
    if statistics is None:
        return LazyInputs(images)
    return LazyInputs(images, (_standardizer(statistics),))


def _statistics(dataset: str, normalization: str | Statistics | None) -> Statistics | None:
    if normalization == "dataset":
        return dataset_statistics(dataset)
    if normalization is None or isinstance(normalization, str):
        return None
    return normalization


def _standardizer(statistics: Statistics) -> Callable[[torch.Tensor], torch.Tensor]:
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in statistics)
    return lambda inputs: (inputs - mean.to(inputs.device)) / std.to(inputs.device)


def pixel_inputs(
    images: np.ndarray, dataset: str, normalization: str | Statistics | None
) -> torch.Tensor:
    """uint8 images (N, H, W, C) → float (N, C, H, W) in [0, 1], then standardised with the
    published per-dataset statistics when ``normalization = "dataset"``, or with the
    ``(mean, std)`` given instead of a name (a weight file's: :func:`dpvision.runs.network.
    pixel_statistics`); any other name leaves them in [0, 1].

    Privacy: a fixed per-example map with public constants; releases nothing.
    """
    inputs = images_to_tensor(images)
    statistics = _statistics(dataset, normalization)
    if statistics is None:
        return inputs
    return _standardizer(statistics)(inputs)


@dataclasses.dataclass
class TrainingData:
    """The inputs and labels of a DP-SGD run, and the ledger of how they were made.

    ``train_x`` and ``test_x`` are model inputs (N, C, H, W): a tensor, or
    :class:`LazyInputs` converted a batch at a time. ``ledger`` holds the private
    preprocessing that made them (empty for pixels); ``num_classes`` is public (config or
    registry), never read off the labels. ``validation_x``/``validation_y``: the rows held
    out of the training data (:mod:`dpvision.data.validation`), or None.
    """

    name: str
    train_x: torch.Tensor | LazyInputs
    train_y: torch.Tensor
    test_x: torch.Tensor | LazyInputs
    test_y: torch.Tensor
    num_classes: int
    ledger: PrivacyLedger
    validation_x: torch.Tensor | LazyInputs | None = None
    validation_y: torch.Tensor | None = None
    image_shape: tuple[int, ...] | None = None  # (H, W, C) of the images the inputs come from
    class_names: tuple[str, ...] | None = None
    train_keys: np.ndarray | None = None  # one public digest per training row (augmentation)

    def to(self, device: torch.device) -> "TrainingData":
        """The same data with inputs made on ``device`` and labels there (see
        :meth:`LazyInputs.to`); on the CPU, the very same tensors."""

        def move(x: Any) -> Any:
            return None if x is None else x.to(device)

        return dataclasses.replace(
            self,
            train_x=move(self.train_x),
            train_y=move(self.train_y),
            test_x=move(self.test_x),
            test_y=move(self.test_y),
            validation_x=move(self.validation_x),
            validation_y=move(self.validation_y),
        )
