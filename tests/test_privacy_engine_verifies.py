"""PrivacyEngine refuses what it cannot verify: the loss's normaliser, batch mixing at any
step, batches that did not come from its sampler.

Each reproduction of the independent review (noise off, one huge example added at several
positions, :func:`dpvision.testing.check_sensitivity`) must be refused in one line or move
the release by at most C·(1 + 1e-6).
"""

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpvision import PrivacyEngine
from dpvision.errors import DPVisionError
from dpvision.testing import check_sensitivity, privacy_engine_release

TIGHT = 1e-6


def _data(n: int = 12, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, classes, (n,), generator=generator)


def _model(classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, classes)).double()


def _loop(loss_of):
    def loop(model, optimizer, loader):
        for x, y in loader:
            optimizer.zero_grad()
            loss_of(model, x, y).backward()
            optimizer.step()

    return loop


def _held(report) -> bool:
    """Refused, or every release moved by at most C·(1 + 1e-6)."""
    return report.refusal is not None or (report.ok and report.max_ratio <= 1 + TIGHT)


def _check(loss_of, *, data=None, **options):
    run = privacy_engine_release(_model(), _loop(loss_of), **options)
    return check_sensitivity(run, data or _data(), neighbours=3, tolerance=TIGHT)


WEIGHTS = torch.tensor([0.2, 1.0, 5.0], dtype=torch.float64)
TRUSTED_BEFORE = {
    "class weights (mean over Σ w[y])": lambda m, x, y: F.cross_entropy(m(x), y, weight=WEIGHTS),
    "ignore_index (mean over the rest)": lambda m, x, y: F.cross_entropy(
        m(x), torch.where(y == 0, -100, y)
    ),
    "ignore_index=1": lambda m, x, y: F.cross_entropy(m(x), y, ignore_index=1),
    "logits centred over the batch": lambda m, x, y: F.cross_entropy(
        (out := m(x)) - out.mean(0), y
    ),
    "label smoothing": lambda m, x, y: F.cross_entropy(m(x), y, label_smoothing=0.1),
    "a loss scaled by 2": lambda m, x, y: 2 * F.cross_entropy(m(x), y),
    "a batch-normalised loss": lambda m, x, y: (
        (losses := F.cross_entropy(m(x), y, reduction="none")) / losses.detach().sum()
    ).sum(),
    "mean squared error (any gradient fits some target)": lambda m, x, y: F.mse_loss(
        m(x), F.one_hot(y, 3).double()
    ),
}


@pytest.mark.parametrize("name", sorted(TRUSTED_BEFORE))
def test_a_loss_with_a_data_dependent_normaliser_is_refused(name):
    report = _check(TRUSTED_BEFORE[name])
    assert report.refusal is not None, f"{name}: moved {report.max_ratio:.3f} C"
    assert "per-example" in report.refusal
    assert "\n" not in report.refusal


def test_a_mean_loss_declared_sum_is_refused():
    report = _check(lambda m, x, y: F.cross_entropy(m(x), y), loss_reduction="sum")
    assert report.refusal is not None
    assert "plain sum" in report.refusal


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_plain_cross_entropy_and_nll_pass_and_are_exact(reduction):
    for loss_of in (
        lambda m, x, y: F.cross_entropy(m(x), y, reduction=reduction),
        lambda m, x, y: F.nll_loss(F.log_softmax(m(x), 1), y, reduction=reduction),
    ):
        report = _check(loss_of, loss_reduction=reduction)
        assert report.refusal is None, report.refusal
        assert report.ok, report.summary()
        assert report.max_ratio <= 1 + TIGHT
        assert report.max_ratio > 0.99  # the added example is clipped to C exactly


