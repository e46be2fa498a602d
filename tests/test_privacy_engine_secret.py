"""PrivacyEngine loops against the adversary of docs/guarantees.md (issue 35).

The adversary knows the code, every argument of ``make_private`` (``seed`` included) and
every released byte. Before issue 35 ``seed`` drew the noise and the Poisson batches too:
rerunning a published ``seed=0`` loop on the data with the target in reproduced the model
exactly, which decides membership. Now the noise and the batches come from secret
randomness (fresh OS entropy, or a ``secret_seed`` to replay a research run) and ``seed``
draws only the augmentation.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpvision import DPVisionError, PrivacyEngine
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.per_example import clipped_gradient_sum

SECRET = 918273645546372819  # distinctive: searched for in every object make_private returns
SIGMA, CLIP = 1.0, 0.1


def _data(n: int = 40) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=gen, dtype=torch.float64), torch.arange(n) % 3)


def _model() -> nn.Module:
    torch.manual_seed(0)  # the initialisation is public
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _make(model: nn.Module, data: TensorDataset, *, batch_size: int, lr: float, **options):
    engine = PrivacyEngine()
    made = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(data, batch_size=batch_size),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        **options,
    )
    return engine, *made


def _train(data: TensorDataset, *, batch_size: int = 8, **options) -> torch.Tensor:
    """The released parameters after one epoch of the usual loop."""
    model = _model()
    _, private, optimizer, loader = _make(model, data, batch_size=batch_size, lr=0.5, **options)
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(private(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _batches(**options) -> list[list[int]]:
    data = TensorDataset(torch.arange(40, dtype=torch.float64)[:, None], torch.zeros(40))
    torch.manual_seed(0)  # the initial parameters key a secret seed's streams too
    _, _, _, loader = _make(nn.Linear(1, 1).double(), data, batch_size=8, lr=0.0, **options)
    return list(loader.loader.batch_sampler)  # the indices, without stepping on them


def test_rerunning_the_published_seed_does_not_reproduce_the_model():
    data = _data()
    published = _train(data, seed=0)
    assert not torch.equal(_train(data, seed=0), published)
    # With every batch the whole dataset (q = 1) only the noise can differ: it is secret.
    full = _train(data, batch_size=len(data), seed=0)
    assert not torch.equal(_train(data, batch_size=len(data), seed=0), full)


def test_the_poisson_batches_are_secret_and_the_public_seed_does_not_draw_them():
    assert _batches(seed=0) != _batches(seed=0)
    assert _batches(seed=0, secret_seed=SECRET) == _batches(seed=0, secret_seed=SECRET)
    assert _batches(secret_seed=SECRET) != _batches(secret_seed=SECRET + 1)
    # Every argument keys the streams, the public seed too (issue 48): no two settings of a
    # sweep that reuses one secret seed share their batches.
    assert _batches(seed=0, secret_seed=SECRET) != _batches(seed=1, secret_seed=SECRET)


def test_a_secret_seed_replays_the_run_with_the_same_arguments():
    data = _data()
    replayed = _train(data, seed=0, secret_seed=SECRET)
    assert torch.equal(_train(data, seed=0, secret_seed=SECRET), replayed)
    assert not torch.equal(_train(data, seed=0, secret_seed=SECRET + 1), replayed)
    assert not torch.equal(_train(data, seed=1, secret_seed=SECRET), replayed)


def _first_release(data: TensorDataset, **options) -> torch.Tensor:
    """Σᵢ clip(gᵢ) + noise of the first step at q = 1 (the gradient times qN = N)."""
    model = _model()
    _, private, optimizer, loader = _make(model, data, batch_size=len(data), lr=0.0, **options)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(private(x), y).backward()
    optimizer.step()
    return torch.cat([p.grad.flatten() for p in model.parameters()]) * len(data)


def _target_gradient(data: TensorDataset) -> torch.Tensor:
    """The clipped gradient of ``data``'s last example (the target) at the initial model."""
    x, y = data.tensors
    target = clipped_gradient_sum(
        _model(), nn.CrossEntropyLoss(reduction="none"), x[-1:], y[-1:], max_grad_norm=CLIP
    )
    expected = torch.cat([g.flatten() for g in target.grads.values()])
    assert 0 < float(expected.norm()) <= CLIP * (1 + 1e-9)
    return expected


