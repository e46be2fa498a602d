"""Book-keeping clipping equals the vmap reference, for every model family and edge case."""

import math

import pytest
import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.mechanisms.clip_policy import FlatClip
from dpvision.models import WSConv2d, scatter_cnn, tanh_cnn, wide_resnet
from dpvision.per_example import (
    bookkeeping_clipped_gradient_sum,
    clip_and_sum,
    clipped_gradient_sum,
    supports_bookkeeping,
)
from dpvision.per_example.bookkeeping import _bookkeeping_sum

LOSS = nn.CrossEntropyLoss(reduction="none")


class _SeqMLP(nn.Module):
    """Linear layers on (N, T, d) inputs, one of them called twice (shared weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 5)
        self.shared = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(torch.tanh(self.inner(input=x))))  # a keyword input too
        h = torch.tanh(self.shared(h))
        return self.head(h.mean(1))


class _OddConvs(nn.Module):
    """Convolutions with dilation, 'same' padding, non-square kernels and WS 'same' stride 2."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, dilation=2, padding="same")  # 12×14 = 168 positions
        self.b = nn.Conv2d(3, 4, (3, 2), stride=2, padding=(1, 0), bias=False)
        self.norm = nn.GroupNorm(2, 4)
        self.c = WSConv2d(4, 4, 3, stride=2, padding="same")
        self.head = nn.Linear(4 * 3 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = self.norm(torch.tanh(self.b(h)))
        return self.head(torch.tanh(self.c(h)).flatten(1))


class _NormLayers(nn.Module):
    """LayerNorm on (N, T, d) (one called twice) and over two trailing dims, PReLU with one
    and with per-channel parameters, affine InstanceNorm2d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.instance = nn.InstanceNorm2d(4, affine=True)
        self.prelu_c = nn.PReLU(4)
        self.embed = nn.Linear(4, 8)
        self.layer = nn.LayerNorm(8)
        self.layer_2d = nn.LayerNorm((36, 8))
        self.prelu = nn.PReLU()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.prelu_c(self.instance(self.conv(x)))  # (N, 4, 6, 6)
        tokens = self.layer(self.embed(h.flatten(2).transpose(1, 2)))  # (N, 36, 8)
        tokens = self.layer(self.prelu(self.layer_2d(tokens)))
        return self.head(tokens.mean(1))


MODELS = {
    "tanh-mnist": (lambda: tanh_cnn((1, 28, 28)), (1, 28, 28)),
    "tanh-cifar": (lambda: tanh_cnn((3, 32, 32)), (3, 32, 32)),
    "scatter-81": (lambda: scatter_cnn((81, 7, 7)), (81, 7, 7)),
    "scatter-243": (lambda: scatter_cnn((243, 8, 8)), (243, 8, 8)),
    "wrn-10-1": (lambda: wide_resnet(depth=10, width=1), (3, 16, 16)),
    "seq-mlp": (_SeqMLP, (4, 6)),
    "odd-convs": (_OddConvs, (2, 12, 14)),
    "norm-layers": (_NormLayers, (2, 8, 8)),
}


def _data(shape, batch, views, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    lead = (batch, views) if views else (batch,)
    x = torch.randn(*lead, *shape, generator=gen, dtype=dtype)
    y = torch.randint(0, 3, (batch,), generator=gen)
    return x, y


def _assert_same(got, expected, rtol=1e-9, atol=1e-12):
    assert got.grads.keys() == expected.grads.keys()
    for name in expected.grads:
        torch.testing.assert_close(got.grads[name], expected.grads[name], rtol=rtol, atol=atol)
    torch.testing.assert_close(got.norms, expected.norms, rtol=rtol, atol=atol)
    assert (got.count, got.nonfinite, got.l2_sensitivity) == (
        expected.count,
        expected.nonfinite,
        expected.l2_sensitivity,
    )


@pytest.mark.parametrize("views", [0, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_equals_vmap_reference(name, views):
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build().double()
    x, y = _data(shape, 3, views, seed=1)
    # A clip norm between the smallest and largest gradient norms: some clipped, some not.
    norms = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=1.0, views=bool(views)).norms
    clip = float(norms.median())
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=clip, views=bool(views))
    got = bookkeeping_clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=clip, views=bool(views))
    _assert_same(got, expected)
    assert supports_bookkeeping(model)
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("strategy", ["ghost", "pixel", "materialise"])
@pytest.mark.parametrize("name", ["odd-convs", "seq-mlp", "wrn-10-1"])
def test_ghost_and_materialised_norms_agree_with_the_reference(name, strategy):
    build, shape = MODELS[name]
    torch.manual_seed(2)
    model = build().double()
    x, y = _data(shape, 2, 2, seed=3)
    _assert_strategy_clips_as_the_reference(model, x, y, True, strategy)


def _assert_strategy_clips_as_the_reference(model, x, y, views, strategy):
    """Book-keeping with ``strategy`` equals the reference, except that a WSConv2d weight's
    ghost norm is the upper bound (γ/s)‖G‖: never below the true norm, and the sums are
    exact wherever nothing is clipped."""

    def both(clip):
        expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=clip, views=views)
        got = _bookkeeping_sum(
            model, LOSS, x, y, policy=FlatClip(clip), views=views, mask=None, strategy=strategy
        )
        return got, expected

    got, expected = both(0.1)
    if strategy == "materialise" or not any(isinstance(m, WSConv2d) for m in model.modules()):
        _assert_same(got, expected)
        return
    assert bool((got.norms >= expected.norms * (1 - 1e-9)).all())
    assert bool((got.norms > expected.norms * (1 + 1e-6)).any())
    got, expected = both(1e9)
    for name in expected.grads:
        torch.testing.assert_close(got.grads[name], expected.grads[name], rtol=1e-9, atol=1e-12)


class _WSInPlace(nn.Module):
    """WSConv2d layers: one whose output is changed in place (its kept output is stale), ones
    with some gains at zero (aₜ·w̃ cannot come from the output there), one called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = WSConv2d(2, 4, 3, padding=1)
        self.b = WSConv2d(4, 4, 3, padding="same")
        self.c = WSConv2d(4, 3, 3, stride=2, padding=1)
        self.head = nn.Linear(3 * 4 * 4, 3)
        with torch.no_grad():
            self.b.gain[:2] = 0.0
            self.c.gain[1] = 0.0
            self.b.bias.uniform_(-0.5, 0.5)
            self.c.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.tanh(h.mul_(0.5))  # in place, after the layer
        h = torch.tanh(self.b(h)) + torch.tanh(self.b(h.flip(-1)))
        return self.head(torch.tanh(self.c(h)).flatten(1))


@pytest.mark.parametrize("strategy", ["ghost", "pixel", "materialise"])
@pytest.mark.parametrize("views", [0, 2])
def test_weight_standardised_layers_with_stale_outputs_and_zero_gains(strategy, views):
    torch.manual_seed(5)
    model = _WSInPlace().double()
    x, y = _data((2, 8, 8), 3, views, seed=6)
    _assert_strategy_clips_as_the_reference(model, x, y, bool(views), strategy)


def test_float32_matches_the_reference():
    torch.manual_seed(4)
    model = tanh_cnn((1, 28, 28))
    x, y = _data((1, 28, 28), 8, 0, seed=5, dtype=torch.float32)
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=0.05)
    got = bookkeeping_clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=0.05)
    _assert_same(got, expected, rtol=1e-4, atol=1e-6)


