"""State a module keeps outside its registered buffers, and loops that leave the loader.

Issue 48, finding 6: a running mean kept in a plain attribute (a forgotten
``register_buffer``) carried batch t's statistic into step t + 1 (step 2 moved 3.4 C where
C is allowed; written by the layout probe, step 1 moved 3.3 C; by a gradient hook, 1.02 C).
The PrivacyEngine now watches every tensor its module's attributes hold (plain attributes,
lists, tuples, dicts) over each pass over private rows (the layout probe, the recorded pass,
the mixing re-run, the backward pass), and refuses one written there in one line naming the
attribute; constant tensors set in ``__init__``, or recomputed to the same values, pass.

Noticed in the same review: a loop that leaves the loader before stepping on a batch and
starts a new pass skipped that batch (a data-dependent choice of which batches are released:
24 steps released, each with the target, recorded at q = 0.12). The batch left now comes
first in the next pass; leaving it twice untouched, or going on past a refused step, is
refused.

Each adversary run must be refused or move every release by at most C·(1 + 1e-6)
(:func:`dpvision.testing.check_sensitivity`, noise off, one huge example added).
"""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpvision import DPVisionError, PrivacyEngine
from dpvision.accounting import PrivacyLedger
from dpvision.testing import check_sensitivity, privacy_engine_release
from dpvision.training import DPSGDStep
from dpvision.training.buffers import BufferWatch

TIGHT = 1e-6
SECRET = 1234.5678  # a value of the private batch: no message may show it


def _data(n: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=generator)


def _epochs(count: int = 2):
    def loop(model, optimizer, loader) -> None:
        for _ in range(count):
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()

    return loop


def _held(report) -> bool:
    """Refused, or every release moved by at most C·(1 + 1e-6)."""
    return report.refusal is not None or (report.ok and report.max_ratio <= 1 + TIGHT)


def _check(model: nn.Module, data=None, epochs: int = 2):
    run = privacy_engine_release(model, _epochs(epochs))
    return check_sensitivity(run, data or _data(), neighbours=3, tolerance=TIGHT)


# --- finding 6: a statistic of batch t kept in an attribute and read at step t + 1 --------


