"""What :class:`~dpvision.privacy_engine.PrivacyEngine` verifies of the loss.

Book-keeping reads example i's gradient from row i of each layer's output gradient and
multiplies by the number of rows n to undo a mean. That is right only when the loss is
(1/n)·Σᵢ ℓ(outᵢ, yᵢ) or Σᵢ ℓ(outᵢ, yᵢ): then row i of the gradient at the model's output is
a function of example i alone. A class-weighted mean (torch divides by Σ w[yᵢ]), a mean over
the rows that are not ``ignore_index``, a mean loss declared ``loss_reduction="sum"`` or a
term across the batch (logits centred over it) make every row depend on the other
examples: one added example then rescales the gradients of all the others, and clipping
each to C no longer bounds what it moves (39.6 C for a class-weighted cross-entropy).

So the gradient at the output is never taken on trust. :class:`OutputGate` hands back
every rows-first output of a recorded pass through an identity whose backward hook accepts
the incoming gradient only

* if it is exactly the gradient a :class:`PerExampleLoss` promised, which computed each
  example's loss and gradient on that example's rows alone (the criterion never sees two
  examples, so class weights, ``ignore_index`` or anything the criterion does stay within
  the example); or
* if it is recognised as that of a plain mean (or sum, as declared) of cross-entropy over
  the logits, or of negative log-likelihood (:func:`recognised_gradient`): row i must be
  s·(softmax(outᵢ) − e_yᵢ) (or −s·e_yᵢ) with s = 1/n or 1 and a one-hot e_yᵢ;

and in the second case it *replaces* the gradient by s·(softmax(outᵢ) − e_yᵢ) recomputed
from row i alone, so that what flows into the model is per-example by construction (the
tolerance of the recognition decides only what is refused, never the sensitivity).
Anything else raises a one-line :class:`~dpvision.errors.DPVisionError` from
``loss.backward()`` that names the fix. The labels read off a recognised gradient, and the
targets a :class:`PerExampleLoss` is given, are kept for the step, which compares them
with the fields of the batch the private data loader yielded
(:class:`~dpvision.privacy_engine.optimizer.Chunk`): a teacher's labels are not the data.

Assumed, not verified: the loss reaches the model only through its output (a loss term on
an intermediate activation that a hook of yours captured is not seen), and the backward
pass of the model's own operations keeps examples apart as its forward pass does.
"""

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import grad_and_value, vmap

from dpvision.errors import DPVisionError
from dpvision.per_example.layers import float32_calls

ACCUMULATE = (
    "To accumulate gradients over several loader batches (loss / k, a step every k), "
    "use BatchMemoryManager(data_loader=..., max_physical_batch_size=..., optimizer=...) "
    "from dpvision.privacy_engine: it splits each logical batch into physical ones and steps "
    "once per logical batch"
)
"""The fix for manual gradient accumulation, which every refusal it meets names."""

REFUSED = (
    "the loss's gradient at the model's output is not that of a plain {reduction} of "
    "per-example losses ({why}): class weights (weight=), ignore_index, label smoothing, a "
    "scaled loss or a term across the batch make every example's gradient depend on the "
    "others. Compute the loss with a per-example criterion: make_private(..., "
    "criterion=your_loss(reduction='none')) and loss = model.per_example_loss(criterion)"
    "(output, target), or drop weight/ignore_index. " + ACCUMULATE
)


def _tolerance(*dtypes: torch.dtype) -> float:
    """How far from one-hot a recognised row may be: rounding of the least precise dtype."""
    return 4 * max(torch.finfo(d).eps for d in dtypes) + 1e-5


