"""The user's module wrapped with the hooks that per-example clipping needs (Opacus'
``GradSampleModule``)."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.per_example.batch_layout import batch_tensor, check_batch_layout, signature
from dpvision.per_example.bookkeeping import trainable_params
from dpvision.per_example.tape import ActivationTape
from dpvision.training.buffers import BufferWatch


class PrivateModule(nn.Module):
    """The user's module, with the hooks that record what per-example clipping needs.

    ``forward`` is the wrapped module's; the module itself is ``_module`` (as in Opacus'
    ``GradSampleModule``), so its ``state_dict`` keys carry a ``_module.`` prefix.

    Each forward pass in training mode with autograd on is one pass over the examples of
    its first tensor argument (rows first, K consecutive rows per example). The first pass
    of every input shape is probed (:mod:`dpvision.per_example.batch_layout`): a layer that
    does not see one row per example, or an output that mixes examples, is refused there,
    and the coming backward pass checks that every parameter gets its whole gradient
    through its layer. In evaluation mode nothing is recorded and any batch size is fine.

    Privacy:
      A recorded pass must leave the module's buffers as they were: a buffer it writes
      (BatchNorm's running statistics in training mode, an activation observer) would keep
      an exact statistic of the private batch in the ``state_dict`` and in later passes, and
      is refused (:class:`~dpvision.training.buffers.BufferWatch`).
    """

    def __init__(self, module: nn.Module, tape: ActivationTape, views: int) -> None:
        super().__init__()
        self._module = module
        self._tape = tape
        self.views = views
        self._checked: set[Any] = set()
        self._same_examples = False
        self._buffer_watch = BufferWatch(module, what="the module")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the wrapped module; with K views, rows must come in whole examples.

        In evaluation mode (``model.eval()``) or under ``torch.no_grad()`` it is the plain
        module: any batch size, nothing recorded.

        Raises:
          DPVisionError: the batch is not whole examples, a layer does not keep them apart,
            or the pass wrote one of the module's buffers (see the message).
        """
        if not torch.is_grad_enabled() or not self.training:
            with self._tape.paused():
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
        self._buffer_watch.start()  # after the probe, which writes back what it moved
        output = self._module(*args, **kwargs)
        self._buffer_watch.check()
        return output

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
