"""Neighbouring-dataset checks of dpvision's releases, for your tests and ours.

:func:`check_sensitivity` runs a real release path twice with the noise off, on a dataset D
and on D′ = D plus one example of huge norm inserted at a random position, watches every
release the run makes (:func:`dpvision.mechanisms.observing_releases`), and reports how far
each one moved relative to the sensitivity it states. A correct release path moves at most
its sensitivity; a bug that lets one example count twice, or count unclipped, shows up as a
ratio above 1.

Iterative methods release many times, and each release depends on the ones before. On D′
every release is therefore computed from *D's* released history (the observer hands D's
values back in place of D′'s), which is exactly what the adaptive composition behind the
accounting assumes: each step's sensitivity holds given everything released before it.

>>> import torch
>>> from dpvision.learners import DPLeastSquares
>>> X, y = torch.randn(40, 5, dtype=torch.float64).numpy(), torch.arange(40).numpy() % 3
>>> report = check_sensitivity(DPLeastSquares(num_classes=3), (X, y), seed=0)
>>> report.ok, [m.released for m in report.worst_per_release()]
(True, ['DP-LS G', 'DP-LS b_j', 'DP-LS A_j'])
>>> round(report.max_ratio, 9)  # one huge example moves each release by exactly C² or C
1.0

The same works for a model trained by the DP-SGD engine (:func:`dpsgd_release`), for your
own training loop under :class:`~dpvision.privacy_engine.PrivacyEngine`
(:func:`privacy_engine_release`), and for any function that makes releases.
"""

import copy
import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sklearn.base import clone
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpvision.accounting import PrivacyLedger
from dpvision.errors import DPVisionError
from dpvision.learners.base import DPLinearClassifier
from dpvision.mechanisms import Release, observing_releases
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.privacy_engine import PrivacyEngine
from dpvision.training.engine import DPSGDStep

Data = tuple[Any, ...]
Run = Callable[[Data], object]


@dataclass(frozen=True)
class Movement:
    """How far one release moved between D and one neighbour D′.

    Attributes:
      released: the release's name, as in the ledger.
      index: its position among the run's releases (0 for the first).
      position: where the added example was inserted in D′.
      movement: ‖release(D′) − release(D)‖₂ over all its parts.
      sensitivity: the L2 sensitivity the release states.
    """

    released: str
    index: int
    position: int
    movement: float
    sensitivity: float

    @property
    def ratio(self) -> float:
        """movement / sensitivity (at most 1 for a correct release)."""
        return self.movement / self.sensitivity


@dataclass(frozen=True)
class SensitivityReport:
    """What :func:`check_sensitivity` measured.

    Attributes:
      movements: one per release and neighbour.
      refusal: the one-line error of a run that refused (then ``movements`` is empty).
      tolerance: the relative slack allowed for floating-point rounding.
      problems: release sequences that differed between D and D′ (names, shapes or count).
    """

    movements: tuple[Movement, ...] = ()
    refusal: str | None = None
    tolerance: float = 1e-6
    problems: tuple[str, ...] = field(default=())

    @property
    def max_ratio(self) -> float:
        """The largest movement / sensitivity (0 when nothing was released)."""
        return max((m.ratio for m in self.movements), default=0.0)

    @property
    def ok(self) -> bool:
        """Whether every release moved by at most its sensitivity (1 + tolerance)."""
        return not self.problems and self.max_ratio <= 1 + self.tolerance

    def worst_per_release(self) -> list[Movement]:
        """The largest movement of each release, in the order the run made them."""
        worst: dict[int, Movement] = {}
        for m in self.movements:
            if m.index not in worst or m.ratio > worst[m.index].ratio:
                worst[m.index] = m
        return [worst[i] for i in sorted(worst)]

    def summary(self) -> str:
        """One line: refusal, problems, or the worst movement."""
        if self.refusal is not None:
            return f"refused: {self.refusal}"
        if self.problems:
            return f"releases differ between neighbours: {self.problems[0]}"
        if not self.movements:
            return "no release was made"
        m = max(self.movements, key=lambda m: m.ratio)
        return (
            f"worst: {m.released!r} (release {m.index}) moved {m.movement:.6g} with the example "
            f"added at position {m.position}, {m.ratio:.6g} x its sensitivity {m.sensitivity:g}"
        )


