"""Buffers written during a private forward pass are refused; buffers only read pass.

An activation-range observer (quantisation-aware training) that keeps the largest input it
saw, or BatchNorm updating its running statistics, would put an exact statistic of the
private batch into the published ``state_dict``. Each way of writing a buffer (in place,
by reassignment, through ``.data``) is refused in the DP-SGD step, in ``dpvision.train``
and in the PrivacyEngine, before anything is released; frozen BatchNorm passes.
"""

import re
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpvision
from dpvision import DPVisionError, PrivacyEngine
from dpvision.accounting import PrivacyLedger
from dpvision.models import FrozenBatchNorm
from dpvision.training import DPSGDStep
from dpvision.training.buffers import BufferWatch

ROW_LOSS = nn.CrossEntropyLoss(reduction="none")


class InPlaceObserver(nn.Module):
    """Keeps the largest input seen, written in place (``torch.maximum(..., out=)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("max_seen", torch.tensor(float("-inf"), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            torch.maximum(self.max_seen, x.detach().max(), out=self.max_seen)
        return x


class ReassigningObserver(InPlaceObserver):
    """The same statistic, stored by reassigning the buffer (``self.max_seen = ...``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.max_seen = torch.maximum(self.max_seen, x.detach().max())
        return x


class DataObserver(InPlaceObserver):
    """The same statistic, written through ``.data`` (no version counter moves)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.max_seen.data.copy_(torch.maximum(self.max_seen, x.detach().max()))
        return x


OBSERVERS = [InPlaceObserver, ReassigningObserver, DataObserver]


def _step(model: nn.Module, ledger: PrivacyLedger, clipping: str = "auto") -> DPSGDStep:
    return DPSGDStep.build(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        loss_fn=ROW_LOSS,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        sample_rate=0.1,
        num_examples=100,
        ledger=ledger,
        generator=torch.Generator().manual_seed(0),
        method=clipping,
    )


def _batch(rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(rows, 4, generator=gen, dtype=torch.float64), torch.arange(rows) % 3


def _assert_refused(error: pytest.ExceptionInfo[DPVisionError], name: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"buffer '{name}' of ")
    assert "changed during a private forward pass" in message
    assert "GroupNorm" in message
    assert "module.eval()" in message


@pytest.mark.parametrize("observer", OBSERVERS)
@pytest.mark.parametrize("clipping", ["auto", "bookkeeping"])
def test_the_dpsgd_step_refuses_a_buffer_written_in_the_forward_pass(observer, clipping):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), observer(), nn.Linear(4, 3)).double()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    ledger = PrivacyLedger()
    x, y = _batch()
    with pytest.raises(DPVisionError) as error:
        _step(model, ledger, clipping)([(x[:3], y[:3]), (x[3:], y[3:])])
    _assert_refused(error, "1.max_seen")
    assert len(ledger) == 0  # refused before the release: nothing noisy, nothing recorded
    assert all(torch.equal(before[k], p) for k, p in model.named_parameters())


def _frozen_cnn() -> nn.Module:
    torch.manual_seed(0)
    batch_norm = nn.BatchNorm2d(4)
    batch_norm.running_mean.uniform_(-1, 1)  # statistics from (public) pre-training
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        batch_norm.eval(),  # frozen: normalises with its running statistics, writes nothing
        FrozenBatchNorm.from_batch_norm(nn.BatchNorm2d(4)),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    ).double()


@pytest.mark.parametrize("clipping", ["auto", "vmap"])
def test_frozen_batchnorm_and_other_buffers_only_read_pass_the_dpsgd_step(clipping):
    model = _frozen_cnn()
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    ledger = PrivacyLedger()
    step = _step(model, ledger, clipping)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 1, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.arange(6) % 3
    for _ in range(3):  # the first step probes the layout (and writes the buffers back)
        step([(x[:4], y[:4]), (x[4:], y[4:])])
    assert ledger.total_count == 3
    assert all(torch.equal(buffers[k], b) for k, b in model.named_buffers())


def test_a_buffer_changed_between_steps_is_not_the_steps_concern():
    # Loading a checkpoint (or any code outside a private pass) may set the buffers.
    model = nn.Sequential(InPlaceObserver(), nn.Linear(4, 3)).double()
    watch = BufferWatch(model)
    watch.start()
    watch.check()
    model[0].max_seen.fill_(3.0)  # between two passes
    watch.start()
    watch.check()
    model[0].max_seen.fill_(3.0)  # during one, but the values are bit for bit the same
    watch.check()
    model[0].max_seen.fill_(4.0)
    with pytest.raises(DPVisionError, match=re.escape("buffer '0.max_seen' of the model changed")):
        watch.check()


def test_a_buffer_registered_during_the_pass_is_refused():
    model = nn.Sequential(nn.Linear(4, 3))
    watch = BufferWatch(model, what="the module")
    watch.start()
    model[0].register_buffer("seen", torch.zeros(()))
    with pytest.raises(DPVisionError, match=re.escape("buffer '0.seen' of the module changed")):
        watch.check()


def _factories(folder: Path) -> str:
    path = folder / "observed_models.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            class Observer(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.register_buffer("max_seen", torch.tensor(float("-inf")))

                def forward(self, x):
                    with torch.no_grad():
                        torch.maximum(self.max_seen, x.detach().max(), out=self.max_seen)
                    return x

            def observed_mlp(num_classes, in_chans):
                return nn.Sequential(
                    nn.Flatten(), Observer(), nn.Linear(64 * in_chans, num_classes)
                )

            def batchnorm_cnn(num_classes, in_chans):
                return nn.Sequential(
                    nn.Conv2d(in_chans, 4, 3), nn.BatchNorm2d(4), nn.Tanh(),
                    nn.Flatten(), nn.Linear(4 * 6 * 6, num_classes),
                )
            """
        )
    )
    return str(path)


