"""Augmentation multiplicity views: shapes, crops, flips, padding modes, determinism."""

import numpy as np
import pytest
import torch
from scipy import stats

from dpvision.data.augment import augment_views
from dpvision.errors import DPVisionError


def _images(batch: int = 3, side: int = 6) -> torch.Tensor:
    return torch.arange(batch * 2 * side * side, dtype=torch.float32).reshape(batch, 2, side, side)


def test_every_view_is_a_window_of_the_padded_image_possibly_flipped() -> None:
    images = _images()
    views = augment_views(images, 5, torch.Generator().manual_seed(1), padding=2, mode="zeros")
    assert views.shape == (3, 5, 2, 6, 6)
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for b in range(3):
        for k in range(5):
            found = any(
                torch.equal(views[b, k], window) or torch.equal(views[b, k], window.flip(-1))
                for dy in range(5)
                for dx in range(5)
                for window in [padded[b, :, dy : dy + 6, dx : dx + 6]]
            )
            assert found, (b, k)


def test_offsets_and_flips_are_uniform() -> None:
    side, padding, draws = 12, 3, 7000
    images = (torch.arange(side * side, dtype=torch.float32) + 1).view(1, 1, side, side)
    views = augment_views(
        images, draws, torch.Generator().manual_seed(0), padding=padding, mode="zeros"
    )
    center = float(images[0, 0, side // 2, side // 2])
    where = (views[0, :, 0] == center).nonzero()  # (draws, 3): view, row, column
    assert len(where) == draws  # the centre pixel is in every view, once
    rows, cols = where[:, 1], where[:, 2]
    flipped = views[0, where[:, 0], 0, rows, cols + 1] == center - 1  # left neighbour on the right
    dy = side // 2 + padding - rows
    dx = torch.where(flipped, side // 2 + padding - (side - 1 - cols), side // 2 + padding - cols)
    assert abs(flipped.float().mean().item() - 0.5) < 0.025  # ½ ± 4 standard errors
    for offsets in (dy, dx):
        counts = np.bincount(offsets.numpy(), minlength=2 * padding + 1)
        assert len(counts) == 2 * padding + 1
        assert stats.chisquare(counts).pvalue > 1e-4


def test_padding_modes_match_numpy() -> None:
    images = _images(1, 5)
    for mode, numpy_mode in [("reflect", "reflect"), ("symmetric", "symmetric")]:
        padded = np.pad(images.numpy(), ((0, 0), (0, 0), (2, 2), (2, 2)), mode=numpy_mode)
        views = augment_views(
            images, 200, torch.Generator().manual_seed(0), padding=2, mode=mode, flip=False
        )
        windows = {
            padded[0, :, dy : dy + 5, dx : dx + 5].tobytes() for dy in range(5) for dx in range(5)
        }
        assert all(view.numpy().tobytes() in windows for view in views[0])


def test_same_generator_state_gives_the_same_views() -> None:
    images = _images()
    generator = torch.Generator().manual_seed(7)
    state = generator.get_state()
    first = augment_views(images, 4, generator)  # noqa: F841 (advances the generator)
    second = augment_views(images, 4, generator)
    generator.set_state(state)
    augment_views(images, 4, generator)
    assert torch.equal(augment_views(images, 4, generator), second)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"views": 0}, "augmult must be >= 1"), ({"mode": "wrap"}, "unknown padding mode")],
)
def test_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    arguments = {"views": 2, "mode": "reflect", **kwargs}
    with pytest.raises(DPVisionError, match=message):
        augment_views(_images(), arguments.pop("views"), torch.Generator(), **arguments)  # type: ignore[arg-type]