class Carried(nn.Module):
    """Subtracts the previous step's batch mean, kept outside the registered buffers.

    Written only in passes with gradients, and one pass late (the mean of batch t is moved
    into place at the start of pass t + 1): the layout probe and the mixing re-run, which
    run without gradients, see the state the recorded pass saw and find nothing mixed.
    """

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.where = where
        zero = torch.zeros(4, dtype=torch.float64)
        if where == "attribute":
            self.running, self.pending = zero, None
        elif where == "in place":  # the same two tensors, written in place
            self.running, self.pending, self.fresh = zero, zero.clone(), torch.tensor(False)
        elif where == ".data":
            self.running, self.pending = zero, zero.clone()
        elif where == "list":
            self.state = [zero, None]
        elif where == "dict":
            self.state = {"running": zero, "pending": None}
        elif where == "nested":
            self.state = {"stats": [(zero,), None]}
        elif where == "numpy":
            self.running, self.pending = zero.numpy(), None
        self.double()

    def _move(self, mean: torch.Tensor) -> torch.Tensor:
        """Stores ``mean`` as pending; returns the running value (the previous pending)."""
        where = self.where
        if where in ("attribute", "numpy"):
            if self.pending is not None:
                self.running = self.pending
            self.pending = mean.numpy() if where == "numpy" else mean
            return torch.from_numpy(self.running) if where == "numpy" else self.running
        if where == "in place":
            if self.fresh:
                self.running.copy_(self.pending)
            self.pending.copy_(mean)
            self.fresh.fill_(True)
            return self.running
        if where == ".data":
            self.running.data = self.pending.clone()
            self.pending.data.copy_(mean)
            return self.running
        if where == "list":
            if self.state[1] is not None:
                self.state[0] = self.state[1]
            self.state[1] = mean
            return self.state[0]
        if where == "dict":
            if self.state["pending"] is not None:
                self.state["running"] = self.state["pending"]
            self.state["pending"] = mean
            return self.state["running"]
        stats = self.state["stats"]
        if stats[1] is not None:
            stats[0] = (stats[1],)
        stats[1] = mean
        return stats[0][0]

    def running_value(self) -> torch.Tensor:
        if self.where in ("attribute", "in place", ".data"):
            return self.running
        if self.where == "numpy":
            return torch.from_numpy(self.running)
        if self.where == "list":
            return self.state[0]
        if self.where == "dict":
            return self.state["running"]
        return self.state["stats"][0][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            with torch.no_grad():
                running = self._move(x.mean(0).detach())
        else:
            running = self.running_value()
        return self.head(torch.tanh(self.body(x - running)))


WHERE = ["attribute", "in place", ".data", "list", "dict", "nested", "numpy"]
NAMES = {"list": "state", "dict": "state", "nested": "state"}


@pytest.mark.parametrize("where", WHERE)
def test_a_batch_statistic_carried_in_an_attribute_is_refused(where):
    report = _check(Carried(where))
    assert _held(report), f"{where}: step 2 moved {report.max_ratio:.3f} C"
    assert report.refusal is not None
    message = report.refusal
    assert "\n" not in message
    assert message.startswith("attribute ")
    name = NAMES.get(where)
    if name is not None:
        assert message.startswith(f"attribute {name!r} of the module")
    else:
        assert message.split("'")[1] in ("running", "pending", "fresh")
    assert "register_buffer" not in message.split(":")[0]


class ProbeCarried(nn.Module):
    """Keeps the batch mean of the second pass without gradients (the layout probe's second
    run, before the recorded pass) and subtracts it after the probe: the probe restored the
    buffers it moved, never the attributes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.calls, self.seen = 0, None
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 2:
                self.seen = x.mean(0).detach()
        probing = not torch.is_grad_enabled() and self.calls <= 2
        shift = torch.zeros_like(x[0]) if probing or self.seen is None else self.seen
        return self.head(torch.tanh(self.body(x - shift)))


def test_an_attribute_written_by_the_layout_probe_is_refused():
    report = _check(ProbeCarried(), epochs=1)
    assert _held(report), f"moved {report.max_ratio:.3f} C"
    assert report.refusal is not None
    assert report.refusal.startswith("attribute 'seen' of the module changed")


class GradientKept(nn.Module):
    """Keeps the batch's summed output gradient of its first layer (a full backward hook)
    and adds it to that layer's output in the next pass: state written by the backward pass
    (accepted before; step 2 moved 1.02 C)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.kept = torch.zeros(8, dtype=torch.float64)
        self.body.register_full_backward_hook(self._keep)
        self.double()

    def _keep(self, module, grad_input, grad_output) -> None:
        self.kept = grad_output[0].detach().sum(0) * 50

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x) + self.kept))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_an_attribute_written_by_the_backward_pass_is_refused():
    report = _check(GradientKept())
    assert _held(report), f"moved {report.max_ratio:.3f} C"
    assert report.refusal is not None
    assert report.refusal.startswith(
        "attribute 'kept' of the module changed during a private backward pass"
    )
    # A step on that pass is refused too, if the loop caught the error.
    model = GradientKept()
    private, optimizer, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(*_data(40)), batch_size=40),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    xb, yb = next(batches := iter(loader))
    with pytest.raises(DPVisionError, match="backward pass"):
        F.cross_entropy(private(xb), yb).backward()
    with pytest.raises(DPVisionError, match="backward pass"):
        optimizer.step()
    del batches


class Logged(nn.Module):
    """Keeps the last batch's largest input "for logging", inside a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(x.detach().max())
        return x


def test_the_refusal_names_the_attribute_and_no_value():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Logged(), nn.Linear(4, 3)).double()
    x, y = _data(40)
    x[3, 1] = SECRET
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=40),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    with pytest.raises(DPVisionError) as error:
        _epochs(1)(private, optimizer, loader)
    message = str(error.value)
    assert message.startswith("attribute '1.log' of the module changed during a private ")
    assert "\n" not in message
    assert "1234" not in message
    assert len(engine.ledger) == 0


def test_the_dpsgd_step_refuses_an_attribute_written_in_the_forward_pass():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Logged(), nn.Linear(4, 3)).double()
    ledger = PrivacyLedger()
    step = DPSGDStep.build(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        loss_fn=nn.CrossEntropyLoss(reduction="none"),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        sample_rate=0.1,
        num_examples=100,
        ledger=ledger,
        generator=torch.Generator().manual_seed(0),
    )
    x, y = _data(6)
    with pytest.raises(DPVisionError, match=re.escape("attribute '1.log' of the model changed")):
        step([(x[:3], y[:3]), (x[3:], y[3:])])
    assert len(ledger) == 0


# --- honest models: constants kept in attributes pass ------------------------------------


class Constants(nn.Module):
    """Tensors set in ``__init__`` and only read (a mask, a table in a dict, a list of
    scales, a view of a parameter, an array), and a cache made in ``__init__`` and made
    again, to the same values, in every pass."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.mask = (torch.arange(4) % 2).double()
        self.table = {"shift": torch.full((4,), 0.25, dtype=torch.float64)}
        self.scales = [torch.tensor(0.5, dtype=torch.float64), (torch.tensor(2.0),)]
        self.weight_view = self.body.weight.detach()[:2]  # moves with the noisy updates
        self.numpy_table = np.arange(4.0)
        self.ones = torch.ones(8, dtype=torch.float64)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ones = torch.ones(8, dtype=x.dtype)  # a cache that does not depend on the data
        h = (x + self.table["shift"]) * self.mask * self.scales[0]
        h = h + torch.from_numpy(self.numpy_table) * 0.0
        return self.head(torch.tanh(self.body(h)) * self.ones)


