"""Poisson batches of the user's dataset, cut into physical chunks and augmented."""

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from dpvision.data.augment import apply_views, keyed_views
from dpvision.data.splits import row_digests
from dpvision.errors import DPVisionError
from dpvision.mechanisms import PoissonSampler
from dpvision.privacy_engine.optimizer import DPOptimizer


class PoissonBatches:
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


class EmptySafeCollate:
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

    A loop that leaves a pass (``break``, ``return``, an error, ``next(iter(loader))``)
    before the release of its logical batch gets that batch again, whole, as the first of
    its next pass (the partial sum of the chunks it stepped on was discarded): leaving then
    starting over cannot skip a batch. Leaving the same batch twice before a step on any
    of its chunks is refused at the next pass: the loop is skipping it (or would stall).

    Privacy:
      The batches are Poisson samples at rate q, as the accountant assumes, and each is
      released once, in the order drawn, up to where the loop stops: which batches are
      released never depends on their rows (a skip, by ``continue`` or by leaving and
      starting over, is refused). Chunking and augmentation act on one example at a time
      and change neither the sampling nor the sensitivity. Each chunk is announced to the
      optimizer with its rows, and a step on anything else is refused (:class:`DPOptimizer`).
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
        self._step = 0  # logical batches so far: with the seed, keys each example's views
        # The batch a loop left: (batch, its step, times left untouched, its id). A list, so
        # that the copies BatchMemoryManager makes share it.
        self._left: list[tuple[Any, int, int, int]] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        optimizer = self.optimizer
        for batch, step, times_left in self._logical_batches():
            chunks = self._chunks(batch)
            logical = optimizer.new_logical_batch()
            try:
                for index, chunk in enumerate(chunks):
                    views = self._views(chunk, step)
                    optimizer.announce_chunk(logical, index == len(chunks) - 1, views)
                    yield views
            except GeneratorExit:  # the loop left (break, return, an error): its choice,
                optimizer.leave(logical)  # but the batch comes first in its next pass
                # (unless released); the count is of the times it was left untouched.
                untouched = 0 if optimizer.holds(logical) else times_left + 1
                self._left[:] = [(batch, step, untouched, logical)]
                raise
            finally:  # a loop that leaves mid-batch must not leak its chunks into the next
                optimizer.discard_pending(logical)
        optimizer.check_stepped()  # the last batch too was stepped on

    def _logical_batches(self) -> Iterator[tuple[Any, int, int]]:
        """One pass: ⌈1/q⌉ logical batches as (batch, step, times it was left untouched),
        the batch a loop left before its release first, then fresh Poisson batches.

        Raises:
          DPVisionError: the batch to resume was left twice untouched (the loop skips it).

        Privacy:
          Releases nothing. Every batch drawn is yielded until the loop steps on it (or
          stops), so which batches reach a release does not depend on their rows; the left
          batch is held in memory, as private as the dataset.
        """
        remaining = len(self.loader)
        if self._left:
            batch, step, times_left, logical = self._left[0]
            if self.optimizer.released(logical):  # stepped on after the loop left
                self._left.clear()
            elif times_left > 1:
                raise DPVisionError(LEFT_AGAIN)
            else:
                self._left.clear()
                yield batch, step, times_left
                remaining -= 1
        if remaining <= 0:
            return
        for batch in self.loader:
            self._step += 1
            yield batch, self._step, 0
            remaining -= 1
            if remaining == 0:
                return

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

    def _views(self, batch: Any, step: int) -> Any:
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
            # Each example's views from (the public seed, the step, its own bytes) alone:
            # another example in the batch or the dataset changes no example's views.
            labels = rest[0] if rest else torch.zeros(len(images), dtype=torch.long)
            keys = row_digests(
                images.detach().cpu().numpy(),
                labels.detach().cpu().numpy().reshape(len(images), -1)[:, 0],
                key=_VIEW_KEY,
            )
            draws = keyed_views(
                keys, self.generator.initial_seed(), step, self.views, padding=4, flip=True
            )
            views = apply_views(images, draws, padding=4).flatten(0, 1)
        return type(batch)([views, *(t.repeat_interleave(self.views, 0) for t in rest)])


_VIEW_KEY = b"dpvision augmentation views v1"  # public: views are public randomness
LEFT_AGAIN = (
    "a batch of the private data loader was left twice before any optimizer.step() on it (a "
    "`break` before the step, then a new pass, which starts with the batch left): a loop "
    "that leaves the batches it does not like would skip them, and which batches are "
    "released would depend on the data; step on every batch, empty ones included, and "
    "leave the loader only to stop"
)


def _fields(batch: Any) -> list[torch.Tensor]:
    if not (isinstance(batch, tuple | list) and all(isinstance(t, torch.Tensor) for t in batch)):
        raise DPVisionError(
            "max_physical_batch_size and augmult need batches that are tuples of tensors "
            "(inputs, targets, ...)"
        )
    return list(batch)


def loader_sample_rate(data_loader: DataLoader[Any]) -> tuple[float, int]:
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


def private_data_loader(
    data_loader: DataLoader[Any],
    optimizer: DPOptimizer,
    sampler_key: bytes,
    *,
    secure: bool,
    views: int,
    max_physical_batch_size: int | None,
    augment_seed: int | None,
) -> DPDataLoader:
    """The private data loader: Poisson batches drawn from the secret ``sampler_key``
    (or the operating system's CSPRNG when ``secure``), split into physical chunks, K views
    each.

    Privacy:
      The batches are Poisson samples at the loader's rate q from randomness the
      adversary cannot replay; ``augment_seed`` (public) draws only the views.
    """
    sample_rate, num_examples = loader_sample_rate(data_loader)
    sampler = PoissonSampler(
        num_examples=num_examples,
        sample_rate=sample_rate,
        steps=1,
        seed=int.from_bytes(sampler_key, "little"),
        secure=secure,
    )
    poisson_loader = DataLoader(
        data_loader.dataset,
        batch_sampler=PoissonBatches(sampler, math.ceil(1 / sample_rate)),
        collate_fn=EmptySafeCollate(data_loader.collate_fn or default_collate, data_loader.dataset),
        num_workers=data_loader.num_workers,
        pin_memory=data_loader.pin_memory,
    )
    return DPDataLoader(
        poisson_loader,
        optimizer,
        sample_rate=sample_rate,
        views=views,
        max_physical_batch_size=max_physical_batch_size,
        augment=augment_seed is not None,
        generator=torch.Generator().manual_seed(augment_seed or 0),
    )
