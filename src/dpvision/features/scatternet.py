"""ScatterNet features: the 2-D scattering transform (Tramèr & Boneh, ICLR 2021).

With the defaults ``J = 2`` scales, ``L = 8`` orientations and order 2, each input channel
gives ``1 + L·J + L²·J·(J−1)/2 = 81`` channels at ``H/4 × W/4``: ``(81, 7, 7)`` for
Fashion-MNIST and ``(243, 8, 8)`` for CIFAR-10, as in the Handcrafted-DP code
(``data.get_scatter_transform``). The ``K = 81·C`` channels are ordered input channel first,
then kymatio's order within a channel (``S0``, the ``S1`` paths, the ``S2`` paths).

The filters, the padding and the output are kymatio's ``Scattering2D`` (its Morlet filter
bank and padded size are used as they are); the transform itself is computed here, equal
to kymatio's to float32 rounding (tested), and faster (measured against kymatio's in one
run by ``benchmarks/scatternet_speed.py``). The notation follows kymatio's core:

- the padded image ``x`` and its spectrum ``X = F x``;
- first order ``U1 = |F⁻¹ P_{2^j1}(X · ψ̂_{j1,θ1})|`` at resolution ``j1``;
- second order ``U2 = |F⁻¹ P_{2^(j2−j1)}(F U1 · ψ̂_{j2,θ2})|``;
- each ``S = (U ⋆ φ_J)`` subsampled to ``2^J`` and unpadded by one pixel a side.

Here ``P_k`` periodises a spectrum ``k``-fold, i.e. subsamples in space. Where kymatio
runs one path at a time, this batches all orientations of a scale into one broadcast
product and one FFT call, and periodises while multiplying (no full-size product is
made).

The low-pass ``φ_J`` is an isotropic Gaussian: its spatial kernel is separable (rank one
to float precision, checked where the plan is built), so each ``S`` is two small
matrix products with the subsampled circulant factors instead of an FFT, a product
and an inverse FFT.

Input normalisation also follows the Handcrafted-DP code: grayscale images are scattered
as ``[0, 1]`` pixels (``ToTensor`` only); RGB images are first standardised with the fixed
ImageNet mean and standard deviation :data:`IMAGENET_MEAN` / :data:`IMAGENET_STD`.

kymatio's filter bank is imported from its 2-D module: ``import kymatio.torch`` also
imports the 3-D transform, which fails with SciPy >= 1.17 (``scipy.special.sph_harm`` was
removed).
"""

from __future__ import annotations

# local imports: start-up time (heavy modules are imported in the functions using them)
import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

from dpvision.errors import DPVisionError

if TYPE_CHECKING:
    import torch

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "TRANSFORM", "scatter", "scattering_channels"]

TRANSFORM = "dpvision-1"
"""Which implementation computed the features, in the feature cache's key: features that
kymatio's own transform made (equal to float32 rounding) are kept apart."""

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