def test_a_per_example_criterion_makes_weights_and_ignore_index_exact():
    criterion = nn.CrossEntropyLoss(weight=WEIGHTS, ignore_index=0, reduction="none")

    def loop(model, optimizer, loader):
        loss_fn = model.per_example_loss(criterion)
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()

    run = privacy_engine_release(_model(), loop)
    report = check_sensitivity(run, _data(), neighbours=3, tolerance=TIGHT)
    assert report.refusal is None, report.refusal
    assert report.ok, report.summary()
    assert report.max_ratio <= 1 + TIGHT


def test_the_per_example_criterion_trains_on_the_weighted_loss():
    """Its gradient is that of Σ w[yᵢ]ℓᵢ / n: the weights count, the normaliser is public."""
    model = _model()
    x, y = _data()
    private, optimizer, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=12),
        noise_multiplier=0.0,
        max_grad_norm=1e6,  # nothing clipped: the step's gradient is the plain one
    )
    criterion = private.per_example_loss(nn.CrossEntropyLoss(weight=WEIGHTS, reduction="none"))
    out = private(x)
    loss = criterion(out, y)
    weighted = F.cross_entropy(out.detach(), y, reduction="none") * WEIGHTS[y]
    torch.testing.assert_close(loss, weighted.mean())
    loss.backward()
    optimizer.declare_sampling(1.0)  # the whole dataset: the sum is divided by N = 12
    optimizer.step()
    reference = _model()
    (F.cross_entropy(reference(x), y, reduction="none") * WEIGHTS[y]).mean().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_the_ghost_criterion_is_the_per_example_one_and_a_scaled_one_is_refused():
    model = _model()
    x, y = _data()
    engine = PrivacyEngine()
    private, optimizer, criterion, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=6),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        criterion=nn.CrossEntropyLoss(weight=WEIGHTS),
        grad_sample_mode="ghost",
    )
    for xb, yb in loader:
        optimizer.zero_grad()
        criterion(private(xb), yb).backward()
        optimizer.step()
    assert engine.ledger.total_count == 2
    xb, yb = next(iter(loader))
    with pytest.raises(DPVisionError, match="scaled"):
        (criterion(private(xb), yb) * 3).backward()


class MaskedHead(nn.Module):
    """Logits of an inactive class masked with -inf (a -inf must not switch the check off)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()
        self.register_buffer("active", torch.tensor([True, True, True, False]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.cat([self.net(x), torch.zeros_like(x[:, :1])], 1)
        return logits.masked_fill(~self.active, float("-inf"))


def test_masked_logits_do_not_switch_the_loss_check_off():
    weights = torch.tensor([0.2, 1.0, 5.0, 1.0], dtype=torch.float64)
    run = privacy_engine_release(
        MaskedHead(), _loop(lambda m, x, y: F.cross_entropy(m(x), y, weight=weights))
    )
    weighted = check_sensitivity(run, _data(), neighbours=3, tolerance=TIGHT)
    assert weighted.refusal is not None, weighted.summary()
    plain = privacy_engine_release(MaskedHead(), _loop(lambda m, x, y: F.cross_entropy(m(x), y)))
    report = check_sensitivity(plain, _data(), neighbours=3, tolerance=TIGHT)
    assert report.refusal is None, report.refusal
    assert report.max_ratio <= 1 + TIGHT


def test_rows_dropped_by_a_batch_wide_rule_are_refused():
    """Hard-example mining: the kept rows look plain, the dropped ones are zeros."""

    def hardest_half(m, x, y):
        losses = F.cross_entropy(m(x), y, reduction="none")
        return (losses * (losses >= losses.median()).detach()).mean()

    assert _check(hardest_half).refusal is not None


def test_an_output_changed_in_place_after_the_forward_pass_is_refused():
    def centred_in_place(m, x, y):
        out = m(x)
        out -= out.detach().mean(0)
        return F.cross_entropy(out, y)

    report = _check(centred_in_place)
    assert report.refusal is not None
    assert "in place" in report.refusal


class WithFeatures(nn.Module):
    """Returns (logits, features): the features also feed the logits inside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.tanh(self.body(x))
        return self.head(features), features