def test_mask_and_nonfinite_examples_are_zeroed_and_counted():
    torch.manual_seed(6)
    model = _OddConvs().double()
    x, y = _data((2, 12, 14), 5, 2, seed=7)
    x[1, 0, 0, 0, 0] = float("inf")
    x[3, 1, 1, 2, 3] = float("nan")
    mask = torch.tensor([True, True, False, True, True])
    got = bookkeeping_clipped_gradient_sum(
        model, LOSS, x, y, max_grad_norm=0.2, views=True, mask=mask
    )
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=0.2, views=True, mask=mask)
    only_good = bookkeeping_clipped_gradient_sum(
        model, LOSS, x[[0, 4]], y[[0, 4]], max_grad_norm=0.2, views=True
    )
    assert (got.nonfinite, got.count) == (2, 2)
    for name, value in got.grads.items():
        assert torch.isfinite(value).all()
        torch.testing.assert_close(value, expected.grads[name], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(value, only_good.grads[name], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["tanh-mnist", "norm-layers"])
def test_one_huge_example_moves_the_sum_by_at_most_the_clip_norm(name):
    build, shape = MODELS[name]
    torch.manual_seed(8)
    model = build().double()
    x, y = _data(shape, 4, 0, seed=9)
    huge = 1e3 * torch.randn(1, *shape, generator=torch.Generator().manual_seed(10)).double()
    clip = 0.3
    a = bookkeeping_clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=clip)
    b = bookkeeping_clipped_gradient_sum(
        model, LOSS, torch.cat([x, huge]), torch.cat([y, y[:1]]), max_grad_norm=clip
    )
    change = math.sqrt(sum(float((b.grads[k] - a.grads[k]).pow(2).sum()) for k in a.grads))
    assert b.norms[-1] > clip  # the new example really was clipped
    assert 0.99 * clip <= change <= clip * (1 + 1e-9)


