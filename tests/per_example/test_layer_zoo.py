"""Every layer kind of the zoo: book-keeping equals micro-batches of one (the vmap
reference) to 1e-9 in float64, with and without K views; each is handled by its own rule."""

import math
import warnings

import pytest
import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.mechanisms.clip_policy import FlatClip
from dpvision.models import FrozenBatchNorm, freeze_batchnorm, validate_model
from dpvision.per_example import clip_and_sum, clipped_gradient_sum, supports_bookkeeping
from dpvision.per_example.bookkeeping import _bookkeeping_sum, unsupported_layers
from dpvision.per_example.layers import claims, layer_terms
from dpvision.per_example.layers.attention import AttentionTerms
from dpvision.per_example.layers.conv import ConvTerms
from dpvision.per_example.layers.free_parameters import FreeParameterTerms
from dpvision.per_example.layers.functional import FunctionalTerms
from dpvision.per_example.tape import ActivationTape
from layer_zoo import ZOO, ScaleShift, TinyViT

LOSS = nn.CrossEntropyLoss(reduction="none")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # the vmap reference's fallback warnings
        warnings.simplefilter("ignore", UserWarning)
        yield


def _data(shape, batch, views, seed):
    gen = torch.Generator().manual_seed(seed)
    lead = (batch, views) if views else (batch,)
    x = torch.randn(*lead, *shape, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (batch,), generator=gen)


def _assert_same(got, expected):
    assert got.grads.keys() == expected.grads.keys()
    for name in expected.grads:
        torch.testing.assert_close(got.grads[name], expected.grads[name], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.norms, expected.norms, rtol=1e-9, atol=1e-12)
    assert got.count == expected.count


@pytest.mark.parametrize("views", [0, 3])
@pytest.mark.parametrize("name", list(ZOO))
def test_bookkeeping_equals_micro_batches_of_one(name, views):
    build, shape = ZOO[name]
    torch.manual_seed(0)
    model = build().double()
    x, y = _data(shape, 4, views, seed=1)
    norms = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=1.0, views=bool(views)).norms
    clip = float(norms.median())  # some examples clipped, some not
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=clip, views=bool(views))
    got = clip_and_sum(
        model, LOSS, x, y, max_grad_norm=clip, views=bool(views), method="bookkeeping"
    )
    _assert_same(got, expected)
    assert supports_bookkeeping(model)
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("strategy", ["ghost", "materialise"])
@pytest.mark.parametrize("name", ["vit", "cross-attention"])
def test_attention_projections_by_ghost_and_materialised_norms(name, strategy):
    build, shape = ZOO[name]
    torch.manual_seed(2)
    model = build().double()
    x, y = _data(shape, 3, 2, seed=3)
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=0.1, views=True)
    got = _bookkeeping_sum(
        model, LOSS, x, y, policy=FlatClip(0.1), views=True, mask=None, strategy=strategy
    )
    _assert_same(got, expected)


def _terms_by_path(model, x, y):
    tape = ActivationTape(model, mode="edges")
    with tape.attached():
        loss = LOSS(model(x), y).sum()
        tape.set_edge_grads(torch.autograd.grad(loss, tape.edges, allow_unused=True))
        return {path: layer_terms(module, calls, 1) for path, module, calls in tape.calls()}


def test_each_layer_kind_has_its_own_rule():
    torch.manual_seed(4)
    vit = TinyViT().double()
    kinds = {claim.path: claim.kind for claim in claims(vit)}
    assert kinds[""] == kinds["block"] == "free"  # class token, position embedding, scales
    assert kinds["encoder.self_attn"] == kinds["block.attn"] == "unit"
    assert "encoder.self_attn.out_proj" not in kinds  # the unit owns its subtree
    terms = _terms_by_path(vit, *_data((2, 8, 8), 3, 0, seed=5))
    assert isinstance(terms["encoder.self_attn"], AttentionTerms)  # not torch.func
    assert isinstance(terms[""], FreeParameterTerms)
    build, shape = ZOO["conv-zoo"]
    zoo = build().double()
    terms = _terms_by_path(zoo, *_data(shape, 3, 0, seed=6))
    assert all(isinstance(terms[p], ConvTerms) for p in ("depthwise", "grouped", "conv1d"))
    build, shape = ZOO["unknown-leaf"]
    leaf = build().double()
    terms = _terms_by_path(leaf, *_data(shape, 3, 0, seed=7))
    assert isinstance(terms["2"], FunctionalTerms)  # the leaf alone, not the whole model
    assert {c.path: c.kind for c in claims(leaf)} == {"0": "layer", "2": "unit", "3": "layer"}


