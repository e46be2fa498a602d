"""An Opacus-style API for your own model and training loop: ``PrivacyEngine.make_private``.

>>> import torch
>>> from torch import nn
>>> from torch.utils.data import DataLoader, TensorDataset
>>> from dpvision import PrivacyEngine
>>> data = TensorDataset(torch.randn(100, 4), torch.randint(0, 3, (100,)))
>>> engine = PrivacyEngine(accountant="pld")
>>> model = nn.Linear(4, 3)
>>> model, optimizer, loader = engine.make_private(
...     module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
...     data_loader=DataLoader(data, batch_size=10), noise_multiplier=1.1, max_grad_norm=1.0,
...     seed=0)
>>> for x, y in loader:
...     optimizer.zero_grad()
...     nn.functional.cross_entropy(model(x), y).backward()
...     optimizer.step()
>>> engine.ledger.total_count  # one Poisson-sampled Gaussian step per logical batch
10
>>> round(engine.get_epsilon(delta=1e-5), 2)
2.35

What happens, in Opacus' terms:

* the **module** is wrapped (:class:`PrivateModule`); forward hooks on its layers record
  the activations and, during ``loss.backward()``, the gradients of the layer outputs (the
  book-keeping of :mod:`dpvision.per_example.bookkeeping`, shared with the DP-SGD engine);
* the **data loader** (:class:`DPDataLoader`) draws Poisson batches of the dataset at rate
  q = batch_size/N, ⌈1/q⌉ of them per epoch, *empty batches included* (as zero-length
  tensors); it can split each batch into physical chunks and make K augmented views of
  each example;
* the **optimizer** (:class:`DPOptimizer`) turns the recorded quantities into per-example
  gradient norms, clips each example's gradient (the mean of its K view-gradients) to C,
  sums, and at the end of each logical batch adds N(0, (σC)²) **once**, divides by the
  public qN, steps the wrapped optimizer, records the step in the engine's
  :class:`~dpvision.accounting.PrivacyLedger` and updates the parameter EMA.

Unlike Opacus, only Poisson sampling is offered (the accountant assumes it), and only
layers that book-keeping supports (``nn.Linear``, ``nn.Conv2d``, ``WSConv2d``, affine
``nn.GroupNorm``) may have trainable parameters. What cannot be clipped per example is
refused with a one-line :class:`~dpvision.errors.DPVisionError`, never clipped per row: a
layer whose rows are not the examples (folded positions, a sequence-first input, examples
mixed before it), two forward passes before one step (unless inside
:meth:`PrivateModule.same_examples`), or a parameter used outside its layer's ``forward``.
A loop that leaves a logical batch after a non-final chunk has that chunk's clipped sum
discarded, never released with the next batch.
"""

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from dpvision.accounting import PrivacyLedger, calibrate_noise_multiplier, parse_accountant
from dpvision.accounting.accountants import Accountant
from dpvision.data.augment import augment_views
from dpvision.errors import DPVisionError
from dpvision.mechanisms import PoissonSampler
from dpvision.models import validate_model
from dpvision.per_example.batch_layout import batch_tensor, check_batch_layout, signature
from dpvision.per_example.bookkeeping import (
    ActivationTape,
    clip_terms,
    trainable_params,
    unclipped_mismatch,
    unsupported_layers,
)
from dpvision.per_example.layers import layer_terms
from dpvision.per_example.reference import ClippedGradientSum
from dpvision.training.engine import GradientRelease, ParameterEMA, noisy_step

LOSS_REDUCTIONS = ("mean", "sum")


