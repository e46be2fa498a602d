"""Contrastive representation learning: the views and the loss of DP-RandP's Phase I.

* :func:`contrastive_views` — SimCLR-style random views of a batch of images, made on the
  fly in torch: random resized crop (scale 0.08–1, aspect 3/4–4/3), horizontal flip, colour
  jitter (brightness, contrast, saturation 0.4, hue 0.1 here; Baradad et al. use 0.4 for
  hue as well), random grayscale (p = 0.2), as in the ``align_uniform`` code of Baradad et
  al. (2021) that DP-RandP runs.
* :func:`align_uniform_loss` — the alignment + uniformity loss of Wang & Isola (2020),
  α = 2, t = 2: ``‖f(x) − f(y)‖²`` averaged over positive pairs, plus
  ``log mean_{i<j} exp(−t‖f(xᵢ) − f(xⱼ)‖²)`` averaged over the two views.

Nothing here touches private data: Phase I runs on synthetic images only.

>>> import torch
>>> x = torch.nn.functional.normalize(torch.randn(8, 4), dim=1)
>>> float(alignment(x, x))
0.0
>>> bool(uniformity(x) < 0)
True
"""

import math

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)


def alignment(x: torch.Tensor, y: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    """Mean over pairs of ``‖xᵢ − yᵢ‖^α`` (Wang & Isola's ℒ_align)."""
    return (x - y).norm(dim=1).pow(alpha).mean()


def uniformity(x: torch.Tensor, t: float = 2.0) -> torch.Tensor:
    """``log mean_{i<j} exp(−t‖xᵢ − xⱼ‖²)`` (Wang & Isola's ℒ_uniform)."""
    return torch.pdist(x, p=2).pow(2).mul(-t).exp().mean().log()


def align_uniform_loss(
    x: torch.Tensor, y: torch.Tensor, alpha: float = 2.0, t: float = 2.0
) -> torch.Tensor:
    """ℒ_align(x, y) + (ℒ_uniform(x) + ℒ_uniform(y)) / 2 on L2-normalised embeddings."""
    return alignment(x, y, alpha) + (uniformity(x, t) + uniformity(y, t)) / 2


def _uniform(
    n: int, low: float, high: float, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    # Drawn on the generator's device (the CPU: its state is checkpointed), used on ``device``.
    return (low + (high - low) * torch.rand(n, generator=generator)).to(device)


def random_resized_crop(
    images: torch.Tensor,
    generator: torch.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> torch.Tensor:
    """A random crop of each image (area fraction in ``scale``, aspect ratio in ``ratio``,
    log-uniform), resized back to the input size with bilinear sampling."""
    n, device = images.shape[0], images.device
    area = _uniform(n, *scale, generator, device)
    log_ratio = _uniform(n, math.log(ratio[0]), math.log(ratio[1]), generator, device)
    aspect = log_ratio.exp()
    width = (area * aspect).sqrt().clamp(max=1.0)  # fractions of the image side
    height = (area / aspect).sqrt().clamp(max=1.0)
    cx = (_uniform(n, 0, 1, generator, device) * 2 - 1) * (1 - width)
    cy = (_uniform(n, 0, 1, generator, device) * 2 - 1) * (1 - height)
    theta = torch.zeros(n, 2, 3, device=device)
    theta[:, 0, 0], theta[:, 0, 2] = width, cx
    theta[:, 1, 1], theta[:, 1, 2] = height, cy
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _gray(images: torch.Tensor) -> torch.Tensor:
    if images.shape[1] == 1:
        return images
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=images.dtype, device=images.device)
    weights = weights.view(1, 3, 1, 1)
    return (images * weights).sum(dim=1, keepdim=True)


def color_jitter(
    images: torch.Tensor,
    generator: torch.Generator,
    brightness: float = 0.4,
    contrast: float = 0.4,
    saturation: float = 0.4,
    hue: float = 0.1,
) -> torch.Tensor:
    """Random brightness, contrast, saturation (RGB) and hue (RGB, a rotation of the YIQ
    chroma plane by up to ±hue·360°) of images in [0, 1]; clipped to [0, 1]."""
    n, device = images.shape[0], images.device
    shape = (n, 1, 1, 1)
    out = images * _uniform(n, 1 - brightness, 1 + brightness, generator, device).view(shape)
    mean = _gray(out).mean(dim=(1, 2, 3), keepdim=True)
    factor = _uniform(n, 1 - contrast, 1 + contrast, generator, device).view(shape)
    out = (mean + factor * (out - mean)).clamp(0, 1)
    if images.shape[1] == 3:
        factor = _uniform(n, 1 - saturation, 1 + saturation, generator, device).view(shape)
        gray = _gray(out)
        out = (gray + factor * (out - gray)).clamp(0, 1)
        angle = _uniform(n, -hue, hue, generator, device) * 2 * math.pi
        to_yiq = torch.tensor(
            [[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]],
            device=device,
        )
        rotation = torch.zeros(n, 3, 3, device=device)
        rotation[:, 0, 0] = 1
        rotation[:, 1, 1], rotation[:, 1, 2] = angle.cos(), -angle.sin()
        rotation[:, 2, 1], rotation[:, 2, 2] = angle.sin(), angle.cos()
        matrix = torch.linalg.inv(to_yiq) @ rotation @ to_yiq  # (n, 3, 3)
        out = torch.einsum("nij,njhw->nihw", matrix, out).clamp(0, 1)
    return out


def contrastive_views(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One random view of each image in [0, 1] (N, C, H, W): crop, flip, jitter, grayscale."""
    out = random_resized_crop(images, generator)
    flip = _uniform(len(out), 0, 1, generator, out.device) < 0.5
    out = torch.where(flip.view(-1, 1, 1, 1), out.flip(-1), out)
    out = color_jitter(out, generator)
    if out.shape[1] == 3:
        gray = _uniform(len(out), 0, 1, generator, out.device) < 0.2
        out = torch.where(gray.view(-1, 1, 1, 1), _gray(out).expand_as(out), out)
    return out
