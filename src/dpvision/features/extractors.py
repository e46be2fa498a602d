"""Batched, data-independent feature extraction: ``uint8`` images -> ``float32`` features.

:func:`extract_features` runs the pipeline of a :class:`~dpvision.features.FeatureSpec`
(extractor -> pooling -> flatten -> projection) over batches of images under
``torch.no_grad()``, writing each batch into a preallocated output, so memory stays at one
batch of intermediate maps plus the output (which :func:`extract_into` lets the caller place
in a memory-mapped file).

>>> import numpy as np
>>> from dpvision.features import FeatureSpec
>>> images = np.zeros((2, 28, 28, 1), dtype=np.uint8)
>>> extract_features(images, FeatureSpec("scatternet"), progress=False).shape
(2, 3969)
>>> feature_shape((32, 32, 3), FeatureSpec("scatternet", flatten=False))
(243, 8, 8)
"""

from __future__ import annotations

# local imports: start-up time (heavy modules are imported in the functions using them)
import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

from dpvision.data.core import images_to_float
from dpvision.errors import DPVisionError
from dpvision.features.backbone import EncoderFeatures, encoder_dim
from dpvision.features.progress import Progress
from dpvision.features.reductions import (
    average_pool,
    pooled_size,
    projection_matrix,
    rescale_to_norm,
)
from dpvision.features.scatternet import scatter
from dpvision.features.spec import NETWORK_FEATURES, FeatureSpec

if TYPE_CHECKING:
    import torch

__all__ = ["FEATURE_VERSION", "extract_features", "extract_into", "feature_shape"]

FEATURE_VERSION = 1
"""Version of the extraction code; bump it whenever a spec's output changes (it invalidates
every cached feature file)."""

DEFAULT_BATCH_SIZE = 1024
"""Images per extraction batch."""


def feature_shape(image_shape: tuple[int, ...], spec: FeatureSpec) -> tuple[int, ...]:
    """Shape of the features of one image: ``(D,)`` if ``spec.flatten``, else ``(K, h, w)``.

    ``encoder`` features are vectors: their maps are ``(D, 1, 1)`` (found with a forward
    pass of one all-zero image through the encoder).

    Args:
        image_shape: ``(H, W, C)`` of one image.
        spec: What to extract.

    Returns:
        The per-image feature shape that :func:`extract_features` produces.

    Raises:
        DPVisionError: If the image shape does not suit the extractor.
    """
    if spec.name == "precomputed":
        raise DPVisionError(
            "precomputed features are read from their folder, not extracted from images; "
            "they serve the feature learners (dp-ls, dp-newton, dp-fc, dp-sgd-linear) only"
        )
    height, width, channels = (int(size) for size in image_shape)
    if spec.name == "pixels":
        maps = (channels, height, width)
    elif spec.name in NETWORK_FEATURES:
        maps = (encoder_dim((height, width, channels), spec), 1, 1)
    else:
        import torch

        with torch.no_grad():
            probe = _feature_maps(torch.zeros(1, channels, height, width), spec)
        maps = (int(probe.shape[1]), int(probe.shape[2]), int(probe.shape[3]))
    maps = (maps[0], pooled_size(maps[1], spec.pool), pooled_size(maps[2], spec.pool))
    if not spec.flatten:
        return maps
    if spec.projection_dim is not None:
        return (spec.projection_dim,)
    return (math.prod(maps),)


def extract_features(
    images: np.ndarray,
    spec: FeatureSpec,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = True,
    device: str | None = None,
) -> np.ndarray:
    """Extracts the features described by ``spec`` from ``uint8`` images.

    Args:
        images: ``uint8`` array ``(N, H, W, C)``, e.g. ``dataset.train_images``.
        spec: What to extract.
        batch_size: Images per batch (bounds the memory of intermediate maps).
        progress: Show a progress line on stderr (only drawn when stderr is a terminal).
        device: torch device to compute on (default ``"cpu"``); results come back to NumPy.

    Returns:
        ``float32`` array ``(N, *feature_shape(images.shape[1:], spec))``.

    Raises:
        DPVisionError: If ``images`` is not a 4-d ``uint8`` array, ``batch_size < 1``, or the
            images do not suit the extractor.

    Privacy:
        Each example's features are a fixed function of that example alone (and of public
        constants and the public projection seed). No statistic of the dataset is computed,
        so extraction releases nothing and costs no privacy budget. For ``encoder`` features
        this holds when the encoder was trained without the private data (see
        :mod:`dpvision.features.backbone`).
    """
    _check_images(images)
    out = np.empty((len(images), *feature_shape(images.shape[1:], spec)), dtype=np.float32)
    _extract(images, spec, out, batch_size=batch_size, progress=progress, device=device)
    return out


