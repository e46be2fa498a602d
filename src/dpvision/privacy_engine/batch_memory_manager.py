"""``BatchMemoryManager``: Opacus' context for physical batches, over :class:`DPDataLoader`.

>>> # with BatchMemoryManager(data_loader=loader, max_physical_batch_size=32,
>>> #                         optimizer=optimizer) as chunks:
>>> #     for x, y in chunks: ...  # as in Opacus: step after every chunk
"""

import copy
from types import TracebackType

from dpvision.errors import DPVisionError
from dpvision.privacy_engine.data_loader import DPDataLoader
from dpvision.privacy_engine.optimizer import DPOptimizer


class BatchMemoryManager:
    """Splits each logical batch of a private data loader into chunks of at most
    ``max_physical_batch_size`` examples, for the ``with`` block.

    As in Opacus, call ``optimizer.step()`` after every chunk: the optimizer accumulates
    the clipped sums and takes the noisy step once, at the last chunk of each logical batch.
    It is the same as ``make_private(..., max_physical_batch_size=n)``.

    Privacy:
      Chunking changes neither the sampling nor the noise (one release per logical batch).
    """

    def __init__(
        self, *, data_loader: DPDataLoader, max_physical_batch_size: int, optimizer: DPOptimizer
    ) -> None:
        if not isinstance(data_loader, DPDataLoader):
            raise DPVisionError("BatchMemoryManager needs the data loader make_private returned")
        if optimizer is not data_loader.optimizer:
            raise DPVisionError(
                "BatchMemoryManager needs the optimizer make_private returned with this loader"
            )
        if (
            isinstance(max_physical_batch_size, bool)
            or not isinstance(max_physical_batch_size, int)
            or max_physical_batch_size < 1
        ):
            raise DPVisionError(
                f"max_physical_batch_size must be a positive integer, got "
                f"{max_physical_batch_size!r}"
            )
        self.data_loader, self.optimizer = data_loader, optimizer
        self.max_physical_batch_size = max_physical_batch_size

    def __enter__(self) -> DPDataLoader:
        chunked = copy.copy(self.data_loader)
        chunked.max_physical_batch_size = self.max_physical_batch_size
        return chunked

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None
