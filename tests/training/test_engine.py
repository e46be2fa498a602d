"""DP-SGD step: noise once per logical step, whatever the physical split; EMA warm-up."""

import pytest
import torch
from scipy import stats
from torch import nn

from dpvision.accounting import PrivacyLedger
from dpvision.training import DPSGDStep, ParameterEMA, ema_decay

SIGMA, CLIP, Q, N = 1.3, 0.5, 0.01, 1000  # expected batch B = qN = 10


def _zero_gradient_model() -> nn.Module:
    # Zero weights and a loss of 0 · output: every per-example gradient is exactly zero.
    model = nn.Linear(3, 2, bias=False).double()
    nn.init.zeros_(model.weight)
    return model


def _updates(splits: int, steps: int, seed: int) -> torch.Tensor:
    model = _zero_gradient_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step = DPSGDStep.build(
        model=model,
        optimizer=optimizer,
        loss_fn=lambda out, y: 0.0 * out.sum(dim=-1),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        sample_rate=Q,
        num_examples=N,
        ledger=PrivacyLedger(),
        generator=torch.Generator().manual_seed(seed),
    )
    x, y = torch.ones(12, 3, dtype=torch.float64), torch.zeros(12, dtype=torch.long)
    for _ in range(steps):
        step(
            [
                (part_x, part_y)
                for part_x, part_y in zip(x.chunk(splits), y.chunk(splits), strict=True)
            ]
        )
    return model.weight.detach().reshape(-1)


@pytest.mark.parametrize("splits", [1, 4])
def test_noise_variance_is_k_steps_of_sigma_c_over_b_whatever_the_split(splits):
    k = 3
    draws = torch.cat([_updates(splits, k, seed) for seed in range(700)]).numpy()
    scale = (k**0.5) * SIGMA * CLIP / (Q * N)
    assert stats.kstest(draws, stats.norm(scale=scale).cdf).pvalue > 1e-3
    assert stats.kstest(draws, stats.norm(scale=0.67 * scale).cdf).pvalue < 1e-6
    assert stats.kstest(draws, stats.norm(scale=1.5 * scale).cdf).pvalue < 1e-6


def test_noise_per_micro_batch_would_be_caught():
    # If noise were added per micro-batch (4 splits, no correction) the std would double.
    k, splits = 3, 4
    wrong = torch.cat([_updates(1, k, seed) * splits**0.5 for seed in range(700)]).numpy()
    scale = (k**0.5) * SIGMA * CLIP / (Q * N)
    assert stats.kstest(wrong, stats.norm(scale=scale).cdf).pvalue < 1e-6


def test_each_logical_step_is_one_ledger_entry_and_empty_batches_get_noise():
    model = _zero_gradient_model()
    ledger = PrivacyLedger()
    step = DPSGDStep.build(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        loss_fn=lambda out, y: 0.0 * out.sum(dim=-1),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        sample_rate=Q,
        num_examples=N,
        ledger=ledger,
        generator=torch.Generator().manual_seed(0),
    )
    step([])  # an empty Poisson batch
    assert model.weight.abs().sum() > 0
    step([(torch.ones(2, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.long))])
    (entry,) = ledger.entries
    assert (entry.count, entry.sample_rate, entry.noise_multiplier) == (2, Q, SIGMA)


def test_ema_warm_up_and_average():
    assert ema_decay(0.9999, 0) == pytest.approx(0.1)
    assert ema_decay(0.9999, 10**6) == 0.9999
    model = nn.Linear(1, 1, bias=False)
    ema = ParameterEMA(model, decay=0.5)
    with torch.no_grad():
        model.weight.fill_(1.0)
    start = ema.shadow["weight"].clone()
    ema.update(model)  # μ = min(0.5, 1/10) = 0.1
    assert ema.shadow["weight"] == pytest.approx(0.1 * start + 0.9)