def _honest_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.Tanh(),
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 3),
    ).double()


def _images(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(n, 1, 8, 8, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=generator)


@pytest.mark.parametrize("name", ["constants", "cnn"])
def test_honest_models_with_constant_attributes_train_and_hold(name):
    model, data = (Constants(), _data()) if name == "constants" else (_honest_cnn(), _images())
    report = _check(model, data)
    assert report.refusal is None
    assert report.ok
    assert report.max_ratio <= 1 + TIGHT
    # With real updates (the view of a parameter moves between steps, not during them).
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(*data), batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        max_physical_batch_size=2,
    )
    _epochs(2)(private, optimizer, loader)
    assert engine.ledger.total_count == 2 * len(loader)


def test_an_attribute_set_between_passes_is_not_the_watchs_concern():
    model = Constants()
    watch = BufferWatch(model)
    watch.start()
    model(torch.zeros(2, 4, dtype=torch.float64))  # recomputes `ones` to the same values
    watch.check()
    model.mask = torch.ones(4, dtype=torch.float64)  # between two passes: the caller's code
    watch.start()
    watch.check()
    model.table["shift"].add_(1.0)  # during one
    with pytest.raises(DPVisionError, match="attribute 'table' of the model changed"):
        watch.check()
    watch.start()
    del model.numpy_table  # removing a constant publishes nothing
    watch.check()