_CHUNK = 256
"""Channel-images transformed at once: bounds the second-order intermediates to
``256 · L² · (H'/2)·(W'/2)`` complex values (52 MB for CIFAR-10) whatever the batch."""


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The fixed operators of one scattering configuration, on one device.

    Attributes:
        pads: Reflection padding ``(top, bottom, left, right)``, kymatio's.
        psi: ``psi[j][res]``: the ``L`` wavelet spectra of scale ``j`` at resolution
            ``res``, complex ``(L, M/2^res, N/2^res)``.
        low: ``low[j]``: the low-pass at resolution ``j`` as ``(rows, cols)`` factor pairs
            (one pair: φ is separable), each already subsampled to ``2^J`` and unpadded.
        scales, max_order: ``J`` and the order.
    """

    pads: tuple[int, int, int, int]
    psi: list[list[torch.Tensor]]
    low: list[list[tuple[torch.Tensor, torch.Tensor]]]
    scales: int
    max_order: int


def _lowpass_factors(
    phi_hat: np.ndarray, step: int, device: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``φ``'s spatial kernel as factor pairs ``(G, Hᵀ)`` with ``S = Σ G · U · Hᵀ``.

    ``G[a, x] = g((step·a − x) mod m)`` for the output rows ``a`` kept after unpadding (the
    first and the last are dropped), likewise ``H`` for the columns; ``g ⊗ h`` are the
    singular pairs of the kernel above float32 rounding (one, for the Gaussian).
    """
    import torch

    kernel = np.fft.ifft2(phi_hat).real.astype(np.float64)
    rows, cols = kernel.shape
    left, weights, right = np.linalg.svd(kernel)
    kept_rows = np.arange(0, rows, step)[1:-1]
    kept_cols = np.arange(0, cols, step)[1:-1]
    factors = []
    for r in np.flatnonzero(weights > weights[0] * 1e-6):
        g = left[:, r] * weights[r]
        h = right[r]
        g_matrix = g[(kept_rows[:, None] - np.arange(rows)[None]) % rows]
        h_matrix = h[(kept_cols[:, None] - np.arange(cols)[None]) % cols]
        factors.append(
            (
                torch.tensor(g_matrix, dtype=torch.float32, device=device),
                torch.tensor(h_matrix.T.copy(), dtype=torch.float32, device=device),
            )
        )
    return factors


@functools.lru_cache(maxsize=8)
def _plan(height: int, width: int, scales: int, angles: int, max_order: int, device: str) -> _Plan:
    """Builds (once per configuration and device) the filters of the transform.

    Raises:
        DPVisionError: If the image is too small for ``scales``.
    """
    import torch
    from kymatio.scattering2d.filter_bank import filter_bank
    from kymatio.scattering2d.utils import compute_padding

    if min(height, width) < 2**scales:
        raise DPVisionError(
            f"scatternet with scales={scales} needs images of at least {2**scales}x{2**scales} "
            f"pixels, got {height}x{width}; lower scales"
        )
    padded_height, padded_width = compute_padding(height, width, scales)
    pads = (
        (padded_height - height) // 2,
        (padded_height - height + 1) // 2,
        (padded_width - width) // 2,
        (padded_width - width + 1) // 2,
    )
    bank = filter_bank(padded_height, padded_width, scales, angles)
    psi = [
        [
            torch.tensor(
                np.stack([f["levels"][res] for f in bank["psi"] if f["j"] == j]),
                dtype=torch.complex64,
                device=device,
            )
            for res in range(min(j + 1, max(scales - 1, 1)))
        ]
        for j in range(scales)
    ]
    low = [
        _lowpass_factors(phi, 2 ** (scales - j), device)
        for j, phi in enumerate(bank["phi"]["levels"])
    ]
    return _Plan(pads, psi, low, scales, max_order)