def test_frozen_unsupported_layers_and_frozen_parameters_are_fine():
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 3)).double()
    model[1].requires_grad_(False)
    model[2].bias.requires_grad_(False)
    assert supports_bookkeeping(model)
    x, y = _data((4,), 4, 0, seed=14)
    got = clip_and_sum(model, LOSS, x, y, max_grad_norm=0.05, method="bookkeeping")
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=0.05)
    assert set(got.grads) == {"0.weight", "0.bias", "2.weight"}
    _assert_same(got, expected)


def test_shared_parameters_are_unsupported():
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    second.weight = first.weight
    assert not supports_bookkeeping(nn.Sequential(first, second))


def test_empty_batch_gives_zeros():
    model = tanh_cnn((1, 28, 28))
    for views, shape in [(False, (0, 1, 28, 28)), (True, (0, 2, 1, 28, 28))]:
        got = bookkeeping_clipped_gradient_sum(
            model,
            LOSS,
            torch.zeros(shape),
            torch.zeros(0, dtype=torch.long),
            max_grad_norm=1.0,
            views=views,
        )
        assert (got.count, got.nonfinite, got.norms.shape) == (0, 0, (0,))
        assert all(float(g.abs().sum()) == 0 for g in got.grads.values())
        assert got.grads.keys() == dict(model.named_parameters()).keys()


def test_hooks_are_removed_when_the_loss_fails():
    model = nn.Sequential(nn.Linear(4, 3))

    def broken(out, y):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        clip_and_sum(model, broken, torch.zeros(2, 4), torch.zeros(2), max_grad_norm=1.0)
    assert not model[0]._forward_hooks


def test_mean_reduced_loss_falls_back_or_is_refused():
    torch.manual_seed(15)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    x, y = _data((4,), 3, 0, seed=16)
    mean_loss = nn.CrossEntropyLoss()
    got = clip_and_sum(model, mean_loss, x, y, max_grad_norm=0.1)
    _assert_same(got, clipped_gradient_sum(model, mean_loss, x, y, max_grad_norm=0.1))
    with pytest.raises(DPVisionError, match="reduction='none'"):
        clip_and_sum(model, mean_loss, x, y, max_grad_norm=0.1, method="bookkeeping")


def test_bad_arguments():
    model = nn.Linear(2, 2)
    x, y = torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)
    with pytest.raises(DPVisionError, match="max_grad_norm"):
        clip_and_sum(model, LOSS, x, y, max_grad_norm=0.0)
    with pytest.raises(DPVisionError, match="unknown clipping method"):
        clip_and_sum(model, LOSS, x, y, max_grad_norm=1.0, method="ghost")


@pytest.mark.parametrize("views", [1, 4])
def test_a_gradient_that_cancels_to_zero_is_not_mistaken_for_an_outside_use(views):
    # The stem gain of a WRN feeds a GroupNorm, which undoes its scale: its total gradient is
    # zero up to rounding, and rounding on 64·K images of 32×32 is far above 1e-6 of it.
    torch.manual_seed(0)
    model = wide_resnet(10, 1, num_classes=10, groups=16)
    x, y = torch.randn(64, views, 3, 32, 32), torch.randint(0, 10, (64,))
    got = clip_and_sum(model, LOSS, x, y, max_grad_norm=1.0, views=True, method="bookkeeping")
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=1.0, views=True)
    _assert_same(got, expected, rtol=1e-3, atol=5e-4)  # float32, summed in other orders


