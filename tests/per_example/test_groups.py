"""Group-wise (per-layer) clipping: the clipped sum equals micro-batches of one clipped per
group, by book-keeping and by vmap; its sensitivity is √(Σ C_g²), and one example with
one huge group moves it by at most that."""

import json
import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpvision import PrivacyEngine
from dpvision.accounting import PrivacyLedger
from dpvision.cli import main
from dpvision.errors import DPVisionError
from dpvision.mechanisms.groups import group_of
from dpvision.per_example import GroupNorms, clip_and_sum, per_layer
from dpvision.testing import check_sensitivity, privacy_engine_release
from dpvision.training import DPSGDStep


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 5), nn.GroupNorm(1, 5),
        nn.Tanh(), nn.Linear(5, 3),
    ).double()  # fmt: skip


def _per_example_reference(model, x, y, groups: GroupNorms) -> dict[str, torch.Tensor]:
    """Micro-batches of one: each example's gradient, each group clipped to its C_g."""
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        for group, norm in groups.norms:
            members = [n for n in grads if group_of(n) == group]
            size = math.sqrt(sum(float(grads[n].pow(2).sum()) for n in members))
            factor = min(1.0, norm / size) if size > 0 else 1.0
            for n in members:
                total[n] += factor * grads[n]
    return total


@pytest.mark.parametrize("method", ["bookkeeping", "vmap"])
def test_group_clipped_sum_equals_micro_batches_of_one(method):
    model = _model()
    x, y = torch.randn(6, 2, 6, 6, dtype=torch.float64) * 3, torch.arange(6) % 3
    groups = per_layer(model, [0.05, 0.5, 0.01, 0.3])
    result = clip_and_sum(
        model, lambda out, t: F.cross_entropy(out, t, reduction="none"), x, y,
        max_grad_norm=1.0, method=method, groups=groups,
    )  # fmt: skip
    expected = _per_example_reference(model, x, y, groups)
    for name, value in expected.items():
        torch.testing.assert_close(result.grads[name], value, rtol=1e-9, atol=1e-12)
    assert result.l2_sensitivity == pytest.approx(math.sqrt(0.05**2 + 0.5**2 + 0.01**2 + 0.3**2))


def test_a_number_splits_evenly_and_keeps_the_flat_sensitivity():
    groups = per_layer(_model(), 2.0)
    assert [name for name, _ in groups.norms] == ["0", "3", "4", "6"]
    assert all(norm == pytest.approx(1.0) for _, norm in groups.norms)
    assert groups.l2_sensitivity == pytest.approx(2.0)


def test_one_huge_group_moves_the_sum_by_at_most_the_sensitivity():
    # Noise off, one added example whose first layer's gradient is huge: the release moves
    # by at most √(Σ C_g²), and its first group by at most C_1.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    loss = lambda out, t: F.cross_entropy(out, t, reduction="none")  # noqa: E731
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.arange(5) % 3
    groups = per_layer(model, [0.1, 0.4])
    huge = torch.full((1, 4), 1e4, dtype=torch.float64)
    for method in ("bookkeeping", "vmap"):
        base = clip_and_sum(model, loss, x, y, max_grad_norm=1.0, method=method, groups=groups)
        more = clip_and_sum(
            model, loss, torch.cat([x, huge]), torch.cat([y, torch.tensor([1])]),
            max_grad_norm=1.0, method=method, groups=groups,
        )  # fmt: skip
        moved = math.sqrt(sum(float((more.grads[n] - base.grads[n]).pow(2).sum())
                              for n in base.grads))  # fmt: skip
        first = math.sqrt(sum(float((more.grads[n] - base.grads[n]).pow(2).sum())
                              for n in base.grads if group_of(n) == "0"))  # fmt: skip
        assert moved <= groups.l2_sensitivity * (1 + 1e-9)
        assert first <= 0.1 * (1 + 1e-9)
        assert first > 0.09  # the huge group is clipped to (almost exactly) its C_1