def test_a_model_returning_logits_and_features_trains_exactly():
    run = privacy_engine_release(
        WithFeatures().double(), _loop(lambda m, x, y: F.cross_entropy(m(x)[0], y))
    )
    report = check_sensitivity(run, _data(), neighbours=3, tolerance=TIGHT)
    assert report.refusal is None, report.refusal
    assert report.max_ratio <= 1 + TIGHT


def test_an_auxiliary_head_with_a_public_weight_trains_exactly():
    def loop(model, optimizer, loader):
        main = model.per_example_loss(nn.CrossEntropyLoss(reduction="none"))
        aux = model.per_example_loss(nn.CrossEntropyLoss(reduction="none"), weight=0.4)
        for x, y in loader:
            optimizer.zero_grad()
            logits, _ = model(x)
            (main(logits, y) + aux(logits, y)).backward()
            optimizer.step()

    report = check_sensitivity(
        privacy_engine_release(WithFeatures().double(), loop), _data(), tolerance=TIGHT
    )
    assert report.refusal is not None  # two terms on one output: one criterion per output

    def two_heads(model, optimizer, loader):
        main = model.per_example_loss(nn.CrossEntropyLoss(reduction="none"))
        aux = model.per_example_loss(lambda f, t: f.pow(2).sum(1), weight=0.4)
        for x, y in loader:
            optimizer.zero_grad()
            logits, features = model(x)
            (main(logits, y) + aux(features, y)).backward()
            optimizer.step()

    report = check_sensitivity(
        privacy_engine_release(WithFeatures().double(), two_heads), _data(), tolerance=TIGHT
    )
    assert report.refusal is None, report.refusal
    assert report.max_ratio <= 1 + TIGHT


def test_a_consistency_term_between_two_passes_trains_exactly():
    def consistency(model, optimizer, loader):
        term = model.per_example_loss(
            lambda outs, t: (
                F.cross_entropy(outs[0], t, reduction="none") + (outs[0] - outs[1]).pow(2).sum(1)
            )
        )
        for x, y in loader:
            optimizer.zero_grad()
            first = model(x)
            with model.same_examples():
                second = model(x)  # R-Drop: the same rows under other dropout masks
            term((first, second), y).backward()
            optimizer.step()

    def mixed_views(model, optimizer, loader):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            with model.same_examples():  # a second "view" that mixes examples, in the loop
                loss = loss + F.cross_entropy(model(0.5 * x + 0.5 * x.flip(0)), y)
            loss.backward()
            optimizer.step()

    dropout = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 3))
    report = check_sensitivity(
        privacy_engine_release(dropout.double(), consistency), _data(), neighbours=1
    )
    assert report.refusal is None, report.refusal  # masks differ between D and D′
    report = check_sensitivity(
        privacy_engine_release(_model(), consistency), _data(), tolerance=TIGHT
    )
    assert report.refusal is None, report.refusal
    assert report.max_ratio <= 1 + TIGHT
    report = check_sensitivity(privacy_engine_release(_model(), mixed_views), _data())
    assert report.refusal is not None
    assert "not the batch" in report.refusal


# --- batch mixing, at any step -------------------------------------------------------------


