"""Opacus' example training loops (examples/mnist.py, examples/cifar10.py) run with only the
import changed, on small random data, and report Opacus' ε for the same σ, q and steps.

The loops below follow the call pattern of Opacus 1.6's examples line for line (model,
optimizer, make_private with clipping and grad_sample_mode, accountant.get_epsilon,
BatchMemoryManager, ModuleValidator.fix, evaluation under no_grad with another batch size);
the models are small stand-ins of the examples' ones.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset

# The swapped imports: `from opacus import PrivacyEngine`,
# `from opacus.utils.batch_memory_manager import BatchMemoryManager`,
# `from opacus.validators import ModuleValidator`.
from dpvision import PrivacyEngine
from dpvision.errors import DPVisionError
from dpvision.privacy_engine import BatchMemoryManager, ModuleValidator

DELTA = 1e-5
# ε that Opacus 1.6.0 reports for these (σ, q, steps), measured on 2026-11-23 with
# opacus.accountants.RDPAccountant / PRVAccountant (default eps_error 0.01).
OPACUS_EPSILON = {
    (1.0, 0.25, 8): {"rdp": 6.253144612851234, "prv": 5.4679921384856325},
    (1.1, 0.25, 4): {"rdp": 4.148021189998942, "prv": 3.5853737238707173},
}


class SampleConvNet(nn.Module):
    """Two strided convolutions with max-pooling and two Linear layers (mnist.py's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(8, 16, 4, 2)
        self.fc1 = nn.Linear(16 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)  # 28 → 14 → 13
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)  # 13 → 5 → 4
        return self.fc2(F.relu(self.fc1(x.view(-1, 16 * 4 * 4))))


def _images(n: int, shape: tuple[int, ...], seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, *shape, generator=gen), torch.randint(0, 10, (n,)))


def _mnist_train(model, train_loader, optimizer, privacy_engine, delta):
    model.train()
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return np.mean(losses), privacy_engine.accountant.get_epsilon(delta=delta)


def _mnist_test(model, test_loader):
    model.eval()
    criterion = nn.CrossEntropyLoss()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += criterion(output, target).item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    return correct / len(test_loader.dataset)


@pytest.mark.parametrize(
    "grad_sample_mode", ["functorch", pytest.param("hooks", marks=pytest.mark.slow)]
)
def test_opacus_mnist_example_loop(grad_sample_mode):
    torch.manual_seed(0)
    train_loader = DataLoader(_images(64, (1, 28, 28), 1), batch_size=16)
    test_loader = DataLoader(_images(30, (1, 28, 28), 2), batch_size=7)
    model = SampleConvNet()
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0)
    privacy_engine = PrivacyEngine(secure_mode=False)
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="flat",
        grad_sample_mode=grad_sample_mode,
    )
    for _epoch in range(2):
        loss, epsilon = _mnist_train(model, train_loader, optimizer, privacy_engine, DELTA)
        accuracy = _mnist_test(model, test_loader)
    assert math.isfinite(loss)
    assert 0.0 <= accuracy <= 1.0
    assert privacy_engine.ledger.total_count == 2 * math.ceil(1 / 0.25)
    # Default accountant pld, Opacus' default prv: both numerical, within PRV's eps_error.
    assert epsilon == pytest.approx(OPACUS_EPSILON[(1.0, 0.25, 8)]["prv"], abs=0.02)


def _convnet(num_classes: int) -> nn.Module:
    """cifar10.py's convnet shape, with a BatchNorm for ModuleValidator.fix to replace."""
    return nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=3, stride=1, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(8, 16, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(start_dim=1, end_dim=-1),
        nn.Linear(16, num_classes, bias=True),
    )


def _accuracy(preds: np.ndarray, labels: np.ndarray) -> float:
    return float((preds == labels).mean())


def _cifar_train(model, train_loader, optimizer, privacy_engine, criterion, delta, physical):
    model.train()
    losses, top1_acc, epsilons = [], [], []
    with BatchMemoryManager(
        data_loader=train_loader, max_physical_batch_size=physical, optimizer=optimizer
    ) as memory_safe_data_loader:
        for i, (images, target) in enumerate(memory_safe_data_loader):
            output = model(images)
            loss = criterion(output, target)
            preds = np.argmax(output.detach().cpu().numpy(), axis=1)
            labels = target.detach().cpu().numpy()
            top1_acc.append(_accuracy(preds, labels))
            losses.append(loss.item())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if i % 2 == 0:
                epsilons.append(privacy_engine.accountant.get_epsilon(delta=delta))
    return losses, epsilons