class PrivateModule(nn.Module):
    """The user's module, with the hooks that record what per-example clipping needs.

    ``forward`` is the wrapped module's; the module itself is ``_module`` (as in Opacus'
    ``GradSampleModule``), so its ``state_dict`` keys carry a ``_module.`` prefix.

    Each forward pass with autograd on is one pass over the examples of its first tensor
    argument (rows first, K consecutive rows per example). The first pass of every input
    shape is probed (:mod:`dpvision.per_example.batch_layout`): a layer that does not see one
    row per example, or an output that mixes examples, is refused there, and the coming
    backward pass checks that every parameter gets its whole gradient through its layer.
    """

    def __init__(self, module: nn.Module, tape: ActivationTape, views: int) -> None:
        super().__init__()
        self._module = module
        self._tape = tape
        self.views = views
        self._checked: set[Any] = set()
        self._same_examples = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the wrapped module; with K views, rows must come in whole examples."""
        if not torch.is_grad_enabled():  # evaluation: nothing is recorded
            return self._module(*args, **kwargs)
        batch = batch_tensor(args, kwargs)
        if batch is None or batch.dim() == 0:
            raise DPVisionError(
                "the private module needs the examples as a tensor argument, one row each"
            )
        rows = batch.shape[0]
        if rows % self.views:
            raise DPVisionError(
                f"the batch has {rows} rows, not a multiple of augmult K = {self.views}: feed the "
                "batches of the private data loader unchanged"
            )
        self._tape.begin_pass(rows, same_examples=self._same_examples)
        key = signature(self._module, args, kwargs)
        if key not in self._checked and rows >= 2 * self.views:
            check_batch_layout(self._module, self._tape.layers, args, kwargs, views=self.views)
            self._checked.add(key)
            self._tape.capture_parameter_grads(trainable_params(self._module))
        return self._module(*args, **kwargs)

    @contextmanager
    def same_examples(self) -> Iterator[None]:
        """Forward passes in this block are over the same examples as the pass before.

        By default every forward pass is a new set of examples, and two passes before one
        ``optimizer.step()`` are refused (their rows j would be clipped as one example).
        For a second loss on the *same* batch (two views, a consistency term), run the
        extra passes inside this block: each example's gradient is then the sum over the
        passes, clipped once.
        """
        self._same_examples = True
        try:
            yield
        finally:
            self._same_examples = False

    def remove_hooks(self) -> None:
        """Detaches the recording hooks (the module then trains without privacy)."""
        self._tape.detach()


class DPOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: clipped sum, noise once per logical batch, division by qN.

    The wrapped optimizer's ``param_groups``, ``state`` and ``defaults`` are shared, so
    learning-rate schedulers work on this object as on the original.

    Args:
      optimizer: the user's optimizer over the module's parameters.
      module: the (unwrapped) module whose parameters are privatised.
      tape: the hooks recording that module's activations and output gradients.
      noise_multiplier: σ ≥ 0 (0: no noise, and the ledger records a non-private release).
      max_grad_norm: C.
      sample_rate: q, the Poisson rate of the logical batches.
      num_examples: N; the noisy sum is divided by the public qN.
      ledger: where each logical step is recorded.
      generator: the noise generator (None: torch's global generator).
      views: K, consecutive rows per example (1 without augmentation multiplicity).
      loss_reduction: ``"mean"`` or ``"sum"``, how the user's loss reduces over the rows of a
        physical batch (its output gradients are rescaled to per-example gradients).
      normalize_update: also divide by C (jax_privacy's ``rescale_to_unit_norm``).
      ema_decay: decay of a parameter EMA updated after each logical step, or None.

    Privacy:
      Each logical step releases Σᵢ clip(gᵢ, C) + N(0, (σC)² I) over the examples of one
      Poisson batch (gᵢ the mean of example i's K view-gradients, all trainable parameters
      together), L2 sensitivity C under add/remove-one, recorded as one Poisson-sampled
      Gaussian step at rate q. Physical chunks only accumulate the clipped sum; the noise is
      drawn once per logical batch. Division by qN, the optimizer and the EMA are
      post-processing. Non-finite per-example gradients contribute zero.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        module: nn.Module,
        tape: ActivationTape,
        noise_multiplier: float,
        max_grad_norm: float,
        sample_rate: float,
        num_examples: int,
        ledger: PrivacyLedger,
        generator: torch.Generator | None = None,
        views: int = 1,
        loss_reduction: str = "mean",
        normalize_update: bool = False,
        ema_decay: float | None = None,
    ) -> None:
        # Not calling Optimizer.__init__: the state lives in the wrapped optimizer (as Opacus).
        self.original_optimizer = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.module, self.tape, self.ledger, self.generator = module, tape, ledger, generator
        self.max_grad_norm = float(max_grad_norm)
        self.release = GradientRelease(
            noise_multiplier=float(noise_multiplier),
            sample_rate=sample_rate,
            expected_batch_size=sample_rate * num_examples,
            normalize_update=normalize_update,
        )
        self.views, self.loss_reduction = views, loss_reduction
        self.params = trainable_params(module)
        self.ema = None if ema_decay is None else ParameterEMA(module, ema_decay)
        self.summed = ClippedGradientSum.zeros(self.params, l2_sensitivity=self.max_grad_norm)
        self.steps = 0
        self._skip_next = False
        # (logical batch, whether this chunk ends it), announced by the private data loader.
        self._chunk: tuple[int, bool] | None = None
        self._pending: int | None = None  # the logical batch whose clipped sum is held
        self._batches = 0

    @property
    def noise_multiplier(self) -> float:
        """σ (as Opacus' ``DPOptimizer.noise_multiplier``)."""
        return self.release.noise_multiplier

    @property
    def sample_rate(self) -> float:
        """q, the Poisson rate of the logical batches."""
        return self.release.sample_rate

    @property
    def expected_batch_size(self) -> float:
        """qN, the public divisor of the noisy sum."""
        return self.release.expected_batch_size

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Marks the next :meth:`step` as a physical chunk that is not the last of its batch.

        For loops that do their own chunking; the private data loader signals for you.
        """
        self._skip_next = do_skip

    def new_logical_batch(self) -> int:
        """A fresh id for the chunks of one logical batch (used by the data loader)."""
        self._batches += 1
        return self._batches

    def announce_chunk(self, batch: int, last: bool) -> None:
        """The next :meth:`step` is a chunk of logical batch ``batch`` (``last``: its end)."""
        self._chunk = (batch, last)

    def discard_pending(self, batch: int | None = None) -> None:
        """Drops the clipped sum of an unfinished logical batch (``batch``: only that one).

        Nothing of it was released or recorded, so dropping it costs no privacy; mixing it
        into the next batch's release would let its examples count twice.
        """
        if self._pending is None or (batch is not None and self._pending != batch):
            return
        warnings.warn(
            "a logical batch was left before its last physical chunk: its clipped sum was "
            "discarded (nothing of it was released or recorded)",
            stacklevel=3,
        )
        self.summed = ClippedGradientSum.zeros(self.params, l2_sensitivity=self.max_grad_norm)
        self._pending = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' ``.grad`` (the accumulated clipped sum is kept)."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state."""
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the wrapped optimizer's state."""
        self.original_optimizer.load_state_dict(state_dict)

    def _accumulate(self) -> None:
        """Adds the clipped sum of the physical batch the hooks recorded, then forgets it.

        Raises:
          DPVisionError: the recorded pass cannot be clipped per example (see the message).
        """
        tape = self.tape
        try:
            calls = list(tape.calls())
        except DPVisionError as error:
            tape.clear()
            raise DPVisionError(f"PrivacyEngine does not support {error}") from None
        passes, pass_rows = tape.gradient_passes(), list(tape.pass_rows)
        captured = tape.parameter_grads
        tape.clear()
        for param in self.params.values():
            param.grad = None  # the exact gradient of private data never outlives the step
        if len(passes) > 1:
            raise DPVisionError(
                f"{len(passes)} forward passes reached one optimizer.step(), and their rows would "
                "be clipped as the same examples: call optimizer.step() after each backward (the "
                "private data loader's chunks accumulate), or run passes over the same examples "
                "inside `with model.same_examples():`"
            )
        if not passes:
            return
        rows = pass_rows[passes[0]]
        for path, _, pairs in calls:
            for x, g in pairs:
                if x.shape[0] != rows or g.shape[0] != rows:
                    raise DPVisionError(
                        f"PrivacyEngine does not support layer {path or 'the root'} seeing "
                        f"{x.shape[0]} rows in a pass over {rows}: it folds positions into the "
                        "batch or is not batch-first; keep the examples first in every layer "
                        "with trainable parameters"
                    )
        if rows == 0:
            return
        batch = rows // self.views
        terms = [(path, layer_terms(module, pairs, self.views)) for path, module, pairs in calls]
        if captured is not None:
            whole = {name: captured.get(name) for name in self.params}
            reason = unclipped_mismatch(terms, whole, batch)
            if reason is not None:
                raise DPVisionError(f"PrivacyEngine does not support {reason}")
        # Observed output gradients are (1/rows)·Σₖ∇ℓ (mean) or Σₖ∇ℓ (sum); the clipped unit
        # is the view mean (1/K)·Σₖ∇ℓ.
        scale = batch if self.loss_reduction == "mean" else 1.0 / self.views
        clipped = clip_terms(
            terms, self.params, batch, max_grad_norm=self.max_grad_norm, grad_scale=scale
        )
        self.summed.add_(clipped)

    def _release(self) -> None:
        """The one DP-SGD update (:func:`~dpvision.training.engine.noisy_step`) of the
        accumulated clipped sum: noise once, divide by qN (and C), step, record, update
        the EMA."""
        noisy_step(
            self.summed,
            self.params,
            release=self.release,
            optimizer=self.original_optimizer,
            ledger=self.ledger,
            generator=self.generator,
            ema=self.ema,
            keep_grad=True,
        )
        self.summed = ClippedGradientSum.zeros(self.params, l2_sensitivity=self.max_grad_norm)
        self.steps += 1

    def step(self, closure: Any = None) -> Any:
        """Accumulates this physical batch; at the end of a logical batch, takes the step.

        Call it once per batch of the private data loader, *empty batches included*: an
        empty logical batch still gets its noise and its ledger entry.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._chunk is not None:
            batch, last = self._chunk
        else:  # a loop of its own: one logical batch, unless signal_skip_step said otherwise
            batch, last = _MANUAL, not self._skip_next
        self._chunk, self._skip_next = None, False
        if self._pending is not None and self._pending != batch:
            self.discard_pending()
        self._accumulate()
        if not last:
            self._pending = batch
            return loss
        self._pending = None
        self._release()
        return loss


_MANUAL = 0  # the logical-batch id of steps not announced by the private data loader


class _PoissonBatches:
    """A batch sampler: ⌈1/q⌉ Poisson batches of indices per epoch (possibly empty)."""

    def __init__(self, sampler: PoissonSampler, steps_per_epoch: int) -> None:
        self.sampler, self.steps_per_epoch = sampler, steps_per_epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps_per_epoch):
            yield self.sampler.sample().tolist()


def _empty_like(batch: Any) -> Any:
    """The collated structure of one example, with every tensor cut to zero rows."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: _empty_like(v) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(_empty_like(v) for v in batch)
    return batch


class _EmptySafeCollate:
    """Collates like the user's loader, and an empty index list into zero-row tensors."""

    def __init__(self, collate: Any, dataset: Dataset[Any]) -> None:
        self.collate, self.dataset = collate, dataset

    def __call__(self, items: list[Any]) -> Any:
        if items:
            return self.collate(items)
        return _empty_like(self.collate([self.dataset[0]]))  # shapes only


class DPDataLoader:
    """Poisson batches of a dataset, optionally split into physical chunks and augmented.

    ``len()`` is the number of logical batches per epoch, ⌈1/q⌉; iterating yields one or more
    physical chunks per logical batch (one zero-length chunk for an empty batch) and tells
    the optimizer which chunk ends its logical batch.

    Args:
      loader: a ``DataLoader`` whose batch sampler draws the Poisson batches.
      optimizer: the :class:`DPOptimizer` to signal.
      sample_rate: q.
      views: K ≥ 1 rows per example.
      max_physical_batch_size: at most this many examples per chunk (None: no split).
      augment: whether to make K augmented views of each example (random crop after 4-pixel
        reflect padding, horizontal flip); needs (images, labels, ...) batches of float
        (B, C, H, W) images.
      generator: randomness of the augmentation.

    Privacy:
      The batches are Poisson samples at rate q, as the accountant assumes; chunking and
      augmentation act on one example at a time and change neither the sampling nor the
      sensitivity.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        optimizer: DPOptimizer,
        *,
        sample_rate: float,
        views: int = 1,
        max_physical_batch_size: int | None = None,
        augment: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        self.loader, self.optimizer, self.sample_rate = loader, optimizer, sample_rate
        self.views, self.max_physical_batch_size = views, max_physical_batch_size
        self.augment = augment
        self.generator = generator if generator is not None else torch.Generator()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        optimizer = self.optimizer
        for batch in self.loader:
            chunks = self._chunks(batch)
            logical = optimizer.new_logical_batch()
            try:
                for index, chunk in enumerate(chunks):
                    optimizer.announce_chunk(logical, index == len(chunks) - 1)
                    yield self._views(chunk)
            finally:  # a loop that leaves mid-batch must not leak its chunks into the next
                optimizer.discard_pending(logical)

    def _chunks(self, batch: Any) -> list[Any]:
        limit = self.max_physical_batch_size
        if limit is None:
            return [batch]
        tensors = _fields(batch)
        size = tensors[0].shape[0]
        if size <= limit:
            return [batch]
        return [
            type(batch)(t[start : start + limit] for t in tensors)
            for start in range(0, size, limit)
        ]

    def _views(self, batch: Any) -> Any:
        if not self.augment:
            return batch

        images, *rest = _fields(batch)
        if images.dim() != 4 or not images.is_floating_point():
            raise DPVisionError(
                "augmult needs batches of float images (B, C, H, W), got "
                f"{images.dtype} {tuple(images.shape)}"
            )
        if images.shape[0] == 0:
            views = images
        else:
            views = augment_views(images, self.views, self.generator, padding=4, flip=True)
            views = views.flatten(0, 1)
        return type(batch)([views, *(t.repeat_interleave(self.views, 0) for t in rest)])


def _fields(batch: Any) -> list[torch.Tensor]:
    if not (isinstance(batch, tuple | list) and all(isinstance(t, torch.Tensor) for t in batch)):
        raise DPVisionError(
            "max_physical_batch_size and augmult need batches that are tuples of tensors "
            "(inputs, targets, ...)"
        )
    return list(batch)


def _sample_rate(data_loader: DataLoader[Any]) -> tuple[float, int]:
    """q = batch_size/N and N, from the user's loader."""
    batch_size = data_loader.batch_size
    try:
        num_examples = len(data_loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        raise DPVisionError("the data loader's dataset must have a length") from None
    if batch_size is None or num_examples < 1:
        raise DPVisionError(
            "the data loader needs a batch_size (not a batch_sampler) and a non-empty dataset"
        )
    if batch_size > num_examples:
        raise DPVisionError(f"batch_size {batch_size} exceeds the {num_examples} examples")
    return batch_size / num_examples, num_examples


class PrivacyEngine:
    """Makes a model, its optimizer and its data loader differentially private (DP-SGD).

    Args:
      accountant: the accountant that calibrates σ and reports ε: ``pld`` (default),
        ``rdp`` or ``classic-rdp``.

    Attributes:
      ledger: every noisy release made through this engine, the only input to ε.
    """

    def __init__(self, accountant: str = "pld") -> None:
        self.accountant = parse_accountant(accountant)
        if self.accountant is Accountant.GAUSSIAN:
            raise DPVisionError("the gaussian accountant cannot account for Poisson sampling")
        self.ledger = PrivacyLedger()
        self.optimizer: DPOptimizer | None = None

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader[Any],
        noise_multiplier: float,
        max_grad_norm: float,
        poisson_sampling: bool = True,
        augmult: int = 0,
        ema_decay: float | None = None,
        normalize_update: bool = False,
        loss_reduction: str = "mean",
        max_physical_batch_size: int | None = None,
        noise_generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> tuple[PrivateModule, DPOptimizer, DPDataLoader]:
        """Returns the private (module, optimizer, data loader) triple.

        Args:
          module: the model; no BatchNorm, and trainable parameters only in layers
            book-keeping supports.
          optimizer: any torch optimizer over (some of) ``module``'s parameters.
          data_loader: a ``DataLoader`` with a ``batch_size``; q = batch_size/len(dataset).
          noise_multiplier: σ ≥ 0.
          max_grad_norm: C > 0.
          poisson_sampling: must be True (fixed-size shuffled batches are not offered: the
            accountant assumes Poisson sampling).
          augmult: K augmented views (random crop after 4-pixel reflect padding, horizontal
            flip) per example; 0 for none.
          ema_decay: decay of a parameter EMA (``optimizer.ema``), or None.
          normalize_update: divide the noisy sum by C as well.
          loss_reduction: how the loss reduces over a batch's rows: ``mean`` or ``sum``.
          max_physical_batch_size: split each logical batch into chunks of at most this many
            examples (memory only: noise is still added once per logical batch).
          noise_generator: source of the noise (None: a generator seeded from ``seed``).
          seed: seeds the sampling, the augmentation and the noise (None: fresh entropy).

        Raises:
          DPVisionError: a BatchNorm or unsupported layer, a bad argument, or an optimizer
            with parameters that are not ``module``'s.

        Privacy:
          Each logical step releases the noisy clipped sum of one Poisson batch (see
          :class:`DPOptimizer`) and records it in :attr:`ledger`.
        """
        validate_model(module)
        problems = unsupported_layers(module)
        if problems:
            raise DPVisionError(f"make_private does not support {problems[0]}")
        if not poisson_sampling:
            raise DPVisionError(
                "poisson_sampling=False is not offered: the privacy accounting assumes Poisson "
                "sampling, which the private data loader provides"
            )
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise DPVisionError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise DPVisionError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise DPVisionError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if isinstance(augmult, bool) or not isinstance(augmult, int) or augmult < 0:
            raise DPVisionError(f"augmult must be an integer >= 0, got {augmult!r}")
        if ema_decay is not None and not 0 <= ema_decay < 1:
            raise DPVisionError(f"ema_decay must be in [0, 1) or None, got {ema_decay}")
        if max_physical_batch_size is not None and max_physical_batch_size < 1:
            raise DPVisionError(
                f"max_physical_batch_size must be >= 1, got {max_physical_batch_size}"
            )
        trainable = {id(p) for p in module.parameters() if p.requires_grad}
        if any(id(p) not in trainable for g in optimizer.param_groups for p in g["params"]):
            raise DPVisionError(
                "the optimizer holds parameters that are not trainable parameters of the module; "
                "they would be updated without privacy"
            )
        sample_rate, num_examples = _sample_rate(data_loader)
        sampling_seed, augment_seed, noise_seed = (
            int(s.generate_state(1, np.uint64)[0] >> np.uint64(1))
            for s in np.random.SeedSequence(seed).spawn(3)
        )
        if noise_generator is None:
            device = next(p.device for p in module.parameters() if p.requires_grad)
            noise_generator = torch.Generator(device=device).manual_seed(noise_seed)
        views = max(augmult, 1)
        tape = ActivationTape(module, mode="hooks")
        tape.attach()
        dp_optimizer = DPOptimizer(
            optimizer,
            module=module,
            tape=tape,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            sample_rate=sample_rate,
            num_examples=num_examples,
            ledger=self.ledger,
            generator=noise_generator,
            views=views,
            loss_reduction=loss_reduction,
            normalize_update=normalize_update,
            ema_decay=ema_decay,
        )
        sampler = PoissonSampler(
            num_examples=num_examples, sample_rate=sample_rate, steps=1, seed=sampling_seed
        )
        poisson_loader = DataLoader(
            data_loader.dataset,
            batch_sampler=_PoissonBatches(sampler, math.ceil(1 / sample_rate)),
            collate_fn=_EmptySafeCollate(
                data_loader.collate_fn or default_collate, data_loader.dataset
            ),
            num_workers=data_loader.num_workers,
            pin_memory=data_loader.pin_memory,
        )
        private_loader = DPDataLoader(
            poisson_loader,
            dp_optimizer,
            sample_rate=sample_rate,
            views=views,
            max_physical_batch_size=max_physical_batch_size,
            augment=augmult > 0,
            generator=torch.Generator().manual_seed(augment_seed),
        )
        self.optimizer = dp_optimizer
        return PrivateModule(module, tape, views), dp_optimizer, private_loader

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader[Any],
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: float,
        **options: Any,
    ) -> tuple[PrivateModule, DPOptimizer, DPDataLoader]:
        """Like :meth:`make_private`, with σ calibrated to (target_epsilon, target_delta).

        σ is the smallest noise (within 0.1 %) for which ``epochs`` · ⌈1/q⌉ Poisson steps at
        rate q = batch_size/N, composed after whatever this engine's ledger already holds,
        are (ε, δ)-DP by the engine's accountant. Train exactly ``epochs`` epochs of the
        returned loader to stay within the target.

        Privacy:
          As :meth:`make_private`; the calibration itself uses only public quantities.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise DPVisionError(f"epochs must be a positive integer, got {epochs!r}")
        sample_rate, _ = _sample_rate(data_loader)
        sigma = calibrate_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            steps=epochs * math.ceil(1 / sample_rate),
            accountant=self.accountant,
            preceding_event=self.ledger.dp_event() if len(self.ledger) else None,
        )
        return self.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=sigma,
            max_grad_norm=max_grad_norm,
            **options,
        )

    def get_epsilon(self, delta: float) -> float:
        """ε at ``delta`` of everything this engine released, by its accountant."""
        return self.ledger.epsilon(delta, accountant=self.accountant)