def recognised_gradient(
    value: torch.Tensor, grad: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the per-example gradient ``grad`` stands for, recomputed row by row; the labels read
    off it), or None.

    ``grad`` is recognised if every row i is s·(softmax(valueᵢ) − e_yᵢ) (cross-entropy over
    logits; a ``-inf`` logit is a masked class) or −s·e_yᵢ (negative log-likelihood) for a
    one-hot e_yᵢ, with s = ``scale`` (1/n for a mean over n rows, 1 for a sum). A row of
    zeros is recognised only where the model is that sure of its label (softmax − one-hot
    ≈ 0): a loss that drops rows by a batch-wide rule (the hardest half, the smallest
    losses) is not a plain mean. Rows whose logits are NaN or +inf, or whose gradient is not
    finite, cannot be checked: they come back as NaN, and their examples are clipped to zero.

    Privacy:
      Releases nothing. The returned gradient's row i is a function of (valueᵢ, yᵢ) only,
      whatever ``grad``'s other rows hold: yᵢ is read off row i of ``grad`` and is discrete.
    """
    if value.dim() != 2 or value.shape != grad.shape or not value.is_floating_point():
        return None
    if value.shape[0] == 0:
        return grad, torch.zeros(0, dtype=torch.long, device=grad.device)
    v, g = value.detach().double(), grad.detach().double()
    checkable = ~(v.isnan() | (v == float("inf"))).any(1) & torch.isfinite(g).all(1)
    checkable &= torch.isfinite(v).any(1)  # a row of -inf has no softmax
    tol = _tolerance(value.dtype, grad.dtype)
    probs = torch.softmax(torch.where(checkable[:, None], v, 0.0), 1)
    g = torch.where(checkable[:, None], g, 0.0)
    for target, rebuild in (
        (probs - g / scale, lambda e: scale * (probs - e)),  # cross-entropy over logits
        (-g / scale, lambda e: -scale * e),  # negative log-likelihood
    ):
        labels = target.argmax(1)
        onehot = torch.nn.functional.one_hot(labels, v.shape[1]).double()
        off = (target - onehot).abs().amax(1)
        if bool((off[checkable] <= tol).all()):
            exact = torch.where(checkable[:, None], rebuild(onehot), float("nan"))
            return exact.to(grad.dtype), torch.where(checkable, labels, -1)
    return None


class OutputGate:
    """Checks, and makes exact, the gradient that reaches each output of a recorded pass.

    The private module hands its caller, for each rows-first output tensor, an identity of
    it (:meth:`gated`): the gate sees the gradient of the caller's loss only, not the
    gradient that flows back inside the model (a ``(logits, features)`` output whose
    features also feed the logits).

    Args:
      loss_reduction: ``"mean"`` (s = 1/n for a pass of n rows) or ``"sum"`` (s = 1).

    Privacy:
      Releases nothing. After its hooks, the gradient at the model's output has row i a
      function of example i alone (see the module docstring), or the backward pass raised.
    """

    def __init__(self, loss_reduction: str) -> None:
        self.loss_reduction = loss_reduction
        self._outputs: dict[int, int] = {}  # id of a gated output tensor → its pass
        self._promised: dict[int, torch.Tensor] = {}  # id of an output → PerExampleLoss's grad
        self.verified: set[int] = set()  # passes whose output gradients were accepted
        self.labels: dict[int, list[torch.Tensor]] = {}  # pass → labels read off gradients
        self.inputs: dict[int, list[torch.Tensor]] = {}  # pass → row_sizes of its inputs
        self.targets: dict[int, list[torch.Tensor]] = {}  # pass → PerExampleLoss's targets
        self.refusal: str | None = None
        self.hooks_enabled = True  # off: the module records nothing (``disable_hooks``)

    def scale(self, rows: int) -> float:
        """s: what the declared reduction multiplies each row's loss by."""
        return 1.0 / max(rows, 1) if self.loss_reduction == "mean" else 1.0

    def gated(self, output: Any, rows: int, pass_index: int) -> Any:
        """``output`` with each rows-first tensor that requires grad replaced by an identity
        of it whose gradient this gate checks (tuples, lists and dicts rebuilt)."""
        if isinstance(output, torch.Tensor):
            if not (output.requires_grad and output.dim() > 0 and output.shape[0] == rows):
                return output
            seen = _Identity.apply(output)
            self._outputs[id(seen)] = pass_index
            seen.register_hook(self._hook(seen.detach(), seen._version, id(seen), pass_index))
            return seen
        if dataclasses.is_dataclass(output) and not isinstance(output, type):
            changes = {
                f.name: self.gated(getattr(output, f.name), rows, pass_index)
                for f in dataclasses.fields(output)
                if f.init
            }
            return dataclasses.replace(output, **changes)
        if isinstance(output, dict):
            return type(output)((k, self.gated(v, rows, pass_index)) for k, v in output.items())
        if isinstance(output, tuple) and hasattr(output, "_fields"):  # a named tuple
            return type(output)(*(self.gated(v, rows, pass_index) for v in output))
        if isinstance(output, tuple | list):
            return type(output)(self.gated(v, rows, pass_index) for v in output)
        return output

    def is_output(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is an output of a recorded pass not yet stepped."""
        return id(tensor) in self._outputs

    def pass_of(self, tensor: torch.Tensor) -> int:
        """The pass an output of :meth:`gated` belongs to."""
        return self._outputs[id(tensor)]

    def promise(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        """``grad`` is the exact gradient :class:`PerExampleLoss` sends to ``output``."""
        self._promised[id(output)] = grad

    def clear(self) -> None:
        """Forgets the passes (after each step)."""
        self._outputs.clear()
        self._promised.clear()
        self.verified.clear()
        self.labels.clear()
        self.inputs.clear()
        self.targets.clear()
        self.refusal = None

    def _hook(
        self, value: torch.Tensor, version: int, key: int, pass_index: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        def gate(grad: torch.Tensor) -> torch.Tensor:
            if value._version != version:
                self._refuse(
                    "the model's output was changed in place after the forward pass, so the "
                    "loss saw other values than the checks did"
                )
            promised = self._promised.get(key)
            if promised is not None:
                if torch.equal(grad, promised.to(grad.dtype)):
                    self.verified.add(pass_index)
                    return grad
                self._refuse(
                    "the per-example criterion's loss was scaled, or another term reached the "
                    "same output"
                )
            found = recognised_gradient(value, grad, self.scale(value.shape[0]))
            if found is None:
                self._refuse(  # no row count: a Poisson batch's size is not the user's to log
                    "its rows are neither softmax − one-hot (cross-entropy) nor − one-hot "
                    "(NLL), times 1/rows"
                    if self.loss_reduction == "mean"
                    else "its rows are neither softmax − one-hot nor − one-hot"
                )
            assert found is not None
            exact, labels = found
            self.verified.add(pass_index)
            self.labels.setdefault(pass_index, []).append(labels)
            return exact

        return gate

    def _refuse(self, why: str) -> None:
        self.refusal = REFUSED.format(reduction=self.loss_reduction, why=why)
        raise DPVisionError(self.refusal)


class _Identity(torch.autograd.Function):
    """The output as the caller sees it: its gradient is the caller's loss's alone."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor) -> Any:
        return output.clone()  # its own version counter: an in-place change shows

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad


class _Attached(torch.autograd.Function):
    """The loss value, with ``grads`` as its gradients with respect to the outputs."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, count: int, *tensors: torch.Tensor) -> Any:
        ctx.save_for_backward(*tensors[count:])
        return value.clone()

    @staticmethod
    def backward(ctx: Any, upstream: torch.Tensor) -> Any:
        grads = ctx.saved_tensors
        return None, None, *(g * upstream.to(g.dtype) for g in grads), *(None for _ in grads)


class PerExampleLoss(nn.Module):
    """A criterion evaluated one example at a time: Opacus' ``DPLossFastGradientClipping``.

    ``loss = PerExampleLoss(...)(output, target)`` calls ``criterion`` on each example's own
    K rows (K augmented views), never on two examples together, and returns ``weight``
    times the mean (or the sum, with ``loss_reduction="sum"``) over all rows of the per-row
    losses; its gradient at ``output`` is exactly weight·s·∇ℓ(outᵢ, yᵢ) row by row. Class
    weights, ``ignore_index`` (the ignored rows get loss 0, the others are not
    renormalised), label smoothing, or a term across the criterion's batch are then
    per-example by construction. ``output`` may also be a tuple of outputs (two passes
    over the same examples, inside ``model.same_examples()``, for a consistency term):
    ``criterion`` then gets the tuple of each example's rows of them.

    Args:
      criterion: per-row losses: ``criterion(output_rows, target_rows)`` returns one loss
        per row (``reduction="none"``; a torch loss with another ``reduction`` is copied and
        set to ``"none"``, as Opacus does), extra dimensions averaged.
      gate: the private module's :class:`OutputGate`.
      loss_reduction: ``"mean"`` or ``"sum"`` over the rows.
      views: K, consecutive rows per example.
      weight: a public constant the loss is multiplied by (an auxiliary head's 0.4).

    Privacy:
      Releases nothing. Row i of the gradient sent to ``output`` is a function of example
      i's rows and targets alone.
    """

    def __init__(
        self,
        criterion: Callable[..., torch.Tensor],
        gate: OutputGate,
        *,
        loss_reduction: str,
        views: int,
        weight: float = 1.0,
    ) -> None:
        super().__init__()
        if getattr(criterion, "reduction", "none") != "none":
            criterion = copy.copy(criterion)
            criterion.reduction = "none"  # type: ignore[union-attr]
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise DPVisionError(f"weight must be a number > 0, got {weight!r}")
        self.criterion, self.gate = criterion, gate
        self.loss_reduction, self.views, self.weight = loss_reduction, views, float(weight)

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The reduced loss over the rows of ``output`` (the private module's output, or a
        tuple of them)."""
        outputs = tuple(output) if isinstance(output, tuple | list) else (output,)
        if not outputs or not all(
            isinstance(o, torch.Tensor) and self.gate.is_output(o) for o in outputs
        ):
            raise DPVisionError(
                "the per-example criterion takes the private model's output itself (one row "
                "per view, rows first), in training mode before optimizer.step()"
            )
        rows, k = outputs[0].shape[0], self.views
        if any(o.shape[0] != rows for o in outputs):
            raise DPVisionError("the outputs given to the per-example criterion differ in rows")
        if not isinstance(target, torch.Tensor) or target.dim() == 0 or target.shape[0] != rows:
            raise DPVisionError(
                f"the per-example criterion needs one target per row ({rows}), got "
                f"{getattr(target, 'shape', type(target).__name__)}"
            )
        # The targets must be the loader's, as the labels of a recognised loss are.
        pass_index = self.gate.pass_of(outputs[0])
        self.gate.targets.setdefault(pass_index, []).append(target.detach())
        values = tuple(float32_calls(o.detach()) for o in outputs)  # as autocast's loss
        grads, losses = self._per_example(values, target, rows // k)
        scale = self.gate.scale(rows) * self.weight
        sent = tuple((g * scale).to(o.dtype) for g, o in zip(grads, outputs, strict=True))
        for o, g in zip(outputs, sent, strict=True):
            self.gate.promise(o, g)
        total = losses.sum().to(values[0].dtype) * scale
        return _Attached.apply(total, len(outputs), *outputs, *sent)

    def _per_example(
        self, values: tuple[torch.Tensor, ...], target: torch.Tensor, batch: int
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """(per-row gradients of each output, per-example loss sums), each example on its
        own rows."""
        k, single = self.views, len(values) == 1

        def example(rows: tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor:
            per_row = self.criterion(rows[0] if single else rows, targets)
            n = rows[0].shape[0]
            if per_row.dim() == 0 or per_row.shape[0] != n:
                raise DPVisionError(
                    "the per-example criterion must return one loss per row "
                    f"(reduction='none'), got shape {tuple(per_row.shape)}"
                )
            return per_row.reshape(n, -1).mean(1).sum()

        if batch == 0:
            return tuple(torch.zeros_like(v) for v in values), values[0].new_zeros(0)
        blocks = tuple(v.reshape(batch, k, *v.shape[1:]) for v in values)
        labels = target.reshape(batch, k, *target.shape[1:])
        try:
            grads, losses = vmap(grad_and_value(example))(blocks, labels)
        except DPVisionError:
            raise
        except Exception:  # an operation vmap cannot batch: one example at a time
            parts = []
            for i in range(batch):
                rows = tuple(b[i].clone().requires_grad_(True) for b in blocks)
                with torch.enable_grad():
                    loss = example(rows, labels[i])
                parts.append((torch.autograd.grad(loss, rows), loss.detach()))
            grads = tuple(torch.stack([p[0][j] for p in parts]) for j in range(len(values)))
            losses = torch.stack([p[1] for p in parts])
        return tuple(g.reshape(v.shape) for g, v in zip(grads, values, strict=True)), losses


def row_sizes(batch: torch.Tensor) -> torch.Tensor:
    """(Σ|x|, max x, min x, u, a) of each row of a tensor, in float64: what a step compares
    between the model's inputs and the fields of the rows the private data loader yielded
    (a cast moves each by at most its rounding; a sign flip or a batch statistic does not).
    u is the unit roundoff of the tensor's dtype (0 if it holds integers) and a the most a
    cast to it moves Σ|x| beyond u·Σ|x| (subnormals; the float64 sum's own rounding)."""
    with torch.no_grad():
        rows = batch.detach().flatten(1) if batch.dim() > 1 else batch.detach()[:, None]
        n = rows.shape[1]
        unit, floor = 0.0, 0.0
        if batch.is_floating_point() or batch.is_complex():
            info = torch.finfo(batch.dtype)
            unit = info.eps / 2
            floor = n * unit * info.smallest_normal
        rows = rows.to(torch.float64)
        if n == 0:
            return rows.new_zeros(rows.shape[0], 5)
        sizes = [rows.abs().sum(1), rows.amax(1), rows.amin(1)]
        floor += n * torch.finfo(torch.float64).eps  # relative: scaled by Σ|x| in _near
        extra = torch.tensor([unit, floor], dtype=torch.float64, device=rows.device)
        return torch.cat([torch.stack(sizes, 1), extra.expand(rows.shape[0], 2)], 1)
