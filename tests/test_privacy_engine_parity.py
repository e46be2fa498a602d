"""Opacus parity of PrivacyEngine: ``accountant.history`` and ``state_dict``,
``save_checkpoint`` / ``load_checkpoint`` (ε continues; the file replays no noise) and
``model.disable_hooks()`` (a step while they are off is refused)."""

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpvision import DPVisionError, PrivacyEngine
from dpvision.accounting import PrivacyLedger

ROOT = Path(__file__).resolve().parents[1]


def _data(n: int = 40) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _private(engine: PrivacyEngine, sigma: float = 1.1, **options):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(_data(), batch_size=4),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        **options,
    )


def _epoch(model, optimizer, loader) -> None:
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_history_is_opacus_triples_of_the_steps_that_ran() -> None:
    engine = PrivacyEngine(accountant="rdp")
    _epoch(*_private(engine, sigma=1.1))
    _epoch(*_private(engine, sigma=2.0))  # a second make_private on the same engine
    assert engine.accountant.history == [(1.1, 0.1, 10), (2.0, 0.1, 10)]
    state = engine.accountant.state_dict()
    assert list(state) == ["history", "mechanism", "ledger"]
    assert state["mechanism"] == "rdp"
    assert state["history"] == engine.accountant.history


def test_accountant_state_round_trips_and_reads_an_opacus_history() -> None:
    engine = PrivacyEngine()
    _epoch(*_private(engine))
    other = PrivacyEngine()
    other.accountant.load_state_dict(engine.accountant.state_dict())
    assert other.ledger == engine.ledger
    assert other.get_epsilon(1e-5) == engine.get_epsilon(1e-5)
    # Opacus' own accountant state: history and mechanism only.
    opacus = PrivacyEngine()
    opacus.accountant.load_state_dict({"history": [(1.1, 0.1, 10)], "mechanism": "prv"})
    assert opacus.get_epsilon(1e-5) == pytest.approx(engine.get_epsilon(1e-5), rel=1e-9)
    # Loading over steps already accounted would drop them from ε.
    with pytest.raises(DPVisionError, match="already accounted 10 steps"):
        engine.accountant.load_state_dict(other.accountant.state_dict())
    with pytest.raises(DPVisionError, match="no 'history'"):
        PrivacyEngine().accountant.load_state_dict({"mechanism": "rdp"})


def test_checkpoint_restores_module_optimizer_ema_and_epsilon(tmp_path: Path) -> None:
    first = PrivacyEngine()
    model, optimizer, loader = _private(first, ema_decay=0.9)
    _epoch(model, optimizer, loader)
    path = tmp_path / "run.ckpt"
    first.save_checkpoint(
        path=path, module=model, optimizer=optimizer, checkpoint_dict={"epoch": 1}
    )
    resumed = PrivacyEngine()
    model2, optimizer2, loader2 = _private(resumed, ema_decay=0.9)
    contents = resumed.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    assert contents["epoch"] == 1
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    momentum2 = [optimizer2.state[p]["momentum_buffer"] for p in model2.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, momentum2, strict=True))
    assert optimizer2.ema.step == optimizer.ema.step == 10
    assert resumed.get_epsilon(1e-5) == first.get_epsilon(1e-5)
    _epoch(model2, optimizer2, loader2)
    assert resumed.accountant.history == [(1.1, 0.1, 20)]
    assert resumed.get_epsilon(1e-5) > first.get_epsilon(1e-5)
    # A checkpoint of the private module loads into the plain module too (before
    # make_private, whose calibration then counts the loaded steps).
    plain, before = _model(), PrivacyEngine()
    before.load_checkpoint(path=path, module=plain)
    assert torch.equal(plain[0].weight, model._module[0].weight)
    assert before.ledger.total_count == 10


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def test_checkpoint_holds_no_secret_and_replays_no_noise(tmp_path: Path) -> None:
    """The threat: an adversary with the checkpoint file must not be able to replay the
    noise of the steps it records, nor of the resumed steps."""
    engine = PrivacyEngine()
    model, optimizer, loader = _private(engine)
    _epoch(model, optimizer, loader)
    path = tmp_path / "run.ckpt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    contents = torch.load(path, weights_only=True)  # plain tensors and containers only
    assert set(contents) == {
        "module_state_dict",
        "optimizer_state_dict",
        "privacy_accountant_state_dict",
    }
    # No generator state (torch's are uint8 tensors) and no key or seed anywhere.
    assert all(t.dtype.is_floating_point or t.dtype == torch.int64 for t in _tensors(contents))
    text = repr(contents).lower()
    assert not any(word in text for word in ("generator", "secret", "seed", "key", "rng"))
    assert PrivacyLedger.from_dict(contents["privacy_accountant_state_dict"]["ledger"]) == (
        engine.ledger
    )
    # Two runs resumed from the same file draw different noise: nothing in it fixes the noise.
    resumed = []
    for _ in range(2):
        again = PrivacyEngine()
        model2, optimizer2, loader2 = _private(again)
        again.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
        _epoch(model2, optimizer2, loader2)
        resumed.append(torch.cat([p.detach().flatten() for p in model2.parameters()]))
    assert not torch.equal(*resumed)