class MixesAtRandom(nn.Module):
    """Manifold mixup with probability ½ at every call (torch's own random coin; under the
    layout probe's fixed seed the coin says "do not mix", so only the per-pass check sees
    it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if bool(torch.rand(()) > 0.5):
            h = 0.5 * (h + h.roll(1, 0))
        return self.head(h)


class MixesFromStepTwo(nn.Module):
    """Mixes rows once a flag is switched on (here after the first step, as after epoch 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.mixing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if self.mixing:
            h = h - h.mean(0)
        return self.head(h)


def _mixing_run(model: nn.Module, steps: int):
    def loop(private, optimizer, loader):
        for _ in range(steps):
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(private(x), y).backward()
                optimizer.step()
                private._module.mixing = True  # read by MixesFromStepTwo only

    return privacy_engine_release(model.double(), loop)


@pytest.mark.parametrize("seed", range(4))
def test_a_model_that_mixes_at_random_is_refused_at_the_step_it_mixes(seed):
    torch.manual_seed(seed)
    report = check_sensitivity(_mixing_run(MixesAtRandom(), 6), _data(), neighbours=2)
    assert report.refusal is not None, report.summary()  # P[no mixing in 6 steps] = 1/64
    assert "mixed examples in this pass" in report.refusal


class MixesOnlyWithAnOutlier(nn.Module):
    """An "overflow guard" that divides by the batch's largest activation once it is large:
    on D it never fires, on D′ the added outlier sets it for every row."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h / h.abs().max().clamp(min=10.0))


def test_a_model_that_mixes_only_with_an_outlier_is_refused():
    report = check_sensitivity(_mixing_run(MixesOnlyWithAnOutlier(), 1), _data(), neighbours=3)
    assert report.refusal is not None, report.summary()
    assert "mix" in report.refusal


def test_a_model_that_starts_mixing_after_the_first_step_is_refused():
    report = check_sensitivity(_mixing_run(MixesFromStepTwo(), 3), _data(), neighbours=2)
    assert len(report.movements) == 0  # refused at step 2, before D′ could be compared
    assert report.refusal is not None
    assert "mixed examples" in report.refusal


def test_a_model_that_never_mixes_passes_every_step():
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    report = check_sensitivity(_mixing_run(model, 3), _data(), neighbours=2, tolerance=TIGHT)
    assert report.refusal is None, report.refusal
    assert report.ok
    assert report.max_ratio <= 1 + TIGHT
    # With dropout the masks differ between D and D′ (they are drawn per row), so only
    # "not refused" is comparable: the check replays the pass's own masks.
    dropout = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 3))
    assert check_sensitivity(_mixing_run(dropout, 3), _data(), neighbours=1).refusal is None


def test_the_mixing_check_leaves_the_random_stream_as_the_pass_left_it():
    """The check's extra pass draws the same numbers as the real one and rewinds after."""
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 3)).double()
    x, y = _data()
    private, _, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=12),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
    )
    private(x)  # the first pass of this shape is probed as well
    torch.manual_seed(5)
    checked = private(x)
    after = torch.rand(3)
    torch.manual_seed(5)
    with private._tape.paused():
        plain = model(x)
    assert torch.equal(checked, plain)
    assert torch.equal(after, torch.rand(3))


# --- where the batches come from ------------------------------------------------------------


def _engine_with(batch_size: int = 12, n: int = 100):
    x, y = _data(n)
    engine, private, optimizer, loader = _make(TensorDataset(x, y), batch_size)
    return engine, private, optimizer, loader, (x, y)


def _make(dataset: TensorDataset, batch_size: int = 12):
    model = _model()
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset, batch_size=batch_size),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    return engine, private, optimizer, loader


def test_steps_on_one_fixed_batch_are_refused_unless_declared():
    engine, private, optimizer, _, (x, y) = _engine_with(10)
    fixed_x, fixed_y = x[:10], y[:10]
    F.cross_entropy(private(fixed_x), fixed_y).backward()
    with pytest.raises(DPVisionError, match="did not come from the private data loader"):
        optimizer.step()
    assert engine.ledger.total_count == 0
    optimizer.declare_sampling(1.0)  # every step sees the same 10 examples: no amplification
    for _ in range(10):
        optimizer.zero_grad()
        F.cross_entropy(private(fixed_x), fixed_y).backward()
        optimizer.step()
    assert engine.ledger.total_count == 10
    honest = engine.get_epsilon(1e-5)
    poisson = PrivacyEngine()
    # What Opacus (and dpvision before) accounted for the same 10 steps: Poisson at q = 0.1.
    assert honest > 3 * _poisson_epsilon(poisson, steps=10, rate=0.1)