@pytest.mark.parametrize("grad_sample_mode", ["hooks", "ghost"])
def test_opacus_cifar10_example_loop(grad_sample_mode):
    torch.manual_seed(3)
    train_loader = DataLoader(_images(64, (3, 16, 16), 4), batch_size=16)
    model = _convnet(num_classes=10)
    assert not ModuleValidator.is_valid(model)
    model = ModuleValidator.fix(model)
    assert ModuleValidator.validate(model, strict=False) == []
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    privacy_engine = PrivacyEngine(accountant="rdp")
    options = dict(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        noise_multiplier=1.1,
        max_grad_norm=10.0,
        clipping="flat",
        grad_sample_mode=grad_sample_mode,
    )
    if grad_sample_mode == "ghost":
        model, optimizer, criterion, train_loader = privacy_engine.make_private(
            criterion=criterion, **options
        )
    else:
        model, optimizer, train_loader = privacy_engine.make_private(**options)
    before = [p.detach().clone() for p in model.parameters()]
    losses, epsilons = _cifar_train(
        model, train_loader, optimizer, privacy_engine, criterion, DELTA, physical=5
    )
    assert len(losses) >= 4  # every logical batch of ~16 came as chunks of at most 5
    assert privacy_engine.ledger.total_count == 4
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    epsilon = privacy_engine.accountant.get_epsilon(delta=DELTA)
    assert epsilon == pytest.approx(OPACUS_EPSILON[(1.1, 0.25, 4)]["rdp"], rel=1e-3)
    assert epsilons == sorted(epsilons)


def test_epsilon_equals_opacus_accountants_when_opacus_is_installed():
    accountants = pytest.importorskip("opacus.accountants")
    from dpvision.accounting import PrivacyLedger

    for (sigma, q, steps), measured in OPACUS_EPSILON.items():
        ledger = PrivacyLedger()
        ledger.record(noise_multiplier=sigma, released="gradients", sample_rate=q, count=steps)
        rdp, prv = accountants.RDPAccountant(), accountants.PRVAccountant()
        rdp.history = prv.history = [(sigma, q, steps)]
        assert rdp.get_epsilon(DELTA) == pytest.approx(measured["rdp"], rel=1e-9)
        assert ledger.epsilon(DELTA, accountant="rdp") == pytest.approx(measured["rdp"], rel=1e-3)
        assert ledger.epsilon(DELTA, accountant="pld") == pytest.approx(
            float(prv.get_epsilon(DELTA)), abs=0.02
        )


def test_where_dpvision_deliberately_differs_it_says_so_in_one_line():
    model = nn.Linear(4, 3)
    loader = DataLoader(TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,))), 5)
    common = dict(
        module=model,
        optimizer=optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    for options, message in [
        ({"poisson_sampling": False}, "Poisson"),
        ({"clipping": "automatic"}, "clipping='flat'"),
        ({"grad_sample_mode": "magic"}, "unknown grad_sample_mode"),
        ({"batch_first": False}, "batch_first=False"),
        ({"criterion": nn.CrossEntropyLoss(reduction="sum")}, "must agree"),
    ]:
        with pytest.raises(DPVisionError, match=message) as error:
            PrivacyEngine().make_private(**common, **options)
        assert "\n" not in str(error.value)
    with pytest.raises(DPVisionError, match="gdp"):
        PrivacyEngine(accountant="gdp")
    with pytest.raises(DPVisionError, match="noise_generator"):  # secure_mode draws its own
        PrivacyEngine(secure_mode=True).make_private(**common, noise_generator=torch.Generator())
    assert PrivacyEngine(accountant="prv").accountant.mechanism() == "pld"
    for mode in ("hooks", "functorch", "ew"):  # Opacus' modes: the same clipping here
        made = PrivacyEngine().make_private(**common, grad_sample_mode=mode)
        assert len(made) == 3


def test_module_validator_freezes_batchnorm_for_fine_tuning():
    torch.manual_seed(5)
    model = _convnet(10)
    model.train()
    model(torch.randn(32, 3, 16, 16))  # pre-trained statistics
    model.eval()
    x = torch.randn(4, 3, 16, 16)
    fixed = ModuleValidator.fix(model, batch_norm="freeze")
    fixed.eval()
    torch.testing.assert_close(fixed(x), model(x))
    assert ModuleValidator.is_valid(fixed.train())
    with pytest.raises(DPVisionError, match="batch_norm must be"):
        ModuleValidator.fix(model, batch_norm="drop")
    attention = nn.MultiheadAttention(4, 2, dropout=0.1, batch_first=True)
    assert ModuleValidator.fix(attention).dropout == 0.0
    assert attention.dropout == 0.1
    with pytest.raises(DPVisionError, match="batch_first=False"):
        ModuleValidator.fix_and_validate(nn.MultiheadAttention(4, 2))


def test_batch_memory_manager_needs_the_private_loader_and_optimizer():
    model = nn.Linear(4, 3)
    loader = DataLoader(TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,))), 5)
    _, optimizer, private_loader = PrivacyEngine().make_private(
        module=model,
        optimizer=optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    with pytest.raises(DPVisionError, match="data loader make_private returned"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer)
    with pytest.raises(DPVisionError, match="positive integer"):
        BatchMemoryManager(
            data_loader=private_loader, max_physical_batch_size=0, optimizer=optimizer
        )