def test_one_secret_seed_on_neighbouring_data_shares_no_noise():
    # Before issue 48 the same secret seed on D and D - x drew the same noise: the difference
    # of the two published first steps was the target's own clipped gradient, exactly. Now
    # the rows key the noise: the difference is two independent noises, norm ≈ σC·√(2d) ≫ C.
    data = _data()
    without = TensorDataset(*(t[:-1] for t in data.tensors))  # the target is the last one
    for options in ({"secret_seed": SECRET}, {}):
        difference = _first_release(data, **options) - _first_release(without, **options)
        residual = difference - _target_gradient(data)
        assert float(residual.norm()) > 5 * SIGMA * CLIP, options
    # Even with q and N held equal (the target replaced by another example).
    swapped = TensorDataset(*(torch.cat([t[:-1], t[:1]]) for t in data.tensors))
    difference = _first_release(data, secret_seed=SECRET) - _first_release(
        swapped, secret_seed=SECRET
    )
    assert float(difference.norm()) > 5 * SIGMA * CLIP


def _noise_releases(engine: PrivacyEngine, models: int) -> list[torch.Tensor]:
    """The first release of each of ``models`` zero-gradient models made private by
    ``engine`` with the same secret seed: the noise alone."""
    data = TensorDataset(torch.zeros(10, 6, dtype=torch.float64), torch.zeros(10, dtype=torch.long))
    releases = []
    for _ in range(models):
        torch.manual_seed(0)  # the initial parameters key a secret seed's streams too
        model = nn.Linear(6, 3, bias=False).double()
        private, optimizer, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(data, batch_size=10),
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            secret_seed=SECRET,
        )
        x, y = next(iter(loader))
        private.per_example_loss(lambda out, _: 0.0 * out.sum(1))(private(x), y).backward()
        optimizer.step()
        releases.append(model.weight.grad.clone())
    return releases


def test_two_models_of_one_engine_draw_independent_noise():
    # The same secret seed twice on one engine: the two releases must not share their noise
    # (their difference would cancel it); a fresh engine replays the first.
    first, second = _noise_releases(PrivacyEngine(), 2)
    (replayed,) = _noise_releases(PrivacyEngine(), 1)
    assert float(first.abs().min()) > 0
    assert not torch.equal(first, second)
    assert torch.equal(first, replayed)


def test_a_noise_generator_passed_in_is_used_as_given():
    # Opacus code that passes its own generator keeps it: its secrecy is then the caller's.
    data = _data()
    a = _first_release(data, secret_seed=1, noise_generator=torch.Generator().manual_seed(5))
    b = _first_release(data, secret_seed=2, noise_generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_secret_seed_is_kept_nowhere():
    model = _model()
    engine, private, optimizer, loader = _make(
        model, _data(), batch_size=8, lr=0.1, seed=0, secret_seed=SECRET
    )
    sampler = loader.loader.batch_sampler.sampler
    for thing in (engine, private, optimizer, loader, loader.loader.batch_sampler, sampler):
        fields = vars(thing)
        text = repr(fields)
        assert str(SECRET) not in text
        assert hex(SECRET) not in text
        assert SECRET not in fields.values()
        assert not any(isinstance(v, SecretRandomness) for v in fields.values())


def test_a_secret_seed_with_secure_mode_is_refused_in_one_line():
    model = nn.Linear(6, 3).double()
    with pytest.raises(DPVisionError) as error:
        PrivacyEngine(secure_mode=True).make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=8),
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            secret_seed=SECRET,
        )
    message = str(error.value)
    assert "\n" not in message
    assert "secret_seed" in message
    assert "secure_mode" in message
    assert str(SECRET) not in message


