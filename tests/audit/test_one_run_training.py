"""One-run audit of a user's own PrivacyEngine loop: honest stays under its claim, planted
bugs (no noise, 0.3 of it, no clipping) are caught."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from dpvision import PrivacyEngine
from dpvision.audit.one_run_training import audit_training
from dpvision.mechanisms import clipping, noise

EPSILON, DELTA, CANARIES, INFORMATIVE = 2.0, 1e-5, 1000, 16


def _data(seed=0):
    """Base examples live on the last 16 coordinates; canary i is 10·e_i with a random
    label, so only it (and the noise) moves its column of the weights: Dirac canaries."""
    gen = torch.Generator().manual_seed(seed)
    base_x = torch.zeros(1000, CANARIES + INFORMATIVE)
    base_y = torch.randint(0, 4, (1000,), generator=gen)
    base_x[:, CANARIES:] = torch.randn(1000, INFORMATIVE, generator=gen) + base_y[:, None]
    canary_x = 10 * torch.eye(CANARIES, CANARIES + INFORMATIVE)
    canary_y = torch.randint(0, 4, (CANARIES,), generator=gen)
    return (base_x, base_y), (canary_x, canary_y)


def _user_loop(dataset):
    """What a user writes with dpvision's Opacus-style engine (batches of the whole set on
    average, 5 epochs)."""
    # No bias (a per-class offset would set canaries of different labels apart) and zero
    # weights: a canary's column holds only its own gradients and the noise.
    model = nn.Linear(CANARIES + INFORMATIVE, 4, bias=False)
    nn.init.zeros_(model.weight)
    engine = PrivacyEngine(accountant="pld")
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(dataset, batch_size=len(dataset)),
        target_epsilon=EPSILON,
        target_delta=DELTA,
        epochs=5,
        max_grad_norm=1.0,
        seed=0,
    )
    loss = nn.CrossEntropyLoss()
    for _ in range(5):
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss(model(inputs), targets).backward()
            optimizer.step()
    assert engine.get_epsilon(delta=DELTA) <= EPSILON
    return model


def _audit():
    base, canaries = _data()
    return audit_training(
        _user_loop,
        base=base,
        canaries=canaries,
        epsilon=EPSILON,
        delta=DELTA,
        guess_in=100,
        guess_out=100,
    )


def test_an_honest_user_loop_stays_under_its_claim():
    report = _audit()
    assert report["canaries"] == CANARIES
    assert report["guesses"] == 200
    assert 0 <= report["epsilon_lower_bound"] <= EPSILON
    assert not report["violation"]


@pytest.mark.parametrize("factor", [0.0, 0.3])
def test_too_little_noise_in_a_user_loop_is_caught(monkeypatch, factor):
    honest = noise._noise_std
    monkeypatch.setattr(noise, "_noise_std", lambda *a, **k: factor * honest(*a, **k))
    report = _audit()
    print(f"noise x {factor}: bound {report['epsilon_lower_bound']:.3f}, {report['correct']}/200")
    assert report["violation"]


def test_skipped_clipping_in_a_user_loop_is_caught(monkeypatch):
    def no_clipping(norms, max_norm, keep=None):
        scale = torch.ones_like(norms)
        return scale if keep is None else torch.where(keep.to(torch.bool), scale, 0.0)

    monkeypatch.setattr(clipping, "clip_factors", no_clipping)
    report = _audit()
    print(f"no clipping: bound {report['epsilon_lower_bound']:.3f}, {report['correct']}/200")
    assert report["violation"]
