"""PrivacyEngine: the Opacus-style API gives the DP-SGD step of the reference clipping."""

import math
import warnings

import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpvision import DPVisionError, PrivacyEngine
from dpvision.accounting import calibrate_noise_multiplier
from dpvision.mechanisms import gaussian_noise
from dpvision.per_example import clipped_gradient_sum
from layer_zoo import ZOO

ROW_LOSS = nn.CrossEntropyLoss(reduction="none")


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.Tanh(),
        nn.GroupNorm(2, 4),
        nn.Conv2d(4, 4, 3, stride=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    ).double()


def _norms_cnn() -> nn.Module:
    """The layers whose per-example gradients are formed directly: InstanceNorm, PReLU,
    LayerNorm (over trailing dims, and one shared by two calls)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3, padding=1)
            self.instance = nn.InstanceNorm2d(4, affine=True)
            self.prelu = nn.PReLU(4)
            self.layer = nn.LayerNorm(8)
            self.head = nn.Linear(4 * 8 * 8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.layer(self.prelu(self.instance(self.conv(x))))
            return self.head(self.layer(torch.tanh(h)).flatten(1))

    return Net().double()


def _images(n: int, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=gen, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, 3, (n,), generator=gen))


def _first_logical_step(loader, model, optimizer, reduction):
    """Runs the user loop until one logical step is taken; returns the chunks it saw."""
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    chunks = []
    for x, y in loader:
        chunks.append((x, y))
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        if optimizer.steps == 1:
            return chunks
    raise AssertionError("no logical step was taken")


@pytest.mark.parametrize(
    ("augmult", "physical", "reduction", "normalize", "sigma", "clip"),
    [
        (0, None, "mean", False, 0.0, 0.05),
        (0, None, "mean", False, 0.0, 1e3),
        (0, 2, "sum", False, 0.0, 1e3),
        (2, None, "mean", True, 0.0, 0.05),
        (3, 2, "mean", False, 0.7, 1e3),
        (2, 3, "sum", True, 1.3, 0.05),
        (2, 3, "sum", False, 0.0, 1e3),
    ],
)
@pytest.mark.parametrize("build", [_cnn, _norms_cnn], ids=["cnn", "norm-layers"])
def test_one_logical_step_is_the_reference_clipped_sum_plus_noise_over_qn(
    augmult, physical, reduction, normalize, sigma, clip, build
):
    # A small clip norm clips every example; a large one none, so that the rescaling of the
    # loss reduction (invisible once clipped) is checked too.
    model = build()
    data = _images(40)
    batch_size, seed = 8, 3
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(data, batch_size=batch_size),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        augmult=augmult,
        loss_reduction=reduction,
        normalize_update=normalize,
        max_physical_batch_size=physical,
        noise_generator=torch.Generator().manual_seed(seed),
        seed=1,
        secret_seed=7,  # a first Poisson batch of several examples, whatever the entropy
    )
    chunks = _first_logical_step(loader, private, optimizer, reduction)
    x = torch.cat([c[0] for c in chunks])
    y = torch.cat([c[1] for c in chunks])
    k = max(augmult, 1)
    assert len(x) >= 2 * k  # a real batch
    if physical is not None:
        assert len(chunks) == math.ceil(len(x) / (k * physical))
    inputs = x.reshape(-1, k, *x.shape[1:]) if augmult else x
    expected = clipped_gradient_sum(
        model, ROW_LOSS, inputs, y[::k], max_grad_norm=clip, views=bool(augmult)
    )
    clipped = expected.norms > clip
    assert bool(clipped.all()) if clip < 1 else not bool(clipped.any())
    noise_gen = torch.Generator().manual_seed(seed)
    divisor = (batch_size / len(data)) * len(data) * (clip if normalize else 1.0)
    for name, param in model.named_parameters():
        total = expected.grads[name]
        if sigma:
            total = total + gaussian_noise(
                param.shape,
                l2_sensitivity=clip,
                noise_multiplier=sigma,
                dtype=param.dtype,
                generator=noise_gen,
            )
        torch.testing.assert_close(param.grad, total / divisor, rtol=1e-9, atol=1e-12)


def _zero_gradient_updates(physical: int | None, steps: int, seed: int) -> torch.Tensor:
    # Zero weights and a loss of 0 · output: every per-example gradient is exactly zero.
    model = nn.Linear(50, 40, bias=False).double()
    nn.init.zeros_(model.weight)
    data = TensorDataset(torch.ones(1000, 50, dtype=torch.float64), torch.zeros(1000))
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=10),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        max_physical_batch_size=physical,
        secret_seed=seed,  # replayable draws; the noise comes from the secret streams
    )
    zero = private.per_example_loss(lambda out, _: 0.0 * out.sum(1))
    for x, y in loader:
        optimizer.zero_grad()
        zero(private(x), y).backward()
        optimizer.step()
        if optimizer.steps == steps:
            break
    (entry,) = engine.ledger.entries
    assert (entry.count, entry.sample_rate, entry.noise_multiplier) == (steps, 0.01, SIGMA)
    return model.weight.detach().reshape(-1)


SIGMA, CLIP = 1.3, 0.5


@pytest.mark.parametrize("physical", [None, 3])
def test_noise_is_added_once_per_logical_step_whatever_the_physical_split(physical):
    steps = 3
    draws = torch.cat([_zero_gradient_updates(physical, steps, seed) for seed in (0, 1)]).numpy()
    scale = math.sqrt(steps) * SIGMA * CLIP / (0.01 * 1000)
    assert stats.kstest(draws, stats.norm(scale=scale).cdf).pvalue > 1e-3
    assert stats.kstest(draws, stats.norm(scale=0.67 * scale).cdf).pvalue < 1e-6
    assert stats.kstest(draws, stats.norm(scale=1.5 * scale).cdf).pvalue < 1e-6


def test_empty_poisson_batches_get_noise_and_do_not_crash():
    model = _cnn()
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(_images(200), batch_size=1),  # q = 1/200: P(empty) ≈ 0.37
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        augmult=2,
        max_physical_batch_size=1,
        ema_decay=0.9,
        secret_seed=0,  # the batches are drawn from the secret streams: replay them
    )
    empty = 0
    for x, y in loader:
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        nn.functional.cross_entropy(private(x), y).backward()
        optimizer.step()
        if len(x) == 0:
            empty += 1
            assert x.shape[1:] == (1, 8, 8)
            assert y.dtype == torch.long
            assert all(
                not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)
            )
        if optimizer.steps == 30:
            break
    assert empty >= 5  # about 11 expected in 30 steps
    assert engine.ledger.total_count == 30
    assert optimizer.ema is not None
    assert optimizer.ema.step == 30
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_make_private_with_epsilon_calibrates_for_epochs_times_steps_per_epoch():
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 3)).double()
    data = _images(60)
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=7),  # q = 7/60, ⌈60/7⌉ = 9 steps an epoch
        target_epsilon=2.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
        seed=0,
    )
    assert len(loader) == 9
    expected = calibrate_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-5, sample_rate=7 / 60, steps=18, accountant="rdp"
    )
    assert optimizer.noise_multiplier == pytest.approx(expected)
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(private(x), y).backward()
            optimizer.step()
    assert engine.ledger.total_count == 18
    assert 0.99 * 2.0 <= engine.get_epsilon(delta=1e-5) <= 2.0


def test_learning_rate_schedulers_work_on_the_private_optimizer():
    model = _cnn()
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(_images(20), batch_size=5),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for x, y in loader:
        nn.functional.cross_entropy(private(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5 ** len(loader)


def _make(model, **options):
    params = [p for p in model.parameters() if p.requires_grad]
    return PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(params or [nn.Parameter(torch.zeros(1))], lr=0.1),
        data_loader=DataLoader(_images(10), batch_size=2),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        **options,
    )


def test_refusals():
    with pytest.raises(DPVisionError, match="BatchNorm"):
        _make(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))
    with pytest.raises(DPVisionError, match="does not support MultiheadAttention with dropout"):
        _make(
            nn.Sequential(
                nn.Flatten(1, 2), nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)
            )
        )
    with pytest.raises(DPVisionError, match="track_running_stats=False"):
        _make(
            nn.Sequential(
                nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2, affine=True, track_running_stats=True)
            )
        )
    with pytest.raises(DPVisionError, match="Poisson"):
        _make(nn.Linear(3, 3), poisson_sampling=False)
    with pytest.raises(DPVisionError, match="loss_reduction"):
        _make(nn.Linear(3, 3), loss_reduction="none")
    foreign = nn.Linear(3, 3)
    with pytest.raises(DPVisionError, match="without privacy"):
        PrivacyEngine().make_private(
            module=nn.Linear(3, 3),
            optimizer=torch.optim.SGD(foreign.parameters(), lr=0.1),
            data_loader=DataLoader(_images(10), batch_size=2),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    private, _, _ = _make(nn.Sequential(nn.Flatten(), nn.Linear(64, 3)).double(), augmult=2)
    with pytest.raises(DPVisionError, match="multiple of augmult"):
        private(torch.zeros(3, 1, 8, 8, dtype=torch.float64))


def test_opacus_style_accountant_reports_the_ledger_epsilon():
    # Opacus' examples call privacy_engine.accountant.get_epsilon(delta=...).
    model = _cnn()
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_images(40), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    assert engine.accountant.get_epsilon(delta=1e-5) == 0.0
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(private(x), y).backward()
        optimizer.step()
    assert len(engine.accountant) == optimizer.steps == 5
    assert engine.accountant.mechanism() == "rdp"
    epsilon = engine.accountant.get_epsilon(delta=1e-5, eps_error=0.01)
    assert epsilon == engine.get_epsilon(1e-5) == engine.ledger.epsilon(1e-5, "rdp") > 0


def test_token_models_with_embeddings_clip_per_example():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(7, 5, padding_idx=0), nn.LayerNorm(5), nn.Flatten(), nn.Linear(30, 3)
    ).double()
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, 7, (40, 6), generator=gen), torch.randint(0, 3, (40,)))
    private, optimizer, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        seed=1,
    )
    (x, y), *_ = _first_logical_step(loader, private, optimizer, "mean")
    expected = clipped_gradient_sum(model, ROW_LOSS, x, y, max_grad_norm=0.05)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected.grads[name] / 8, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("augmult", "physical"), [(0, None), (2, 3)])
@pytest.mark.parametrize("name", list(ZOO))
def test_every_layer_kind_of_the_zoo_steps_by_the_reference_clipped_sum(name, augmult, physical):
    # Depthwise/grouped/1-d/3-d convolutions, frozen BatchNorm, RMSNorm, attention, free
    # parameters and an unknown leaf layer: one logical step (noise off) is the reference
    # clipped sum over qN, also with K views and physical chunks.
    build, shape = ZOO[name]
    if len(shape) != 3:
        augmult = 0  # augmentation multiplicity augments images
    torch.manual_seed(0)
    model = build().double()
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(30, *shape, generator=gen, dtype=torch.float64),
        torch.randint(0, 3, (30,), generator=gen),
    )
    clip = 0.05
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the reference's vmap fallbacks
        private, optimizer, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(data, batch_size=8),
            noise_multiplier=0.0,
            max_grad_norm=clip,
            augmult=augmult,
            max_physical_batch_size=physical,
            seed=2,
            secret_seed=7,  # a first Poisson batch of several examples
        )
        chunks = _first_logical_step(loader, private, optimizer, "mean")
        x = torch.cat([c[0] for c in chunks])
        y = torch.cat([c[1] for c in chunks])
        k = max(augmult, 1)
        inputs = x.reshape(-1, k, *x.shape[1:]) if augmult else x
        expected = clipped_gradient_sum(
            model, ROW_LOSS, inputs, y[::k], max_grad_norm=clip, views=bool(augmult)
        )
    assert len(x) >= 2 * k
    divisor = (8 / len(data)) * len(data)
    for param_name, param in model.named_parameters():
        torch.testing.assert_close(
            param.grad, expected.grads[param_name] / divisor, rtol=1e-9, atol=1e-12
        )