def _poisson_epsilon(engine: PrivacyEngine, *, steps: int, rate: float) -> float:
    engine.ledger.record(noise_multiplier=1.0, sample_rate=rate, count=steps, released="sum")
    return engine.get_epsilon(1e-5)


def test_a_shuffled_loader_of_the_loops_own_is_refused():
    _, private, optimizer, _, (x, y) = _engine_with()
    own = DataLoader(TensorDataset(x, y), batch_size=12, shuffle=True)
    xb, yb = next(iter(own))
    F.cross_entropy(private(xb), yb).backward()
    with pytest.raises(DPVisionError, match="declare_sampling"):
        optimizer.step()


def test_a_batch_swapped_in_while_iterating_the_private_loader_is_refused():
    _, private, optimizer, loader, (x, y) = _engine_with()
    xb, _ = next(iter(loader))
    rows = len(xb) + 1  # other rows than the chunk's
    F.cross_entropy(private(x[:rows]), y[:rows]).backward()
    with pytest.raises(DPVisionError, match="loader's batch"):
        optimizer.step()


def test_a_step_on_other_rows_of_the_same_size_is_refused():
    _, private, optimizer, loader, (x, _) = _engine_with()
    batches = iter(loader)
    xb, yb = next(batches)
    other = x[-len(xb) :] * 1.5  # another batch of as many rows: the loop's own
    F.cross_entropy(private(other), yb).backward()
    with pytest.raises(DPVisionError, match="not the batch the private data loader yielded"):
        optimizer.step()


def test_inputs_normalised_with_the_batchs_statistics_are_refused():
    _, private, optimizer, loader, _ = _engine_with()
    batches = iter(loader)
    xb, yb = next(batches)
    F.cross_entropy(private((xb - xb.mean(0)) / xb.std(0)), yb).backward()
    with pytest.raises(DPVisionError, match="the batch's statistics"):
        optimizer.step()


def test_labels_that_are_not_the_loaders_are_refused():
    _, private, optimizer, loader, _ = _engine_with()
    batches = iter(loader)
    xb, yb = next(batches)
    teacher = (yb + 1) % 3  # e.g. a teacher's hard labels
    F.cross_entropy(private(xb), teacher).backward()
    with pytest.raises(DPVisionError, match="labels"):
        optimizer.step()


def test_a_skipped_batch_is_refused():
    _, private, optimizer, loader, _ = _engine_with()

    def skipping_loop() -> None:
        for index, (xb, yb) in enumerate(loader):
            if index == 1:
                continue  # e.g. an empty batch, or one of high loss
            optimizer.zero_grad()
            F.cross_entropy(private(xb), yb).backward()
            optimizer.step()

    with pytest.raises(DPVisionError, match="skipped"):
        skipping_loop()


def test_a_model_left_in_evaluation_mode_is_refused():
    _, private, optimizer, loader, _ = _engine_with()
    private.eval()
    batches = iter(loader)
    xb, yb = next(batches)
    while len(xb) == 0:
        optimizer.step()
        xb, yb = next(batches)
    F.cross_entropy(private(xb), yb).backward()
    with pytest.raises(DPVisionError, match=r"model\.train"):
        optimizer.step()


def test_two_steps_on_one_chunk_are_refused():
    _, private, optimizer, loader, _ = _engine_with()
    batches = iter(loader)
    xb, yb = next(batches)
    F.cross_entropy(private(xb), yb).backward()
    optimizer.step()
    F.cross_entropy(private(xb), yb).backward()
    with pytest.raises(DPVisionError, match="did not come from"):
        optimizer.step()


def test_declared_sampling_is_checked_and_recorded():
    engine, private, optimizer, _, (x, y) = _engine_with()
    for bad in (0, 1.5, -0.1, math.nan, True):
        with pytest.raises(DPVisionError, match="sample_rate"):
            optimizer.declare_sampling(bad)
    optimizer.declare_sampling(0.25)
    F.cross_entropy(private(x[:25]), y[:25]).backward()
    optimizer.step()
    (entry,) = engine.ledger.entries
    assert entry.sample_rate == 0.25