def _train(path: str, factory: str, **learner: object) -> dpvision.TrainingRun:
    options = {"model": f"python:{path}:{factory}", "steps": 2, "batch_size": 64, **learner}
    return dpvision.train(dataset="digits", method="dp-sgd", epsilon=1.0, learner=options)


def test_dpvision_train_refuses_an_observer_and_trains_with_frozen_batchnorm(tmp_path):
    path = _factories(tmp_path)
    with pytest.raises(DPVisionError) as error:
        _train(path, "observed_mlp")
    _assert_refused(error, "1.max_seen")
    run = _train(path, "batchnorm_cnn", batchnorm="freeze")
    assert run.result["batchnorm"] == "freeze"
    assert run.result["privacy_ledger"][0]["count"] == 2


def _epoch(private, optimizer, loader) -> None:
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(private(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("observer", OBSERVERS)
def test_the_privacy_engine_refuses_a_buffer_written_in_the_forward_pass(observer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), observer(), nn.Linear(4, 3)).double()
    gen = torch.Generator().manual_seed(3)
    data = TensorDataset(
        torch.randn(40, 4, generator=gen, dtype=torch.float64), torch.arange(40) % 3
    )
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    with pytest.raises(DPVisionError) as error:
        _epoch(private, optimizer, loader)
    _assert_refused(error, "1.max_seen")
    assert str(error.value).startswith("buffer '1.max_seen' of the module ")
    assert len(engine.ledger) == 0


def test_the_privacy_engine_trains_with_frozen_batchnorm_and_refuses_it_in_training_mode():
    model = _frozen_cnn()
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    gen = torch.Generator().manual_seed(4)
    data = TensorDataset(
        torch.randn(40, 1, 8, 8, generator=gen, dtype=torch.float64), torch.arange(40) % 3
    )
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        max_physical_batch_size=3,
    )
    _epoch(private, optimizer, loader)
    assert engine.ledger.total_count == 5
    assert all(torch.equal(buffers[k], b) for k, b in model.named_buffers())
    # A loop that calls model.train() on the BatchNorm after make_private: refused (here by
    # the buffer check, the layout probe having passed this input shape in evaluation mode).
    model[1].train()
    x = data.tensors[0][:4]
    with pytest.raises(
        DPVisionError, match=re.escape("buffer '1.running_mean' of the module changed")
    ):
        private(x)


def test_a_frozen_parameter_written_in_forward_is_refused_too():
    from dpvision.training.buffers import BufferWatch

    class FrozenObserver(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.max_seen = nn.Parameter(torch.zeros(()), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.max_seen.data = torch.maximum(self.max_seen.data, x.max())
            return x

    model = nn.Sequential(nn.Linear(3, 3), FrozenObserver())
    watch = BufferWatch(model)
    watch.start()
    model(torch.full((2, 3), 123.456))
    with pytest.raises(DPVisionError, match="max_seen") as error:
        watch.check()
    assert "\n" not in str(error.value)
