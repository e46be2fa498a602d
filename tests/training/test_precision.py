"""bf16: forward and backward under autocast, the privacy-relevant numbers in float32.

On the CPU (torch's bf16 autocast runs there too) the per-example norms and the clipped
sum stay close to the float32 ones, every example's contribution stays within C, and one
added example of huge norm moves the release by at most C.
"""

import functools

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)

from dpvision.devices import Placement
from dpvision.models.registry import build_model
from dpvision.per_example import clip_and_sum
from dpvision.testing import check_sensitivity, dpsgd_release

C = 1.0
MODELS = {
    "wrn-10-1": ((3, 16, 16), 10),  # WSConv2d + GroupNorm + Linear, book-keeping rules
    "tanh-cnn": ((1, 28, 28), 10),
}


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _model_and_data(name: str, n: int = 12, seed: int = 0):
    shape, classes = MODELS[name]
    torch.manual_seed(seed)
    model = build_model(name, shape, classes)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=generator)
    y = torch.randint(0, classes, (n,), generator=generator)
    return model, x, y


@pytest.mark.parametrize("method", ["bookkeeping", "vmap"])
@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_norms_and_clipped_sum_are_float32_and_close_to_fp32(name, method):
    model, x, y = _model_and_data(name)
    x = x * 3.0  # some examples clipped, some not
    exact = clip_and_sum(model, _loss, x, y, max_grad_norm=C, method=method)
    low = clip_and_sum(model, _loss, x, y, max_grad_norm=C, method=method, precision=torch.bfloat16)
    assert low.norms.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in low.grads.values())
    relative = ((low.norms - exact.norms).abs() / exact.norms).max()
    assert relative < 0.05, f"per-example norms differ by {float(relative):.3g} (relative)"
    flat_exact = torch.cat([g.reshape(-1) for g in exact.grads.values()])
    flat_low = torch.cat([low.grads[k].reshape(-1) for k in exact.grads])
    # The sum's rounding is measured against Σᵢ‖clip(gᵢ)‖, the size of what was summed
    # (the sum itself cancels to a fraction of it); DP noise is σC√d, far above either.
    summed = float(torch.clamp(exact.norms, max=C).sum())
    error = float(torch.linalg.vector_norm(flat_low - flat_exact)) / summed
    assert error < 0.06, f"clipped sums differ by {error:.3g} of Σ‖clip(g)‖"
    assert not torch.equal(flat_low, flat_exact)  # bf16 really ran


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_bookkeeping_and_vmap_clip_the_same_gradients(name):
    """Both paths clip each bf16 gradient with its own float32 norm: they agree far more
    closely with each other than either does with float32."""
    model, x, y = _model_and_data(name)
    both = [
        clip_and_sum(model, _loss, x * 3.0, y, max_grad_norm=C, method=m, precision=torch.bfloat16)
        for m in ("bookkeeping", "vmap")
    ]
    norms = ((both[0].norms - both[1].norms).abs() / both[1].norms).max()
    assert norms < 1e-3
    summed = float(torch.clamp(both[1].norms, max=C).sum())
    gap = torch.linalg.vector_norm(
        torch.cat([(both[0].grads[k] - g).reshape(-1) for k, g in both[1].grads.items()])
    )
    assert float(gap) < 1e-2 * summed


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_contribution_of_every_example_is_within_c(name):
    model, x, y = _model_and_data(name, n=6, seed=1)
    x = x * torch.logspace(-2, 4, len(x)).view(-1, *[1] * (x.dim() - 1))  # norms 0.01 … 1e4
    for i in range(len(x)):
        alone = clip_and_sum(
            model, _loss, x[i : i + 1], y[i : i + 1], max_grad_norm=C, precision=torch.bfloat16
        )
        norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in alone.grads.values()]))
        assert float(norm) <= C * (1 + 1e-6), f"example {i}: contribution {float(norm)} > C"


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_release_moves_by_at_most_c_on_neighbouring_datasets(name):
    model, x, y = _model_and_data(name, n=10, seed=2)
    run = dpsgd_release(model, max_grad_norm=C, precision=torch.bfloat16, physical_batch_size=4)
    report = check_sensitivity(run, (x, y), neighbours=3, scale=1e4, tolerance=1e-5)
    assert report.refusal is None, report.refusal
    assert report.ok, report.summary()
    assert report.max_ratio > 0.99, "the added example should reach the bound"


def test_bf16_release_would_fail_the_check_if_clipping_were_skipped():
    """The neighbouring check has teeth in bf16: an unclipped sum moves far beyond C."""
    model, x, y = _model_and_data("tanh-cnn", n=6, seed=3)
    run = dpsgd_release(model, max_grad_norm=1e6, precision=torch.bfloat16)  # C never binds
    report = check_sensitivity(run, (x, y), neighbours=1, scale=1e4, tolerance=1e-5)
    moved = max(m.movement for m in report.movements)
    assert moved > 5 * C  # what clipping to C = 1 would have cut down to 1


def test_placement_autocast_is_a_no_op_in_fp32_and_bf16_otherwise():
    fp32, bf16 = Placement(), Placement(torch.device("cpu"), "bf16")
    layer = torch.nn.Linear(4, 4)
    with fp32.autocast():
        assert layer(torch.ones(1, 4)).dtype == torch.float32
    with bf16.autocast():
        assert layer(torch.ones(1, 4)).dtype == torch.bfloat16
    assert fp32.compute_dtype is None
    assert bf16.compute_dtype is torch.bfloat16
    state = fp32.generator(7).get_state()
    assert torch.equal(state, torch.Generator().manual_seed(7).get_state())
    same = torch.randn(3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.randn(3, generator=fp32.generator(7)), same)


def test_bf16_bookkeeping_is_verified_in_float32_where_autograd_sums_in_bf16():
    """A LayerNorm behind a layer scale of 1e-6 (ConvNeXt's): its offset gradient is a sum
    of many cancelling terms, which the CPU's bfloat16 LayerNorm backward adds in bfloat16.
    Checked against that sum, book-keeping was refused as if the parameter were used outside
    its layer; the first call is now verified in a float32 pass and the bf16 step runs."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dwconv = torch.nn.Conv2d(16, 16, 7, padding=3, groups=16)
            self.norm = torch.nn.LayerNorm(16)
            self.fc = torch.nn.Linear(16, 16)
            self.gamma = torch.nn.Parameter(torch.full((16,), 1e-6))
            self.head = torch.nn.Linear(16, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(self.norm(self.dwconv(x).permute(0, 2, 3, 1))) * self.gamma
            return self.head((x + h.permute(0, 3, 1, 2)).mean((2, 3)))

    torch.manual_seed(0)
    model = Block()
    x, y = torch.randn(32, 16, 16, 16), torch.randint(0, 10, (32,))
    loss = functools.partial(F.cross_entropy, reduction="none")
    got = clip_and_sum(
        model, loss, x, y, max_grad_norm=1.0, method="bookkeeping", precision=torch.bfloat16
    )
    fp32 = clip_and_sum(model, loss, x, y, max_grad_norm=1.0, method="bookkeeping")
    torch.testing.assert_close(got.norms, fp32.norms, rtol=0.05, atol=1e-6)