class MedianScaled(nn.Module):
    """Divides by the batch's median row norm (a change of its largest example alone would
    not move the median)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x / x.norm(dim=1).median())))


def test_a_model_scaled_by_the_batchs_median_is_refused():
    report = check_sensitivity(_mixing_run(MedianScaled(), 1), _data(), neighbours=2)
    assert report.refusal is not None
    assert "mixed" in report.refusal


def test_a_loop_that_skips_its_last_batch_is_refused_and_one_that_leaves_is_not():
    _, private, optimizer, loader, _ = _engine_with()

    def skips_the_last() -> None:
        for index, (xb, yb) in enumerate(loader):
            if index == len(loader) - 1:
                continue
            optimizer.zero_grad()
            F.cross_entropy(private(xb), yb).backward()
            optimizer.step()

    with pytest.raises(DPVisionError, match="skipped"):
        skips_the_last()
    # Leaving before a step (a fixed number of steps per epoch) is the loop's choice: the
    # batch left is released by nobody, and the next epoch starts afresh.
    engine, private, optimizer, loader, _ = _engine_with()
    for _ in range(2):
        for index, (xb, yb) in enumerate(loader):
            if index == 3:
                break
            optimizer.zero_grad()
            F.cross_entropy(private(xb), yb).backward()
            optimizer.step()
    assert engine.ledger.total_count == 6


def _engine_on(dataset, batch_size: int = 12):
    return _make(dataset, batch_size)[1:]


def test_one_hot_labels_are_compared_and_extra_fields_are_not_labels():
    x, y = _data(100)
    private, optimizer, loader = _engine_on(TensorDataset(x, F.one_hot(y, 3).double()))
    batches = iter(loader)
    xb, yb = next(batches)
    F.cross_entropy(private(xb), yb).backward()  # soft-label form of the same labels
    optimizer.step()
    xb, yb = next(batches)
    F.cross_entropy(private(xb), (yb.argmax(1) + 1) % 3).backward()  # a teacher's labels
    with pytest.raises(DPVisionError, match="labels"):
        optimizer.step()
    index = torch.arange(100)
    private, optimizer, loader = _engine_on(TensorDataset(x, index, y))
    for xb, _, yb in loader:  # (inputs, index, labels): the index is not the labels
        optimizer.zero_grad()
        F.cross_entropy(private(xb), yb).backward()
        optimizer.step()


def test_the_models_input_may_be_any_field_of_the_batch():
    x, y = _data(100)

    class Conditioned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, condition: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
            return self.net(inputs) + 0.0 * condition[:, None]

    model = Conditioned()
    private, optimizer, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(y.double(), x, y), batch_size=12),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    for condition, xb, yb in loader:
        optimizer.zero_grad()
        F.cross_entropy(private(condition, xb), yb).backward()
        optimizer.step()


# --- the third review: arguments, targets, signs, batch size, dataclasses ---------------------


class TakesStatistics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        return self.net((x - mean) / std)


def test_batch_statistics_passed_as_arguments_are_refused():
    report = _check_model(
        TakesStatistics(),
        lambda m, x, y: F.cross_entropy(m(x, x.mean(0, keepdim=True), x.std(0, keepdim=True)), y),
    )
    assert report.refusal is not None
    assert "not one row per example" in report.refusal


def _check_model(model: nn.Module, loss_of, data=None):
    run = privacy_engine_release(model.double(), _loop(loss_of))
    return check_sensitivity(run, data or _data(), neighbours=3, tolerance=TIGHT)


def test_a_teachers_targets_through_the_per_example_criterion_are_refused():
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()  # train mode

    def distilled(model, optimizer, loader):
        criterion = model.per_example_loss(nn.CrossEntropyLoss(reduction="none"))
        for x, _ in loader:
            optimizer.zero_grad()
            with torch.no_grad():
                targets = teacher(x).argmax(1)
            criterion(model(x), targets).backward()
            optimizer.step()

    report = check_sensitivity(privacy_engine_release(_model(), distilled), _data())
    assert report.refusal is not None
    assert "targets" in report.refusal

    # The teacher evaluated one example at a time, inside the criterion: per-example.
    def per_example_teacher(model, optimizer, loader):
        teacher.eval()
        criterion = model.per_example_loss(
            lambda out, x: F.cross_entropy(out, teacher(x).argmax(1), reduction="none")
        )
        for x, _ in loader:
            optimizer.zero_grad()
            criterion(model(x), x).backward()
            optimizer.step()

    run = privacy_engine_release(_model(), per_example_teacher)
    report = check_sensitivity(run, _data(), neighbours=3, tolerance=TIGHT)
    assert report.refusal is None, report.refusal
    assert report.max_ratio <= 1 + TIGHT


def test_labels_are_required_and_float_class_indices_count_as_labels():
    x, y = _data()
    no_labels = check_sensitivity(
        privacy_engine_release(
            _model(),
            lambda m, o, loader: [
                (o.zero_grad(), F.cross_entropy(m(b), (b[:, 0] > 0).long()).backward(), o.step())
                for (b,) in loader
            ],
        ),
        (x,),
    )
    assert no_labels.refusal is not None
    assert "label" in no_labels.refusal
    private, optimizer, loader = _engine_on(TensorDataset(x, y.double()))  # float indices
    for xb, yb in loader:
        optimizer.zero_grad()
        F.cross_entropy(private(xb), yb.long()).backward()
        optimizer.step()
    batches = iter(loader)
    xb, yb = next(batches)
    F.cross_entropy(private(xb), (yb.long() + 1) % 3).backward()
    with pytest.raises(DPVisionError, match="labels"):
        optimizer.step()


def test_a_sign_flipped_by_the_batch_is_refused():
    report = _check(lambda m, x, y: F.cross_entropy(m(x * torch.sign(x.sum())), y))
    assert report.refusal is not None


class ScaledByBatchSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * (12.0 / x.shape[0]) ** 3


def test_an_output_that_depends_on_the_batch_size_is_refused():
    report = check_sensitivity(_mixing_run(ScaledByBatchSize(), 1), _data(), neighbours=2)
    assert report.refusal is not None
    assert "lost one" in report.refusal


def test_a_dataclass_output_is_checked_field_by_field():
    import dataclasses

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        hidden: torch.Tensor

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> Out:
            hidden = torch.tanh(self.body(x))
            return Out(self.head(hidden), hidden)

    report = _check_model(Model(), lambda m, x, y: F.cross_entropy(m(x).logits, y))
    assert report.refusal is None, report.refusal
    assert report.max_ratio <= 1 + TIGHT


@pytest.mark.parametrize("scale", [0.5, 1.0])
@pytest.mark.parametrize("per_example", [False, True])
def test_manual_gradient_accumulation_is_refused_naming_batch_memory_manager(scale, per_example):
    """loss / k with a step every k batches (or unscaled): each refusal it meets, whether
    the loss is a plain mean or the per-example criterion's, names the working way."""
    x, y = _data(100)
    model = _model()
    private, optimizer, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=12),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    criterion = private.per_example_loss(nn.CrossEntropyLoss(reduction="none"))

    def accumulating_loop() -> None:
        for index, (xb, yb) in enumerate(loader):
            output = private(xb)
            loss = criterion(output, yb) if per_example else F.cross_entropy(output, yb)
            (loss * scale).backward()
            if index % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()

    with pytest.raises(DPVisionError, match="BatchMemoryManager") as error:
        accumulating_loop()
    assert "\n" not in str(error.value)