def test_convolutions_too_large_to_keep_are_summed_by_a_second_kernel(monkeypatch):
    from dpvision.per_example.layers import conv

    build, shape = ZOO["conv-zoo"]
    torch.manual_seed(8)
    model = build().double()
    x, y = _data(shape, 5, 2, seed=9)
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=0.05, views=True)
    monkeypatch.setattr(conv, "MATERIALISE_BYTES", 1)  # one example at a time, not kept
    got = clip_and_sum(model, LOSS, x, y, max_grad_norm=0.05, views=True, method="bookkeeping")
    _assert_same(got, expected)


def test_one_huge_example_moves_the_zoo_sums_by_at_most_the_clip_norm():
    for name, (build, shape) in ZOO.items():
        torch.manual_seed(10)
        model = build().double()
        x, y = _data(shape, 4, 0, seed=11)
        huge = 30 * torch.randn(1, *shape, generator=torch.Generator().manual_seed(12)).double()
        clip = 0.05
        a = clip_and_sum(model, LOSS, x, y, max_grad_norm=clip, method="bookkeeping")
        b = clip_and_sum(
            model,
            LOSS,
            torch.cat([x, huge]),
            torch.cat([y, y[:1]]),
            max_grad_norm=clip,
            method="bookkeeping",
        )
        change = math.sqrt(sum(float((b.grads[k] - a.grads[k]).pow(2).sum()) for k in a.grads))
        assert b.norms[-1] > clip, name
        assert 0.99 * clip <= change <= clip * (1 + 1e-9), name