@contextmanager
def record_releases(replay: Sequence[Release] | None = None) -> Iterator[list[Release]]:
    """Collects every release made in the block, before its noise.

    Args:
      replay: releases of another run; the i-th release made in the block is then given
        the value of ``replay[i]`` in place of its own (its own value is still recorded).
    """
    seen: list[Release] = []

    def observer(release: Release) -> torch.Tensor:
        index = len(seen)
        seen.append(release)
        if replay is None:
            return release.value.clone()
        if index >= len(replay):
            raise _SequenceError(f"release {index} ({release.released!r}) was not made on D")
        reference = replay[index]
        if (reference.released, reference.value.shape, reference.part) != (
            release.released,
            release.value.shape,
            release.part,
        ):
            raise _SequenceError(
                f"release {index} is {release.released!r} {tuple(release.value.shape)} on D′ "
                f"but {reference.released!r} {tuple(reference.value.shape)} on D"
            )
        return reference.value.clone().to(release.value.device)

    with observing_releases(observer):
        yield seen


class _SequenceError(Exception):
    """The neighbour's run made other releases than the original's."""


def _grouped(releases: Sequence[Release]) -> list[tuple[str, float, list[torch.Tensor]]]:
    """(name, sensitivity, parts) of each whole release."""
    out: list[tuple[str, float, list[torch.Tensor]]] = []
    for release in releases:
        if release.part and out:
            out[-1][2].append(release.value)
        else:
            out.append((release.released, release.l2_sensitivity, [release.value]))
    return out


def _insert(data: Data, example: Data, position: int) -> Data:
    out = []
    for column, value in zip(data, example, strict=True):
        if isinstance(column, torch.Tensor):
            value = torch.as_tensor(value, dtype=column.dtype, device=column.device)
            out.append(torch.cat([column[:position], value[None], column[position:]]))
        else:
            column = np.asarray(column)
            value = np.asarray(value, dtype=column.dtype)
            out.append(np.concatenate([column[:position], value[None], column[position:]]))
    return tuple(out)


def huge_example(data: Data, rng: np.random.Generator, scale: float = 1e4) -> Data:
    """An example shaped like D's: floating fields random of norm ``scale``, others copied.

    Integer fields (labels) take the value of a random existing example, so the added
    example stays in the label set.
    """
    n = len(data[0])
    source = int(rng.integers(n))
    example = []
    for column in data:
        row = column[source]
        is_float = (
            row.is_floating_point()
            if isinstance(row, torch.Tensor)
            else np.issubdtype(np.asarray(row).dtype, np.floating)
        )
        if not is_float:
            example.append(row.clone() if isinstance(row, torch.Tensor) else np.copy(row))
            continue
        shape = tuple(row.shape)
        direction = rng.standard_normal(shape)
        direction *= scale / max(float(np.linalg.norm(direction)), 1e-300)
        example.append(direction)
    return tuple(example)


def check_sensitivity(
    release: Run | nn.Module | Any,
    data: Data,
    *,
    neighbours: int = 4,
    scale: float = 1e4,
    positions: Sequence[int] | None = None,
    outlier: Callable[[Data, np.random.Generator], Data] | None = None,
    seed: int = 0,
    tolerance: float = 1e-6,
    **options: Any,
) -> SensitivityReport:
    """Measures how far one added example of huge norm moves each release of a run.

    Args:
      release: what to check, run with the noise off: a function ``run(data)`` that makes
        releases through dpvision's mechanisms; a torch model (one DP-SGD engine step, see
        :func:`dpsgd_release`, which takes ``options``); or a dpvision feature learner
        (``fit`` with the noise off, see :func:`learner_release`).
      data: a tuple of equal-length arrays or tensors, examples along the first axis
        (for example ``(inputs, labels)``).
      neighbours: how many neighbours D′ to try.
      scale: the norm of the added example's floating fields.
      positions: where to insert the example in each D′ (default: once at the end, which
        keeps Poisson sampling coupled, then random positions).
      outlier: ``outlier(data, rng)`` builds the added example (default :func:`huge_example`).
      seed: seeds the positions and the added examples.
      tolerance: relative slack for rounding (use float64 data and models for 1e-6).
      **options: passed to :func:`dpsgd_release` when ``release`` is a model.

    Returns:
      A :class:`SensitivityReport`; its ``ok`` says whether every release moved by at most
      its stated sensitivity. A run that raises :class:`~dpvision.errors.DPVisionError` is
      reported as a refusal (``report.refusal``), which is also a correct outcome.

    Privacy:
      A testing tool: it handles the data in the clear and must never run on a release
      path. It only observes (and, on D′, replays) what the mechanisms are about to noise.
    """
    run = _as_run(release, options)
    rng = np.random.default_rng(seed)
    n = len(data[0])
    if positions is None:
        positions = [n, *rng.integers(0, n + 1, size=max(0, neighbours - 1)).tolist()]
    make = outlier or (lambda d, r: huge_example(d, r, scale))
    try:
        with record_releases() as original:
            run(data)
    except DPVisionError as error:
        return SensitivityReport(refusal=str(error), tolerance=tolerance)
    reference = _grouped(original)
    movements: list[Movement] = []
    problems: list[str] = []
    for position in positions:
        neighbour = _insert(data, make(data, rng), int(position))
        try:
            with record_releases(replay=original) as seen:
                run(neighbour)
        except DPVisionError as error:
            return SensitivityReport(refusal=str(error), tolerance=tolerance)
        except _SequenceError as error:
            problems.append(str(error))
            continue
        moved = _grouped(seen)
        if len(moved) != len(reference):
            problems.append(f"{len(moved)} releases on D′, {len(reference)} on D")
            continue
        for index, ((name, bound, before), (_, _, after)) in enumerate(
            zip(reference, moved, strict=True)
        ):
            squared = sum(
                float((b.to(torch.float64) - a.to(torch.float64).to(b.device)).pow(2).sum())
                for a, b in zip(before, after, strict=True)
            )
            movements.append(Movement(name, index, int(position), math.sqrt(squared), bound))
    return SensitivityReport(tuple(movements), None, tolerance, tuple(problems))