def _step_one(data: TensorDataset, *, lr: float, **options) -> tuple[torch.Tensor, float]:
    """The first release Σᵢ clip(gᵢ) + noise at q = 1, of ``make_private`` (``sigma``) or
    of ``make_private_with_epsilon`` (``target_epsilon``)."""
    model = _model()
    engine = PrivacyEngine()
    arguments = {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=lr),
        "data_loader": DataLoader(data, batch_size=len(data)),
        "max_grad_norm": CLIP,
        "secret_seed": SECRET,
    }
    if "target_epsilon" in options:
        made = engine.make_private_with_epsilon(
            **arguments, target_delta=1e-5, epochs=1, target_epsilon=options["target_epsilon"]
        )
        sigma = made[1].release.noise_multiplier
    else:
        sigma = options["sigma"]
        made = engine.make_private(**arguments, noise_multiplier=sigma)
    private, optimizer, loader = made
    x, y = next(iter(loader))
    nn.functional.cross_entropy(private(x), y).backward()
    optimizer.step()
    return torch.cat([p.grad.flatten() for p in model.parameters()]) * len(data), sigma


def _exact_sum(data: TensorDataset) -> torch.Tensor:
    x, y = data.tensors
    total = clipped_gradient_sum(
        _model(), nn.CrossEntropyLoss(reduction="none"), x, y, max_grad_norm=CLIP
    )
    return torch.cat([g.flatten() for g in total.grads.values()])


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"sigma": 1.0, "lr": 0.0}, {"sigma": 2.0, "lr": 0.0}),
        ({"target_epsilon": 1.0, "lr": 0.0}, {"target_epsilon": 4.0, "lr": 0.0}),
        ({"sigma": 1.0, "lr": 0.5}, {"sigma": 1.0, "lr": 0.25}),
    ],
    ids=["sigma", "epsilon", "learning-rate"],
)
def test_two_settings_under_one_secret_seed_share_no_noise(first, second):
    """Issue 48: ``make_private`` keyed its streams by the secret seed alone, so a sweep's
    scripts that reuse one secret seed drew the same normals: from σ = 1 and σ = 2 (or
    ε = 1 and 4) the clipped sum came back to 1e-14, and two learning rates gave identical
    first releases. Now every argument, the optimizer and the initial parameters key the
    streams: the adversary's reconstruction misses the sum by far more than C."""
    data = _data()
    exact = _exact_sum(data)
    (one, sigma_one), (two, sigma_two) = _step_one(data, **first), _step_one(data, **second)
    if sigma_one == sigma_two:
        assert float((one - two).norm()) > 5 * SIGMA * CLIP  # shared noise would give 0
        return
    # Shared noise Z: R = S + σCZ for both, so (σ₂R₁ − σ₁R₂)/(σ₂ − σ₁) = S exactly.
    estimate = (sigma_two * one - sigma_one * two) / (sigma_two - sigma_one)
    assert float((estimate - exact).norm()) > 5 * CLIP
    assert float((one - exact).norm()) > CLIP  # each release is noisy


def _noise_key(
    *, batch_size: int = 8, activation: type[nn.Module] = nn.Tanh, criterion=None
) -> bytes:
    """The first noise stream's key of a ``make_private`` call with these settings."""
    from dpvision.privacy_engine.secret_context import call_secret

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), activation(), nn.Linear(5, 3)).double()
    arguments = {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.5),
        "data_loader": DataLoader(_data(), batch_size=batch_size),
        "noise_multiplier": SIGMA,
        "max_grad_norm": CLIP,
        "criterion": criterion,
    }
    return call_secret(SECRET, secure=False, arguments=arguments, call=0).key("noise 0")


def test_the_loader_the_architecture_and_the_criterion_key_the_streams():
    """The review of issue 48: two calls that differed only in the loader's batch size
    (nested Poisson batches under shared noise gave the target's row back exactly), in an
    activation with no parameters, or in a criterion's label smoothing, shared their
    streams. Each now keys them."""
    base = _noise_key()
    assert _noise_key() == base  # the same call replays
    assert _noise_key(batch_size=16) != base
    assert _noise_key(activation=nn.ReLU) != base
    plain = _noise_key(criterion=nn.CrossEntropyLoss())
    assert plain != base
    assert _noise_key(criterion=nn.CrossEntropyLoss(label_smoothing=0.3)) != plain
    assert _noise_key(criterion=nn.CrossEntropyLoss(weight=torch.ones(3))) != plain