class _FreeMatmul(nn.Module):
    """A free parameter used by a matrix product: no per-example rule can follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.eye(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x @ self.proj)


def test_free_parameters_used_in_ways_no_rule_follows_fall_back_or_are_refused():
    torch.manual_seed(13)
    model = _FreeMatmul().double()
    x, y = _data((4,), 4, 0, seed=14)
    with pytest.raises(DPVisionError, match="free parameter proj used by matmul"):
        clip_and_sum(model, LOSS, x, y, max_grad_norm=0.1, method="bookkeeping")
    got = clip_and_sum(model, LOSS, x, y, max_grad_norm=0.1)  # auto: the whole-model vmap
    _assert_same(got, clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=0.1))


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (nn.MultiheadAttention(4, 2, batch_first=True, dropout=0.1), "attention dropout"),
        (nn.MultiheadAttention(4, 2), "batch_first=False"),
        (nn.BatchNorm1d(4), "freeze_batchnorm"),
        (nn.BatchNorm1d(4, track_running_stats=False).eval(), "replace it with GroupNorm"),
    ],
    ids=["mha-dropout", "mha-sequence-first", "batchnorm-train", "batchnorm-no-stats"],
)
def test_layers_that_cannot_be_clipped_per_example_say_what_to_do(layer, message):
    problems = unsupported_layers(nn.Sequential(nn.Linear(4, 4), layer))
    assert len(problems) == 1
    assert message in problems[0]
    assert problems[0].endswith("at 1")


def test_frozen_batchnorm_computes_what_batchnorm_computed_in_evaluation():
    torch.manual_seed(15)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Tanh(), nn.Flatten())
    model.train()
    model(torch.randn(16, 2, 6, 6))  # running statistics that are not the defaults
    x = torch.randn(3, 2, 6, 6)
    frozen = freeze_batchnorm(model)
    assert isinstance(frozen[1], FrozenBatchNorm)
    assert isinstance(model[1], nn.BatchNorm2d)  # the original is left alone
    frozen.train()
    validate_model(frozen)
    with pytest.raises(DPVisionError, match="freeze_batchnorm"):
        validate_model(model)
    model.eval()
    validate_model(model)  # BatchNorm in evaluation mode normalises per example too
    torch.testing.assert_close(frozen(x), model(x))
    assert frozen.state_dict().keys() == model.state_dict().keys()
    assert frozen[1].weight.requires_grad


def test_a_layer_no_rule_knows_is_clipped_alone():
    # Only ScaleShift is recomputed: its forward runs once more (per row, under vmap), the
    # Linear layers' forwards run once.
    torch.manual_seed(16)
    build, shape = ZOO["unknown-leaf"]
    model = build().double()
    x, y = _data(shape, 6, 0, seed=17)
    clip_and_sum(model, LOSS, x, y, max_grad_norm=0.1, method="bookkeeping")  # verified once
    counts = {"linear": 0, "leaf": 0}

    def count(kind):
        def hook(*_):
            counts[kind] += 1

        return hook

    handles = [model[0].register_forward_hook(count("linear"))]
    handles.append(model[2].register_forward_hook(count("leaf")))
    clip_and_sum(model, LOSS, x, y, max_grad_norm=0.1, method="bookkeeping")
    for handle in handles:
        handle.remove()
    assert counts == {"linear": 1, "leaf": 2}
    assert isinstance(model[2], ScaleShift)


@pytest.mark.parametrize("views", [0, 2])
@pytest.mark.parametrize("name", ["conv-zoo", "vit", "convnext"])
def test_the_dpsgd_engine_steps_by_the_reference_sum_over_physical_chunks(name, views):
    from dpvision.accounting import PrivacyLedger
    from dpvision.training import DPSGDStep

    build, shape = ZOO[name]
    torch.manual_seed(18)
    model = build().double()
    x, y = _data(shape, 7, views, seed=19)
    clip, n = 0.05, 70
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=clip, views=bool(views))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    step = DPSGDStep.build(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        loss_fn=LOSS,
        noise_multiplier=0.0,
        max_grad_norm=clip,
        sample_rate=0.1,
        num_examples=n,
        ledger=PrivacyLedger(),
        generator=torch.Generator().manual_seed(0),
        views=bool(views),
        method="bookkeeping",
    )
    step([(x[:3], y[:3]), (x[3:5], y[3:5]), (x[5:], y[5:])])  # three physical chunks
    for key, param in model.named_parameters():
        moved = before[key] - param.detach()
        torch.testing.assert_close(moved, expected.grads[key] / (0.1 * n), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("views", [1, 3])
@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(4, 4, 7, padding=3, groups=4),  # ConvNeXt's depthwise 7×7
        nn.Conv2d(3, 6, (3, 2), stride=(2, 3), dilation=(2, 1), padding=(2, 0), groups=3),
        nn.Conv1d(2, 4, 3, stride=2, dilation=3, groups=2, padding=1, padding_mode="circular"),
        nn.Conv3d(2, 2, 2, dilation=(1, 2, 1), groups=2, padding="same", bias=False),
    ],
    ids=["convnext", "strided-dilated-multiplier", "conv1d-circular", "conv3d-same"],
)
def test_depthwise_gradients_by_a_forward_convolution_equal_the_grouped_kernel(conv, views):
    from dpvision.per_example.layers import conv as rule

    torch.manual_seed(11)
    layer = conv.double()
    size = {1: (11,), 2: (9, 10), 3: (4, 5, 5)}[layer.weight.dim() - 2]
    x = torch.randn(5 * views, layer.in_channels, *size, dtype=torch.float64)
    g = torch.randn_like(layer(x))
    fast = ConvTerms(layer, [(x, g)], views, "auto")
    padded, padding = fast._padded(x)
    grouped = rule._weight_grad(  # the general path: the examples as groups of one kernel
        layer,
        padded.reshape(5, views, *padded.shape[1:]).transpose(0, 1).flatten(1, 2),
        g.reshape(5, views, *g.shape[1:]).transpose(0, 1).flatten(1, 2),
        padding,
        5 * layer.groups,
    ).reshape(5, *layer.weight.shape)
    torch.testing.assert_close(fast.per_example, grouped, rtol=1e-10, atol=1e-12)
    rows = [slice(i * views, (i + 1) * views) for i in range(5)]
    own = [torch.autograd.grad((layer(x[r]) * g[r]).sum(), layer.weight)[0] for r in rows]
    torch.testing.assert_close(fast.per_example, torch.stack(own), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("views", [0, 3])
def test_grouped_kernels_over_chunks_of_examples_equal_micro_batches_of_one(monkeypatch, views):
    """Grouped weight-gradient kernels take GROUPED_CHUNK examples at a time (here 2 of 5):
    a dense convolution with many positions, a grouped one and a depthwise one."""
    from dpvision.per_example.layers import conv, dense

    monkeypatch.setattr(dense, "GROUPED_CHUNK", 2)
    monkeypatch.setattr(conv, "GROUPED_CHUNK", 2)
    torch.manual_seed(12)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),  # 12×12 = 144 positions: the grouped route
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, padding=1, groups=2),
        nn.Conv2d(4, 4, 3, padding=1, groups=4),
        nn.Flatten(),
        nn.Linear(4 * 144, 3),
    ).double()
    x, y = _data((2, 12, 12), 5, views, seed=13)
    expected = clipped_gradient_sum(model, LOSS, x, y, max_grad_norm=0.3, views=bool(views))
    got = clip_and_sum(
        model, LOSS, x, y, max_grad_norm=0.3, views=bool(views), method="bookkeeping"
    )
    _assert_same(got, expected)
