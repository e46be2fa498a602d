"""Per-example clipping: equals micro-batches of one; K views are averaged, then clipped."""

import math

import pytest
import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.per_example import ClippedGradientSum, clipped_gradient_sum

LOSS = nn.CrossEntropyLoss(reduction="none")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.Tanh(),
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    ).double()


def _reference(model, x, y, clip, views):
    """Loop of micro-batches of one: average the view gradients, clip, sum."""
    total = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    for i in range(len(x)):
        model.zero_grad()
        xi = x[i] if views else x[i : i + 1]
        LOSS(model(xi), y[i].expand(len(xi))).mean().backward()
        g = {k: v.grad.clone() for k, v in model.named_parameters()}
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g.values()))
        c = min(1.0, clip / norm)
        for k in total:
            total[k] += c * g[k]
    return total


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize("clip", [0.05, 100.0])
def test_equals_micro_batches_of_one(views, clip):
    model = _model()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 1, 6, 6, generator=gen, dtype=torch.float64)
    x = x if views else x[:, 0]
    y = torch.tensor([0, 1, 2, 1, 0])
    got = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=clip, views=views)
    expected = _reference(model, x, y, clip, views)
    for k in expected:
        torch.testing.assert_close(got.grads[k], expected[k], rtol=1e-10, atol=1e-12)
    assert got.count == 5
    assert got.nonfinite == 0


def test_views_are_averaged_before_clipping_not_after():
    model = _model()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 4, 1, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.tensor([1])
    clip = 1e-3
    got = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=clip, views=True)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in got.grads.values()))
    assert norm == pytest.approx(clip)  # one clipped average, not a sum of 4 clipped views


def test_one_example_moves_the_sum_by_at_most_the_clip_norm():
    model = _model()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    huge = torch.full((1, 1, 6, 6), 1e4, dtype=torch.float64)
    a = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=0.3)
    b = clipped_gradient_sum(
        model, LOSS, torch.cat([x, huge]), torch.cat([y, y[:1]]), max_grad_norm=0.3
    )
    change = math.sqrt(sum(float((b.grads[k] - a.grads[k]).pow(2).sum()) for k in a.grads))
    assert 0.99 * 0.3 <= change <= 0.3 * (1 + 1e-9)


def test_nonfinite_and_masked_examples_contribute_nothing():
    model = _model()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 1, 6, 6, generator=gen, dtype=torch.float64)
    x[1, 0, 0, 0] = float("nan")
    y = torch.tensor([0, 1, 2, 0])
    mask = torch.tensor([True, True, True, False])
    got = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=1.0, mask=mask)
    only_first_and_third = clipped_gradient_sum(
        model, LOSS, x[[0, 2]], y[[0, 2]], max_grad_norm=1.0
    )
    assert got.nonfinite == 1
    assert got.count == 2
    for k in got.grads:
        assert torch.isfinite(got.grads[k]).all()
        torch.testing.assert_close(got.grads[k], only_first_and_third.grads[k])


def test_bad_clip_norm():
    with pytest.raises(DPVisionError):
        clipped_gradient_sum(
            _model(),
            LOSS,
            torch.zeros(1, 1, 6, 6, dtype=torch.float64),
            torch.tensor([0]),
            max_grad_norm=0.0,
        )


def test_clipped_sums_of_other_sensitivities_are_not_added():
    # Noise is scaled to the total's stated sensitivity: a part clipped to another C would
    # make that statement false, so accumulation refuses it.
    params = {"w": torch.zeros(3)}
    total = ClippedGradientSum.zeros(params, l2_sensitivity=1.0)
    part = ClippedGradientSum.zeros(params, l2_sensitivity=2.0)
    with pytest.raises(DPVisionError, match="sensitivity"):
        total.add_(part)
    same = ClippedGradientSum.zeros(params, l2_sensitivity=1.0)
    same.grads["w"] += 1.0
    total.add_(same)
    assert torch.equal(total.grads["w"], torch.ones(3))