def extract_into(
    images: np.ndarray,
    spec: FeatureSpec,
    out: np.ndarray,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = True,
    device: str | None = None,
    desc: str | None = None,
) -> None:
    """Like :func:`extract_features`, but writes into ``out`` (e.g. a ``np.memmap``).

    Args:
        images: ``uint8`` array ``(N, H, W, C)``.
        spec: What to extract.
        out: ``float32`` array of shape ``(N, *feature_shape(...))``, filled batch by batch.
        batch_size: Images per batch.
        progress: Show a progress line on stderr (only when stderr is a terminal).
        device: torch device to compute on (default ``"cpu"``).
        desc: Label of the progress line (default: the spec's name).

    Raises:
        DPVisionError: On bad images, ``batch_size`` or ``out``.

    Privacy:
        As :func:`extract_features`: per-example, data-independent, no privacy cost.
    """
    _extract(images, spec, out, batch_size=batch_size, progress=progress, device=device, desc=desc)


def _extract(
    images: np.ndarray,
    spec: FeatureSpec,
    out: np.ndarray,
    *,
    batch_size: int,
    progress: bool,
    device: str | None,
    desc: str | None = None,
) -> None:
    """The batch loop behind :func:`extract_features` and :func:`extract_into`."""
    import torch

    _check_images(images)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DPVisionError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    expected = (len(images), *feature_shape(images.shape[1:], spec))
    if out.shape != expected or out.dtype != np.float32:
        raise DPVisionError(
            f"out must be a float32 array of shape {expected}, got {out.dtype} {out.shape}"
        )
    target = torch.device(device or "cpu")
    encoder = None
    if spec.name in NETWORK_FEATURES:
        shape = tuple(int(v) for v in images.shape[1:])
        encoder = EncoderFeatures(spec, device=target, image_shape=shape)
    projection: torch.Tensor | None = None
    if spec.projection_dim is not None:
        flat = feature_shape(images.shape[1:], dataclasses.replace(spec, projection_dim=None))
        matrix = projection_matrix(flat[0], spec.projection_dim, seed=spec.projection_seed)
        projection = torch.from_numpy(matrix).to(target)
    count = len(images)
    with torch.no_grad(), Progress(count, desc or spec.name, enabled=progress) as bar:
        for start in range(0, count, batch_size):
            stop = min(start + batch_size, count)
            batch = torch.from_numpy(images_to_float(images[start:stop])).to(target)
            if encoder is not None:
                features = encoder(batch)
            else:
                features = average_pool(_feature_maps(batch, spec), spec.pool)
                if spec.flatten:
                    features = features.reshape(stop - start, -1)
            if projection is not None:
                features = features @ projection
            if spec.norm is not None:
                features = rescale_to_norm(features, spec.norm)
            out[start:stop] = features.reshape(stop - start, *out.shape[1:]).cpu().numpy()
            bar.update(stop - start)


def _feature_maps(batch: torch.Tensor, spec: FeatureSpec) -> torch.Tensor:
    """The extractor's ``(N, K, h, w)`` maps of a ``[0, 1]`` ``(N, C, H, W)`` batch."""
    if spec.name == "pixels":
        return batch
    return scatter(batch, scales=spec.scales, angles=spec.angles, max_order=spec.max_order)


def _check_images(images: object) -> None:
    """Raises a one-line :class:`DPVisionError` unless ``images`` is ``uint8 (N, H, W, C)``."""
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4:
        got = (
            f"{images.dtype} array of shape {images.shape}"
            if isinstance(images, np.ndarray)
            else type(images).__name__
        )
        raise DPVisionError(f"features are extracted from uint8 images (N, H, W, C), got {got}")


def encoder_features(
    images: np.ndarray,
    spec: FeatureSpec,
    *,
    batch_size: int = 256,
    progress: bool = False,
    device: str | None = None,
) -> np.ndarray:
    """The ``encoder`` features of ``uint8`` images ``(N, H, W, C)``: ``float32 (N, D)``.

    The same as :func:`dpvision.features.extract_features` for an ``encoder`` spec
    (including ``projection_dim`` and ``norm``).

    Raises:
        DPVisionError: ``spec`` is not an ``encoder`` spec, or as :class:`EncoderFeatures`.

    Privacy:
        Free for an encoder trained without the private data (see the module docstring).
    """
    if spec.name not in NETWORK_FEATURES:
        raise DPVisionError(f"encoder_features needs an encoder spec, got {spec.name!r}")
    return extract_features(images, spec, batch_size=batch_size, progress=progress, device=device)
