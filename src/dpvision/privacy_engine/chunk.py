"""What the private data loader yielded for one step, to check the step against: the same
rows, the model's input among its fields, the loss's labels among its labels."""

from dataclasses import dataclass
from typing import Any

import torch

from dpvision.errors import DPVisionError
from dpvision.per_example.layers.base import output_tensors
from dpvision.privacy_engine.loss import row_sizes


@dataclass
class Chunk:
    """What the private data loader yielded for one step, to check the step against.

    Attributes:
      batch: the logical batch's id; last: whether the chunk ends it.
      rows: its rows (examples × K views).
      fields: the sizes of each row of each of its tensors with one row per example, in
        float64 (:func:`~dpvision.privacy_engine.loss.row_sizes`; the model's input must be
        one of them, up to a cast).
      labels: each field that is one label per row: integers, or one-hot rows (as indices).
      left: whether the loop left the loader (``break``) before stepping on it.
    """

    batch: int
    last: bool
    rows: int
    fields: list[torch.Tensor]
    labels: list[torch.Tensor]
    left: bool = False  # the loop left the loader before stepping on it

    @classmethod
    def of(cls, batch: int, last: bool, chunk: Any) -> "Chunk":
        """The chunk ``chunk`` (a batch as the loader yields it) of logical batch ``batch``."""
        tensors = [t for t in output_tensors(chunk) if t.dim()]
        rows = int(tensors[0].shape[0]) if tensors else 0
        tensors = [t for t in tensors if t.shape[0] == rows]
        return cls(batch, last, rows, [row_sizes(t) for t in tensors], _label_fields(tensors))

    def check(
        self,
        rows: int,
        inputs: list[torch.Tensor],
        labels: list[torch.Tensor],
        targets: list[torch.Tensor],
    ) -> None:
        """Refuses a pass that is not over this chunk: other rows; a tensor argument of the
        model that is none of its fields (beyond a cast to another dtype); labels read off
        a recognised loss's gradient that are none of its label fields (or no label field
        to compare with); targets of a per-example criterion that are none of its fields.

        Raises:
          DPVisionError: naming what differs.
        """
        if rows != self.rows:
            raise DPVisionError(
                "the forward pass was over another number of rows than the private data "
                "loader's batch: step on the loader's batches as they come (a batch of the "
                "loop's own is not the Poisson sample the accountant is told about)"
            )
        for given in inputs:
            if not any(_near(given, field) for field in self.fields):
                raise DPVisionError(
                    "the model's input is not the batch the private data loader yielded: its "
                    "rows changed by more than a cast would change them, in the loop "
                    "(preprocessing, normalising with the batch's statistics, mixing views); "
                    "each example's input must depend on it alone, so preprocess in the "
                    "dataset's transform or in the model, and make views with augmult"
                )
        for seen in labels:
            if not any(_same_labels(seen, field) for field in self.labels):
                raise DPVisionError(
                    "the loss's labels are not the labels of the private data loader's batch "
                    "(labels from a teacher, or changed in the loop; or the batch has no "
                    "label field): they must be each example's own; use the loader's "
                    "targets, or compute them per example inside model.per_example_loss"
                )
        for target in targets:
            indices = _as_labels(target)
            if indices is not None and self.labels:
                ok = any(_same_labels(indices, field) for field in self.labels)
            else:
                ok = any(_near(row_sizes(target), field) for field in self.fields)
            if not ok:
                raise DPVisionError(
                    "the per-example criterion's targets are none of the fields of the "
                    "private data loader's batch (a teacher's outputs, or targets changed in "
                    "the loop): pass the loader's field and compute anything else from it "
                    "inside the criterion, one example at a time"
                )


def _near(given: torch.Tensor, field: torch.Tensor) -> bool:
    """Whether two rows' sizes (:func:`~dpvision.privacy_engine.loss.row_sizes`) agree up
    to what a cast between their dtypes changes: a cast to unit roundoff u moves each value
    by at most u·|x| (plus half a subnormal's spacing), so Σ|x|, max and min move by at most
    u times their size; both sizes may be casts of the same values, and each float64 sum
    adds its own rounding."""
    ours, theirs = given.cpu(), field.cpu()
    if ours.shape != theirs.shape:
        return False
    if ours.numel() == 0:
        return True
    unit = ours[:, 3:4] + theirs[:, 3:4]
    slack = (ours[:, 4:5] + theirs[:, 4:5]) * (1 + theirs[:, 0:1].abs())
    allowed = unit * theirs[:, :3].abs() + slack
    return bool(((ours[:, :3] - theirs[:, :3]).abs() <= allowed).all())


def _same_labels(seen: torch.Tensor, field: torch.Tensor) -> bool:
    """Whether the labels read off a gradient (-1: not read) are ``field``'s."""
    theirs = field.to(seen.device)
    return seen.shape == theirs.shape and bool(((seen == theirs) | (seen < 0)).all())


def _as_labels(tensor: torch.Tensor) -> torch.Tensor | None:
    """One class index per row, if ``tensor`` holds that: integers, integral floats (1-D),
    or one-hot rows; else None."""
    if tensor.is_complex():
        return None
    if tensor.dim() == 1:
        if not tensor.is_floating_point():
            return tensor
        integral = bool((tensor == tensor.round()).all()) and bool((tensor >= 0).all())
        return tensor.long() if integral else None
    if tensor.is_floating_point() and tensor.dim() == 2 and tensor.shape[1] > 1:
        binary = bool(((tensor == 0) | (tensor == 1)).all())
        if binary and bool((tensor.sum(1) == 1).all()):
            return tensor.argmax(1)
    return None


def _label_fields(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors (after the first) that hold one label per row, as class indices."""
    return [labels for t in tensors[1:] if (labels := _as_labels(t)) is not None]