def test_secret_seed_and_a_checkpoint_are_refused_together(tmp_path: Path) -> None:
    engine = PrivacyEngine()
    model, optimizer, loader = _private(engine)
    _epoch(model, optimizer, loader)
    path = tmp_path / "run.ckpt"
    engine.save_checkpoint(path=path, module=model)
    seeded = PrivacyEngine()
    model2, _, _ = _private(seeded, secret_seed=12345)
    with pytest.raises(DPVisionError, match="first steps' noise"):
        seeded.load_checkpoint(path=path, module=model2)
    loaded = PrivacyEngine()
    loaded.load_checkpoint(path=path, module=_model())
    with pytest.raises(DPVisionError, match="first steps' noise"):
        _private(loaded, secret_seed=12345)


def test_checkpoint_errors_are_one_line(tmp_path: Path) -> None:
    engine = PrivacyEngine()
    model, _optimizer, _ = _private(engine)
    with pytest.raises(DPVisionError, match="no such checkpoint file"):
        engine.load_checkpoint(path=tmp_path / "missing.ckpt", module=model)
    foreign = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, foreign)
    with pytest.raises(DPVisionError, match="not a PrivacyEngine checkpoint"):
        engine.load_checkpoint(path=foreign, module=model)
    with pytest.raises(DPVisionError, match="no noise or grad-clip schedulers"):
        engine.save_checkpoint(path=tmp_path / "x.ckpt", module=model, noise_scheduler=object())
    assert not (tmp_path / "x.ckpt").exists()
    good = tmp_path / "good.ckpt"
    engine.save_checkpoint(path=good, module=model)
    with pytest.raises(DPVisionError, match="does not fit this module"):
        PrivacyEngine().load_checkpoint(path=good, module=nn.Linear(6, 3))


def test_disable_hooks_refuses_the_private_step() -> None:
    engine = PrivacyEngine()
    model, optimizer, loader = _private(engine)
    assert model.hooks_enabled
    model.disable_hooks()
    assert not model.hooks_enabled
    for x, _y in loader:  # a non-empty batch of the private loader
        if len(x):
            break
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), _y).backward()  # a plain, unrecorded pass
    assert all(p.grad is not None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DPVisionError, match=r"disable_hooks\(\) is in effect.*enable_hooks"):
        optimizer.step()
    # Nothing released: the parameters did not move, the exact gradient is gone, no ledger.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert len(engine.ledger) == 0
    # Back on, a fresh loader epoch trains privately as before.
    model.enable_hooks()
    model, optimizer, loader = _private(engine)
    _epoch(model, optimizer, loader)
    assert engine.ledger.total_count == 10


def test_docs_state_opacus_sample_rate_exactly() -> None:
    text = " ".join((ROOT / "docs" / "guide" / "python-api.md").read_text().split())
    assert "Opacus's is `sample_rate = 1/len(data_loader)` = 1/⌈N/B⌉" in text
    assert "q = batch_size / N, and" not in text


def test_a_noise_generator_and_a_checkpoint_are_refused_together(tmp_path: Path) -> None:
    """A script's generator restarts with the script: the resumed steps would draw the
    first steps' noise again, and the difference of two updates would cancel it."""
    engine = PrivacyEngine()
    model, optimizer, loader = _private(engine)
    _epoch(model, optimizer, loader)
    path = tmp_path / "run.ckpt"
    engine.save_checkpoint(path=path, module=model)
    generated = PrivacyEngine()
    model2, _, _ = _private(generated, noise_generator=torch.Generator().manual_seed(7))
    with pytest.raises(DPVisionError, match="first steps' noise"):
        generated.load_checkpoint(path=path, module=model2)
    loaded = PrivacyEngine()
    loaded.load_checkpoint(path=path, module=_model())
    with pytest.raises(DPVisionError, match="first steps' noise"):
        _private(loaded, noise_generator=torch.Generator().manual_seed(7))


def test_a_checkpoint_after_calibration_to_a_target_is_refused(tmp_path: Path) -> None:
    """σ calibrated without the checkpoint's steps would take ε past the target."""
    engine = PrivacyEngine()
    model, optimizer, loader = _private(engine)
    _epoch(model, optimizer, loader)
    path = tmp_path / "run.ckpt"
    engine.save_checkpoint(path=path, module=model)
    calibrated = PrivacyEngine()
    model2 = _model()
    calibrated.make_private_with_epsilon(
        module=model2,
        optimizer=torch.optim.SGD(model2.parameters(), lr=0.5),
        data_loader=DataLoader(_data(), batch_size=4),
        target_epsilon=2.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=1.0,
    )
    with pytest.raises(DPVisionError, match="load the checkpoint first"):
        calibrated.load_checkpoint(path=path, module=model2)
