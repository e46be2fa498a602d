"""Augmentation multiplicity: K random crop + flip views of each example, made on the fly.

De et al. (2022, §3.1) draw K augmented views of every example in a logical batch and clip
the *average* of the K view-gradients; the views are made here, after per-dataset
normalisation, as in jax_privacy and TAN:

* pad each image by ``padding`` pixels on every side (``reflect`` as TAN/DP-RandP,
  ``symmetric`` as jax_privacy's edge-repeating mirror, or ``zeros``);
* crop a random window of the original size (offsets uniform in [0, 2·padding]);
* flip horizontally with probability ½.

All views of a batch are cut with one gather, and the randomness comes from a
``torch.Generator`` whose state is checkpointed with the run, so a resumed run draws the
same views. Augmentation touches each example only through its own views: it does not
change the sensitivity of the clipped sum (each example still contributes one clipped
gradient, the mean over its views).

>>> import torch
>>> images = torch.arange(2 * 1 * 4 * 4, dtype=torch.float32).reshape(2, 1, 4, 4)
>>> views = augment_views(images, 3, torch.Generator().manual_seed(0), padding=1)
>>> views.shape
torch.Size([2, 3, 1, 4, 4])
>>> bool((augment_views(images, 2, torch.Generator(), padding=0, flip=False)[:, 1] == images).all())
True
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)

from dpvision.errors import DPVisionError

PADDING_MODES = ("reflect", "symmetric", "zeros")


def _pad(images: torch.Tensor, padding: int, mode: str) -> torch.Tensor:
    if mode == "zeros":
        return F.pad(images, (padding,) * 4)
    if mode == "reflect":
        return F.pad(images, (padding,) * 4, mode="reflect")
    # symmetric: mirror including the edge pixel (numpy's "symmetric", jax_privacy's padding).
    height, width = images.shape[-2:]
    rows = torch.arange(-padding, height + padding)
    cols = torch.arange(-padding, width + padding)
    rows = torch.where(
        rows < 0, -rows - 1, torch.where(rows >= height, 2 * height - rows - 1, rows)
    )
    cols = torch.where(cols < 0, -cols - 1, torch.where(cols >= width, 2 * width - cols - 1, cols))
    return images[..., rows[:, None], cols[None, :]]


@dataclass(frozen=True)
class ViewDraws:
    """The random choices behind K views of B examples: crop offsets and flips, (B, K) each.

    Drawn for a whole logical batch at once and then sliced, so the views an example gets do
    not depend on how the batch is cut into physical micro-batches or shared among the
    processes of a distributed run.
    """

    dy: torch.Tensor
    dx: torch.Tensor
    flips: torch.Tensor

    def __len__(self) -> int:
        return len(self.dy)

    def __getitem__(self, index: slice | torch.Tensor) -> "ViewDraws":
        return ViewDraws(self.dy[index], self.dx[index], self.flips[index])


def draw_views(
    batch: int, views: int, generator: torch.Generator, *, padding: int = 4, flip: bool = True
) -> ViewDraws:
    """Draws the offsets (uniform in [0, 2·padding]) and flips (probability ½) of K views of
    ``batch`` examples, in that order, from ``generator``."""
    if views < 1:
        raise DPVisionError(f"augmult must be >= 1 views, got {views}")
    shape = (batch, views)
    dy = torch.randint(0, 2 * padding + 1, shape, generator=generator)
    dx = torch.randint(0, 2 * padding + 1, shape, generator=generator)
    flips = (
        torch.rand(shape, generator=generator) < 0.5
        if flip
        else torch.zeros(shape, dtype=torch.bool)
    )
    return ViewDraws(dy, dx, flips)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic): a bijective mix."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keyed_views(
    keys: np.ndarray,
    seed: int,
    step: int,
    views: int,
    *,
    padding: int = 4,
    flip: bool = True,
) -> ViewDraws:
    """The offsets and flips of K views of each example, from (``seed``, ``step``, the
    example's own ``key``) alone — never from its place in the batch.

    ``keys``: one uint64 per example (its digest, :func:`dpvision.data.splits.public_digests`).
    Adding or removing another example, wherever, changes no example's views, so with the
    public ``seed`` the clipped sum of a batch keeps its sensitivity C *for every value of
    the public randomness* (a shared stream drawn in batch order does not: one example more
    shifts the views of every example after it).

    >>> keys = np.array([1, 2, 3], dtype=np.uint64)
    >>> a = keyed_views(keys, seed=0, step=5, views=2, padding=1)
    >>> b = keyed_views(keys[[2, 0]], seed=0, step=5, views=2, padding=1)
    >>> bool((a.dy[[2, 0]] == b.dy).all() and (a.flips[[2, 0]] == b.flips).all())
    True
    """
    if views < 1:
        raise DPVisionError(f"augmult must be >= 1 views, got {views}")
    with np.errstate(over="ignore"):
        salt = _mix(np.array([seed % 2**64], dtype=np.uint64) ^ _mix(np.array([step], np.uint64)))
        base = _mix(np.asarray(keys, dtype=np.uint64) ^ salt)
        counter = np.arange(1, 3 * views + 1, dtype=np.uint64).reshape(views, 3) * _GOLDEN
        draws = _mix(base[:, None, None] + counter[None])  # (B, K, 3)
    span = np.uint64(2 * padding + 1)
    dy = torch.from_numpy((draws[..., 0] % span).astype(np.int64))
    dx = torch.from_numpy((draws[..., 1] % span).astype(np.int64))
    flips = torch.from_numpy((draws[..., 2] >> np.uint64(63)).astype(bool))
    return ViewDraws(dy, dx, flips if flip else torch.zeros_like(flips))


def apply_views(
    images: torch.Tensor, draws: ViewDraws, *, padding: int = 4, mode: str = "reflect"
) -> torch.Tensor:
    """The views ``draws`` describes, cut from ``images`` (B, C, H, W): (B, K, C, H, W)."""
    if images.dim() != 4:
        raise DPVisionError(
            f"augment_views expects (B, C, H, W) images, got shape {tuple(images.shape)}"
        )
    if mode not in PADDING_MODES:
        raise DPVisionError(
            f"unknown padding mode {mode!r}; choose one of {', '.join(PADDING_MODES)}"
        )
    if len(draws) != len(images):
        raise DPVisionError(f"{len(draws)} view draws for {len(images)} images")
    batch, _, height, width = images.shape
    if padding >= min(height, width) and mode != "zeros":
        raise DPVisionError(f"padding {padding} is too large for {height}×{width} images")
    padded = _pad(images, padding, mode) if padding else images
    cols = torch.arange(width)
    cols = torch.where(draws.flips[..., None], width - 1 - cols, cols)  # (B, K, W)
    rows = draws.dy[..., None] + torch.arange(height)  # (B, K, H)
    cols = draws.dx[..., None] + cols
    device = images.device
    index_b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    # Advanced indices around the channel slice put their broadcast dims first: (B, K, H, W, C).
    out = padded[index_b, :, rows.to(device)[..., :, None], cols.to(device)[..., None, :]]
    return out.permute(0, 1, 4, 2, 3).contiguous()


def augment_views(
    images: torch.Tensor,
    views: int,
    generator: torch.Generator,
    *,
    padding: int = 4,
    flip: bool = True,
    mode: str = "reflect",
) -> torch.Tensor:
    """K random crop (after padding) and horizontal-flip views of each image.

    Args:
      images: float (B, C, H, W).
      views: K ≥ 1, the augmentation multiplicity.
      generator: the source of randomness (CPU generator; its state is part of a checkpoint).
      padding: pixels padded on each side before cropping back to H × W (0: no crop).
      flip: whether each view is flipped horizontally with probability ½.
      mode: ``reflect``, ``symmetric`` or ``zeros`` padding.

    Returns:
      (B, K, C, H, W) views on the device of ``images``.
    """
    if images.dim() != 4:
        raise DPVisionError(
            f"augment_views expects (B, C, H, W) images, got shape {tuple(images.shape)}"
        )
    draws = draw_views(len(images), views, generator, padding=padding, flip=flip)
    return apply_views(images, draws, padding=padding, mode=mode)
