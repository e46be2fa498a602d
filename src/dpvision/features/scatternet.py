"""ScatterNet features: the 2-D scattering transform of kymatio (Tramèr & Boneh, ICLR 2021).

With the defaults ``J = 2`` scales, ``L = 8`` orientations and order 2, each input channel
gives ``1 + L·J + L²·J·(J−1)/2 = 81`` channels at ``H/4 × W/4``: ``(81, 7, 7)`` for
Fashion-MNIST and ``(243, 8, 8)`` for CIFAR-10, as in the Handcrafted-DP code
(``data.get_scatter_transform``). The ``K = 81·C`` channels are ordered input channel first,
then kymatio's order within a channel.

Input normalisation also follows that code: grayscale images are scattered as ``[0, 1]``
pixels (``ToTensor`` only); RGB images are first standardised with the fixed ImageNet mean
and standard deviation :data:`IMAGENET_MEAN` / :data:`IMAGENET_STD`.

kymatio is imported through its 2-D torch frontend module: ``import kymatio.torch`` also
imports the 3-D transform, which fails with SciPy >= 1.17 (``scipy.special.sph_harm`` was
removed).
"""

from __future__ import annotations

# local imports: start-up time (heavy modules are imported in the functions using them)
import functools
from typing import TYPE_CHECKING, Any

from dpvision.errors import DPVisionError

if TYPE_CHECKING:
    import torch

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "scatter", "scattering_channels"]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
"""Per-channel mean subtracted from RGB images before scattering (a public constant)."""

IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
"""Per-channel standard deviation that RGB images are divided by before scattering."""


def scattering_channels(
    channels: int, *, scales: int = 2, angles: int = 8, max_order: int = 2
) -> int:
    """Number of output channels ``K`` of the scattering of a ``channels``-channel image.

    >>> scattering_channels(1), scattering_channels(3)
    (81, 243)

    Args:
        channels: Input channels ``C``.
        scales: ``J``.
        angles: ``L``.
        max_order: 1 or 2.

    Returns:
        ``C · (1 + L·J)`` for order 1, ``C · (1 + L·J + L²·J·(J−1)/2)`` for order 2.
    """
    per_channel = 1 + angles * scales
    if max_order >= 2:
        per_channel += angles * angles * scales * (scales - 1) // 2
    return channels * per_channel


@functools.lru_cache(maxsize=8)
def _scattering(
    height: int, width: int, scales: int, angles: int, max_order: int, device: str
) -> Any:
    """Builds (once per configuration) kymatio's scattering module for this size and device.

    Raises:
        DPVisionError: If the image is too small for ``scales``.
    """
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

    if min(height, width) < 2**scales:
        raise DPVisionError(
            f"scatternet with scales={scales} needs images of at least {2**scales}x{2**scales} "
            f"pixels, got {height}x{width}; lower scales"
        )
    try:
        module = ScatteringTorch2D(J=scales, shape=(height, width), L=angles, max_order=max_order)
    except RuntimeError as error:  # kymatio's own size checks
        raise DPVisionError(
            f"kymatio cannot scatter {height}x{width} images with scales={scales}: {error}"
        ) from None
    return module.to(device)


def scatter(
    images: torch.Tensor, *, scales: int = 2, angles: int = 8, max_order: int = 2
) -> torch.Tensor:
    """Scatters a batch of ``[0, 1]`` images into ``(N, K, h, w)`` feature maps.

    Args:
        images: ``float32`` tensor ``(N, C, H, W)`` with values in ``[0, 1]``, as made by
            :func:`dpvision.data.images_to_tensor`; ``C`` is 1 (grayscale) or 3 (RGB). The
            scattering runs on the tensor's device.
        scales: ``J``.
        angles: ``L``.
        max_order: 1 or 2.

    Returns:
        ``float32`` tensor ``(N, K, h, w)`` with ``K`` = :func:`scattering_channels`.

    Raises:
        DPVisionError: If ``C`` is neither 1 nor 3, or the images are too small.

    Privacy:
        A fixed function of each image separately, with fixed constants (the ImageNet
        statistics are public): it uses no statistic of the data and costs no privacy.
    """
    import torch

    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise DPVisionError(
            "scatternet takes grayscale (C=1) or RGB (C=3) images, got a batch of shape "
            f"{tuple(images.shape)} (N, C, H, W)"
        )
    count, channels, height, width = (int(size) for size in images.shape)
    transform = _scattering(height, width, scales, angles, max_order, str(images.device))
    if channels == 3:
        mean = torch.tensor(IMAGENET_MEAN, dtype=images.dtype, device=images.device)
        std = torch.tensor(IMAGENET_STD, dtype=images.dtype, device=images.device)
        images = (images - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    maps: torch.Tensor = transform(images.contiguous())  # (N, C, K_c, h, w)
    return maps.reshape(count, -1, maps.shape[-2], maps.shape[-1])