def test_bad_group_norms_are_one_line_errors():
    with pytest.raises(DPVisionError, match="one max_grad_norm per layer"):
        per_layer(_model(), [1.0, 2.0])
    with pytest.raises(DPVisionError, match="must be > 0"):
        per_layer(_model(), [1.0, 0.0, 1.0, 1.0])


def test_privacy_engine_per_layer_releases_the_group_clipped_sum():
    # Noise off, one full batch (q = 1), SGD with lr 1 and a summed loss: the update is
    # −(the clipped sum)/N, which must equal micro-batches of one clipped per layer.
    model = _model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = torch.randn(6, 2, 6, 6, dtype=torch.float64) * 3, torch.arange(6) % 3
    norms = [0.05, 0.5, 0.01, 0.3]
    private, optimizer, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=6),
        noise_multiplier=0.0,
        max_grad_norm=norms,
        clipping="per_layer",
        loss_reduction="sum",
    )
    assert optimizer.max_grad_norm == pytest.approx(math.sqrt(sum(c * c for c in norms)))
    for inputs, targets in loader:
        optimizer.zero_grad()
        F.cross_entropy(private(inputs), targets, reduction="sum").backward()
        optimizer.step()
    reference_model = _model()
    expected = _per_example_reference(reference_model, x, y, per_layer(reference_model, norms))
    for name, param in model.named_parameters():
        torch.testing.assert_close(start[name] - param.detach(), expected[name] / 6)


def test_the_sensitivity_checker_passes_privacy_engine_per_layer_with_a_huge_example():
    def one_pass(model, optimizer, loader):
        for inputs, targets in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()

    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    data = (torch.randn(8, 4, dtype=torch.float64), torch.arange(8) % 3)
    run = privacy_engine_release(model, one_pass, max_grad_norm=1.0, clipping="per_layer")
    report = check_sensitivity(run, data, positions=[0, 3, 8], scale=1e4)
    assert report.ok, report.summary()
    assert report.max_ratio > 0.5, report.summary()


def test_cli_trains_with_per_layer_clipping(tmp_path, capsys):
    out = tmp_path / "result.json"
    code = main(
        ["train", "--quiet", "--method", "dp-sgd", "--set", "learner.clipping='per-layer'",
         "--set", "learner.epochs=1", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert result["config"]["learner"]["clipping"] == "per_layer"  # Opacus' spelling
    clip = result["config"]["learner"]["max_grad_norm"]  # the dp-sgd recipe's 0.1
    assert result["privacy_ledger"][-1]["l2_sensitivity"] == pytest.approx(clip)  # C, not C/√G
    code = main(["train", "--quiet", "--method", "dp-sgd", "--set", "learner.clipping='x'"])
    assert code == 2
    assert "unknown learner.clipping 'x'; choose one of: flat, per_layer" in capsys.readouterr().err


def test_the_noise_is_scaled_to_the_root_sum_of_squares_of_the_group_norms():
    # Zero gradients: each coordinate of the update is N(0, (σ·√(Σ C_g²))²)/(qN).
    sigma, norms = 1.3, [0.3, 0.4]  # √(Σ C_g²) = 0.5
    draws = []
    for seed in range(400):
        model = nn.Sequential(nn.Linear(3, 2, bias=False), nn.Linear(2, 2, bias=False)).double()
        for param in model.parameters():
            nn.init.zeros_(param)
        step = DPSGDStep.build(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            loss_fn=lambda out, y: 0.0 * out.sum(dim=-1),
            noise_multiplier=sigma,
            max_grad_norm=norms,
            sample_rate=0.01,
            num_examples=1000,
            ledger=PrivacyLedger(),
            generator=torch.Generator().manual_seed(seed),
            clipping="per_layer",
        )
        step([(torch.ones(4, 3, dtype=torch.float64), torch.zeros(4, dtype=torch.long))])
        draws.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    values = (torch.cat(draws) * 10).numpy()  # qN = 10
    assert stats.kstest(values, stats.norm(scale=sigma * 0.5).cdf).pvalue > 1e-3
    assert stats.kstest(values, stats.norm(scale=sigma * 0.7).cdf).pvalue < 1e-6