class _Tokens(nn.Module):
    """Token ids → Embedding (padding row 0, looked up twice) → LayerNorm → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 5, padding_idx=0)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x)) + self.embed(x.flip(-1))
        return self.head(h.mean(1))


@pytest.mark.parametrize("views", [0, 3])
def test_embedding_equals_vmap_reference(views):
    torch.manual_seed(15)
    model = _Tokens().double()
    gen = torch.Generator().manual_seed(16)
    lead = (5, views) if views else (5,)
    x = torch.randint(0, 7, (*lead, 6), generator=gen)
    y = torch.randint(0, 3, (5,), generator=gen)
    norms = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=1.0, views=bool(views)).norms
    clip = float(norms.median())
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=clip, views=bool(views))
    got = bookkeeping_clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=clip, views=bool(views))
    _assert_same(got, expected)
    assert supports_bookkeeping(model)
    assert float(got.grads["embed.weight"][0].abs().max()) == 0.0  # the padding row


def test_embedding_options_that_break_per_example_clipping_are_refused():
    assert not supports_bookkeeping(nn.Sequential(nn.Embedding(5, 3, max_norm=1.0)))
    assert not supports_bookkeeping(nn.Sequential(nn.Embedding(5, 3, sparse=True)))


def test_one_added_token_sequence_moves_the_embedding_sum_by_at_most_the_clip_norm():
    torch.manual_seed(17)
    model = _Tokens().double()
    with torch.no_grad():
        model.head.weight.mul_(1e3)  # the added example's gradient is huge: it must be clipped
    assert supports_bookkeeping(model)
    gen = torch.Generator().manual_seed(18)
    x, y = torch.randint(0, 7, (4, 6), generator=gen), torch.randint(0, 3, (4,), generator=gen)
    extra = torch.tensor([[3, 3, 3, 5, 5, 1]])
    clip = 0.3
    a = bookkeeping_clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=clip)
    b = bookkeeping_clipped_gradient_sum(
        model, LOSS, torch.cat([x, extra]), torch.cat([y, y[:1]]), max_grad_norm=clip
    )
    change = math.sqrt(sum(float((b.grads[k] - a.grads[k]).pow(2).sum()) for k in a.grads))
    assert b.norms[-1] > clip
    assert 0.99 * clip <= change <= clip * (1 + 1e-9)


class _TwoSizes(nn.Module):
    """One Conv2d on 12×12 (grouped kernel, the weight's order) and on 6×6 (im2col order)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self.conv(nn.functional.avg_pool2d(x, 2)).mean((2, 3))
        return self.head(torch.cat([self.conv(x).mean((2, 3)), small], 1))


@pytest.mark.parametrize("views", [0, 2])
def test_per_example_gradients_of_calls_in_different_orders_add_up(views):
    torch.manual_seed(20)
    model = _TwoSizes().double()
    x, y = _data((2, 12, 12), 4, views, seed=21)
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=0.1, views=bool(views))
    got = _bookkeeping_sum(
        model,
        LOSS,
        x,
        y,
        policy=FlatClip(0.1),
        views=bool(views),
        mask=None,
        strategy="materialise",
    )
    _assert_same(got, expected)


def test_dense_layers_terms_are_computed_and_their_records_freed_during_the_backward():
    """The tape calls on_ready as each layer's output gradient arrives, last layer first;
    book-keeping computes a dense layer's terms there and forgets its input and output
    gradient, so that they are freed as the backward pass goes on, not at its end."""
    from dpvision.per_example import bookkeeping
    from dpvision.per_example.tape import ActivationTape

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(64, 3)
    )
    x, y = torch.randn(5, 1, 8, 8), torch.randint(0, 3, (5,))
    seen: list[tuple[str, bool, int]] = []  # (layer, in the backward pass, inputs held)
    original = ActivationTape.forget

    def forget(tape, module):
        held = sum(len(v) for v in tape.inputs.values())
        backward = torch._C._current_autograd_node() is not None
        seen.append((type(module).__name__, backward, held))
        original(tape, module)

    ActivationTape.forget = forget
    try:
        got = bookkeeping.clip_and_sum(model, LOSS, x, y, max_grad_norm=0.5, method="bookkeeping")
    finally:
        ActivationTape.forget = original
    # Last layer first, each forgotten as soon as its gradient came: records shrink.
    assert [name for name, _, _ in seen] == ["Linear", "Conv2d", "Conv2d"]
    assert all(backward for _, backward, _ in seen)
    assert [held for _, _, held in seen] == [3, 2, 1]
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=0.5)
    for name, grad in expected.grads.items():
        torch.testing.assert_close(got.grads[name], grad, rtol=1e-5, atol=1e-6)