def _as_run(release: Any, options: dict[str, Any]) -> Run:
    if isinstance(release, nn.Module):
        return dpsgd_release(release, **options)
    if options:
        raise TypeError(f"options {sorted(options)} only apply when checking a model")

    if isinstance(release, DPLinearClassifier):
        return learner_release(release)
    if not callable(release):
        raise TypeError(f"cannot check {type(release).__name__}: give a function, model or learner")
    return release  # type: ignore[no-any-return]


def learner_release(learner: Any) -> Run:
    """``run(data)`` fitting a copy of a feature learner on ``(X, y)`` with the noise off."""

    def run(data: Data) -> None:
        model = clone(learner).set_params(noise_multiplier=0, target_epsilon=None)
        model.fit(*data)

    return run


def dpsgd_release(
    model: nn.Module,
    *,
    max_grad_norm: float = 1.0,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    grad_sample_mode: str = "auto",
    views: bool = False,
    physical_batch_size: int | None = None,
    steps: int = 1,
    workers: Any = None,
    precision: torch.dtype | None = None,
    clipping: str = "flat",
    **policy_options: float,
) -> Run:
    """``run((inputs, targets))``: DP-SGD engine steps on a copy of ``model``, noise off
    (forward and backward under autocast to ``precision`` when given; clipped by the clip
    policy ``clipping`` names — ``flat``, ``per_layer``, ``adaptive`` — with
    ``policy_options`` as in :func:`~dpvision.mechanisms.clip_policy.make_clip_policy`;
    per-example gradients computed as ``grad_sample_mode`` says: ``auto``,
    ``bookkeeping`` or ``vmap``).

    Every step uses the whole dataset as its batch (q = 1), split into physical batches of
    ``physical_batch_size`` examples; the copy's parameters do not move (learning rate 0),
    so each step releases the clipped gradient sum at the same parameters. Under
    ``torchrun``, pass ``workers`` (:func:`dpvision.distributed.current`): each rank clips
    its contiguous share of the batch and the sums are all-reduced before the release, as in
    ``dpvision train``.
    """
    loss = loss_fn or (lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"))

    def run(data: Data) -> None:
        inputs, targets = (torch.as_tensor(d) for d in data[:2])
        if workers is not None:  # this rank's share of the logical batch
            start, stop = workers.row_range(len(inputs))
            inputs, targets = inputs[start:stop], targets[start:stop]
        copy_ = copy.deepcopy(model)
        params = [p for p in copy_.parameters() if p.requires_grad]
        step = DPSGDStep.build(
            copy_,
            torch.optim.SGD(params, lr=0.0),
            loss,
            noise_multiplier=0.0,
            max_grad_norm=max_grad_norm,
            sample_rate=1.0,
            num_examples=len(inputs),
            ledger=PrivacyLedger(),
            generator=torch.Generator(),
            clipping=clipping,
            views=views,
            method=grad_sample_mode,
            workers=workers,
            precision=precision,
            **policy_options,
        )
        size = physical_batch_size or max(1, len(inputs))
        for _ in range(steps):
            step((inputs[i : i + size], targets[i : i + size]) for i in range(0, len(inputs), size))

    return run


def privacy_engine_release(
    model: nn.Module,
    loop: Callable[[nn.Module, torch.optim.Optimizer, Any], None],
    *,
    max_grad_norm: float = 1.0,
    **make_private: Any,
) -> Run:
    """``run(data)``: your training ``loop`` under :class:`PrivacyEngine`, noise off.

    ``loop(private_model, optimizer, loader)`` is called once on a copy of ``model`` with a
    loader whose every logical batch is the whole dataset (q = 1); the optimizer has
    learning rate 0, so each step releases the clipped gradient sum at the same parameters.
    ``make_private`` takes :meth:`PrivacyEngine.make_private`'s other options
    (``max_physical_batch_size``, ``augmult``, ``loss_reduction``, ...).
    """

    def run(data: Data) -> None:
        tensors = [torch.as_tensor(d) for d in data]
        dataset = TensorDataset(*tensors)
        copy_ = copy.deepcopy(model)
        params = [p for p in copy_.parameters() if p.requires_grad]
        private, optimizer, loader = PrivacyEngine().make_private(
            module=copy_,
            optimizer=torch.optim.SGD(params, lr=0.0),
            data_loader=DataLoader(dataset, batch_size=len(dataset)),
            noise_multiplier=0.0,
            max_grad_norm=max_grad_norm,
            seed=0,
            secret_seed=0,  # D and D′ draw the same batches (a testing tool, noise off)
            **make_private,
        )
        loop(private, optimizer, loader)

    return run


@dataclass(frozen=True)
class Outcome:
    """What a run did: ``ran``, or ``refused`` with its one-line ``message``."""

    refused: bool
    message: str | None = None

    def __str__(self) -> str:
        return f"refused: {self.message}" if self.refused else "ran"


def run_outcome(run: Callable[[], object]) -> Outcome:
    """Runs ``run()`` and says whether it ran or refused (a
    :class:`~dpvision.errors.DPVisionError`, or a command's exit code 2, with the error's
    text or the stderr line the caller captured in the exception)."""
    try:
        result = run()
    except DPVisionError as error:
        return Outcome(True, str(error))
    if isinstance(result, int) and not isinstance(result, bool) and result == 2:
        return Outcome(True, None)  # a command that printed its one line and exited 2
    return Outcome(False)


def assert_same_outcome(run: Run, data: Data, neighbours: Sequence[Data]) -> Outcome:
    """Asserts that D (``data``) and every neighbour D′ (one example added or removed) give
    the same outcome: both run, or both refuse with the same message; returns D's.

    The rule this checks (docs/guarantees.md, "No decision on private rows"): a check that
    reads private rows may change *which rows* a mechanism sees, in a neighbour-stable way,
    but never whether the run refuses, warns or logs, nor what it says: a refusal that only
    one of D and D′ gives tells an adversary which of them the data is, exactly.

    >>> assert_same_outcome(lambda d: sum(d[0]), ([1, 2],), [([1, 2, 3],)])
    Outcome(refused=False, message=None)

    Privacy:
      A testing tool: it handles the data in the clear and must never run on a release
      path.
    """
    outcome = run_outcome(functools.partial(run, data))
    for index, neighbour in enumerate(neighbours):
        other = run_outcome(functools.partial(run, neighbour))
        if other != outcome:
            raise AssertionError(
                f"D and neighbour {index} differ: D {outcome}; D′ {other}: the outcome "
                "depends on the private rows"
            )
    return outcome


_COUPLING = threading.RLock()


@contextmanager
def coupled_coins() -> Iterator[None]:
    """Within it, a replayable run's coins (Poisson sampling, ``tune``'s K and draws) do not
    depend on its rows: D and D′ under one ``secret_seed`` draw the same coins for the rows
    they share, which is what a neighbouring-dataset test with the noise off compares
    (:func:`check_sensitivity` through ``dpvision.train``). Outside it, the rows key the
    coins as they key the noise (:meth:`~dpvision.mechanisms.secret.SecretRandomness.bind_rows`).

    Privacy:
      A testing tool: never around a run whose output is published (two published runs on
      neighbouring data with shared coins compose worse than independent ones).
    """
    with _COUPLING:  # threads' blocks never interleave, so the class is always restored
        bound = SecretRandomness.coin_key
        SecretRandomness.coin_key = SecretRandomness.unbound_coin_key  # type: ignore[method-assign]
        try:
            yield
        finally:
            SecretRandomness.coin_key = bound  # type: ignore[method-assign]