def _blocks(spectrum: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The ``k × k`` blocks of the last two axes, row-major (views)."""
    rows, cols = spectrum.shape[-2] // k, spectrum.shape[-1] // k
    return [
        spectrum[..., a * rows : (a + 1) * rows, b * cols : (b + 1) * cols]
        for a in range(k)
        for b in range(k)
    ]


def _filter_periodize(spectrum: torch.Tensor, filters: torch.Tensor, k: int) -> torch.Tensor:
    """``P_k(spectrum · filters)``: the product periodised ``k``-fold (the mean of its
    ``k²`` blocks, kymatio's ``subsample_fourier``), made block by block."""
    if k == 1:
        return spectrum * filters
    parts, weights = _blocks(spectrum, k), _blocks(filters, k)
    out = parts[0] * weights[0]
    for part, weight in zip(parts[1:], weights[1:], strict=True):
        out.addcmul_(part, weight)
    return out.mul_(1.0 / (k * k))


def _modulus(field: torch.Tensor) -> torch.Tensor:
    """``|field|`` of a complex tensor (``hypot`` of its parts: faster than ``abs`` here)."""
    import torch

    pair = torch.view_as_real(field)
    return torch.hypot(pair[..., 0], pair[..., 1])


def _low_pass(plan: _Plan, u: torch.Tensor, j: int) -> torch.Tensor:
    """``S``: ``u`` at resolution ``j`` low-passed, subsampled to ``2^J`` and unpadded."""
    out = None
    for rows, cols_t in plan.low[j]:
        part = rows @ u @ cols_t
        out = part if out is None else out + part
    assert out is not None  # the kernel has at least one singular pair
    return out


def _pad(plan: _Plan, x: torch.Tensor) -> torch.Tensor:
    """kymatio's reflection padding, including its case of a pad as wide as the image."""
    import torch
    from torch.nn.functional import pad

    top, bottom, left, right = plan.pads
    height, width = x.shape[-2:]
    tall, wide = top == height, left == width  # reflect needs pad < size: one less, then
    x = pad(x[:, None], (left - wide, right - wide, top - tall, bottom - tall), mode="reflect")
    if tall:
        x = torch.cat([x[:, :, 1:2], x, x[:, :, -2:-1]], 2)
    if wide:
        x = torch.cat([x[:, :, :, 1:2], x, x[:, :, :, -2:-1]], 3)
    return x[:, 0]


def _transform(plan: _Plan, x: torch.Tensor) -> torch.Tensor:
    """The scattering of ``(B, H, W)`` real images: ``(B, K_c, h, w)`` in kymatio's order."""
    import torch

    x = _pad(plan, x)
    out = [_low_pass(plan, x, 0)[:, None]]
    second = []
    spectrum = torch.fft.fft2(x)[:, None]
    for j1 in range(plan.scales):
        u1 = _modulus(torch.fft.ifft2(_filter_periodize(spectrum, plan.psi[j1][0], 2**j1)))
        out.append(_low_pass(plan, u1, j1))
        if plan.max_order < 2 or j1 == plan.scales - 1:
            continue
        u1_spectrum = torch.fft.fft2(u1)[:, :, None]  # (B, L, 1, m, n)
        paths = []
        for j2 in range(j1 + 1, plan.scales):
            band = _filter_periodize(u1_spectrum, plan.psi[j2][j1], 2 ** (j2 - j1))
            paths.append(_low_pass(plan, _modulus(torch.fft.ifft2(band)), j2))
        second.append(torch.cat(paths, 2).flatten(1, 2))  # θ1, then (j2, θ2)
    return torch.cat(out + second, 1)


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

    from dpvision.per_example.precision import exact_arithmetic  # imports torch

    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise DPVisionError(
            "scatternet takes grayscale (C=1) or RGB (C=3) images, got a batch of shape "
            f"{tuple(images.shape)} (N, C, H, W)"
        )
    count, channels, height, width = (int(size) for size in images.shape)
    plan = _plan(height, width, scales, angles, max_order, str(images.device))
    if channels == 3:
        mean = torch.tensor(IMAGENET_MEAN, dtype=images.dtype, device=images.device)
        std = torch.tensor(IMAGENET_STD, dtype=images.dtype, device=images.device)
        images = (images - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    if count == 0:  # FFTs refuse empty batches
        rows, cols_t = plan.low[0][0]
        shape = (
            0,
            scattering_channels(channels, scales=scales, angles=angles, max_order=max_order),
        )
        return images.new_empty((*shape, rows.shape[0], cols_t.shape[1]))
    flat = images.reshape(count * channels, height, width).float()
    with exact_arithmetic(images.device):  # the low-pass products: not TF32, bf16, autocast
        maps = torch.cat(
            [_transform(plan, flat[i : i + _CHUNK]) for i in range(0, len(flat), _CHUNK)]
        )
    return maps.reshape(count, -1, maps.shape[-2], maps.shape[-1])  # (N, C·K_c, h, w)