class LazyCache(nn.Module):
    """Fills a cache that does not depend on the data at its first forward pass."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.cache: torch.Tensor | None = None
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None or self.cache.shape[0] != x.shape[1]:
            self.cache = torch.linspace(0, 1, x.shape[1], dtype=x.dtype)
        return self.head(torch.tanh(self.body(x + self.cache)))


def test_a_cache_first_filled_in_a_private_pass_is_refused_unless_filled_before():
    report = _check(LazyCache())
    assert report.refusal is not None
    assert report.refusal.startswith("attribute 'cache' of the module changed")
    assert "before training" in report.refusal
    model = LazyCache()
    model(torch.zeros(1, 4, dtype=torch.float64))  # a pass on public data fills it
    report = _check(model)
    assert report.refusal is None
    assert report.max_ratio <= 1 + TIGHT


# --- item 2: leaving the loader and starting over ----------------------------------------


def _engine(n: int = 100, batch_size: int = 12, **options):
    x, y = _data(n)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        secret_seed=7,
        **options,
    )
    return engine, private, optimizer, loader


def _step(private, optimizer, xb, yb) -> None:
    optimizer.zero_grad()
    F.cross_entropy(private(xb), yb).backward()
    optimizer.step()


def test_a_batch_left_before_its_step_comes_first_in_the_next_pass():
    engine, private, optimizer, loader = _engine()
    left = next(iter(loader))[0]  # e.g. a peek at the data before training
    first, yb = next(iter(loader))  # the same batch, drawn once
    assert torch.equal(first, left)
    _step(private, optimizer, first, yb)
    # A fixed number of steps per epoch (leave at index 3): the batch left at the end of
    # one epoch is the first of the next, released once, in the order drawn.
    released, left = [], []
    for _ in range(2):
        for index, (xb, yb) in enumerate(loader):
            if index == 3:
                left.append(xb)
                break
            released.append(xb)
            _step(private, optimizer, xb, yb)
    assert torch.equal(released[3], left[0])
    assert not any(torch.equal(left[1], xb) for xb in released)
    assert engine.ledger.total_count == 1 + 6


def test_a_logical_batch_left_mid_way_is_released_whole_in_the_next_pass():
    engine, private, optimizer, loader = _engine(batch_size=40, max_physical_batch_size=8)
    batches = iter(loader)
    chunk, yb = next(batches)
    while len(chunk) < 8:  # a batch of at least two chunks (the empty ones stepped)
        _step(private, optimizer, chunk, yb)
        chunk, yb = next(batches)
    _step(private, optimizer, chunk, yb)
    steps = engine.ledger.total_count
    with pytest.warns(UserWarning, match="discarded"):
        del batches  # the loop leaves after the first chunk: its clipped sum is dropped
    again = iter(loader)
    first, yb = next(again)
    assert torch.equal(first, chunk)  # the whole batch again, from its first chunk
    _step(private, optimizer, first, yb)
    for xb, yb in again:
        _step(private, optimizer, xb, yb)
        if engine.ledger.total_count > steps:
            break
    assert engine.ledger.total_count == steps + 1


def _leaves_the_batches_it_does_not_like(private, optimizer, loader, passes: int = 8) -> None:
    for _ in range(passes):
        for xb, yb in loader:
            if len(xb) % 2:  # a decision on the private batch (its size)
                break
            _step(private, optimizer, xb, yb)


def test_a_loop_that_skips_batches_by_leaving_and_starting_over_is_refused():
    _, private, optimizer, loader = _engine()
    with pytest.raises(DPVisionError, match="left twice") as error:
        _leaves_the_batches_it_does_not_like(private, optimizer, loader)
    assert "\n" not in str(error.value)
    with pytest.raises(DPVisionError, match="left twice"):  # and it stays refused
        next(iter(loader))


def test_a_loop_that_keeps_only_the_batches_holding_the_target_is_refused():
    # Before: 24 steps released over 200 passes, every one with the target (inclusion 1),
    # each recorded as a Poisson step at q = 0.12.
    engine, private, optimizer, loader = _engine()
    target = loader.loader.dataset.tensors[0][0]
    released = []

    def keeps_the_target() -> None:
        for _ in range(200):
            for xb, yb in loader:
                if not bool((xb == target).all(1).any()):
                    break  # leave every batch without the target, start over
                _step(private, optimizer, xb, yb)
                released.append(xb)

    with pytest.raises(DPVisionError, match="left twice"):
        keeps_the_target()
    assert engine.ledger.total_count == len(released) <= 1


def _outlier_leaving_loop(model, optimizer, loader) -> None:
    """Three passes, each left at a batch holding an outlier (a decision on its rows)."""
    for _ in range(3):
        for xb, yb in loader:
            if float(xb.abs().max()) > 100:
                break
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()


def test_skipping_by_leaving_is_refused_before_the_releases_depend_on_the_rows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    run = privacy_engine_release(model, _outlier_leaving_loop)
    report = check_sensitivity(run, _data(), neighbours=2, tolerance=TIGHT)
    assert _held(report), report.problems  # before: D released 3 steps, D' none
    assert report.refusal is not None
    assert "left twice" in report.refusal


def test_a_refused_step_passed_over_is_a_skipped_batch():
    engine, private, optimizer, loader = _engine(batch_size=50)
    batches = iter(loader)
    xb, yb = next(batches)
    F.cross_entropy(private(xb + 1.0), yb).backward()  # not the loader's rows
    with pytest.raises(DPVisionError, match="not the batch the private data loader yielded"):
        optimizer.step()
    with pytest.raises(DPVisionError, match="skipped"):
        next(batches)  # the loop caught the refusal and went on
    assert engine.ledger.total_count == 0


def test_a_batch_left_under_one_batch_memory_manager_comes_first_under_the_next():
    from dpvision.privacy_engine import BatchMemoryManager

    _, _, optimizer, loader = _engine(batch_size=40)
    with BatchMemoryManager(
        data_loader=loader, max_physical_batch_size=8, optimizer=optimizer
    ) as chunks:
        left = next(iter(chunks))[0]
    with BatchMemoryManager(
        data_loader=loader, max_physical_batch_size=8, optimizer=optimizer
    ) as chunks:
        first = next(iter(chunks))[0]
    assert torch.equal(first, left)
