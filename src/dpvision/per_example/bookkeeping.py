"""Book-keeping clipping: per-example clipped gradient sums from one forward and one backward.

The reference :func:`~dpvision.per_example.reference.clipped_gradient_sum` materialises every
per-example gradient with ``vmap(grad(...))``. Book-keeping (Bu et al., 2023) gets the same
result from quantities an ordinary backward pass already has:

1. the forward pass records the input aᵢₜ of every supported layer (:class:`ActivationTape`);
2. one backward pass of the per-example losses, ``torch.autograd.grad(loss, outputs)``,
   gives the gradient gᵢₜ with respect to each layer's output and nothing else (the
   parameter gradients of the whole batch are never formed);
3. each layer turns (a, g) into per-example squared gradient norms
   (:mod:`dpvision.per_example.layers`: ghost norms or small materialised
   gradients), and these add up to ‖gᵢ‖² over *all* trainable parameters;
4. with cᵢ = min(1, C/‖gᵢ‖), each layer's clipped sum Σᵢ cᵢ Σₜ gᵢₜaᵢₜᵀ is one product with cᵢ
   folded into g (no second backward pass).

With K augmented views, inputs are (B, K, ...): the B·K views go through the model as one
batch, each view's loss is weighted by 1/K so that example i's gradient is the mean of its
K view-gradients, and the K views' activations are grouped as one example before the norms.

:func:`clip_and_sum` is the entry point for the DP-SGD engine: ``method="auto"`` uses
book-keeping when :func:`supports_bookkeeping` accepts the model and falls back to the
reference otherwise. Hooks are attached for one call and removed afterwards, also when an
exception is raised; no ``.grad`` is written.

Limitations: every trainable parameter is clipped by the rule that claims its module
(:func:`~dpvision.per_example.layers.claims`: a rule per standard layer kind, free
parameters of containers, ``torch.func`` on any other leaf layer); a layer whose rule
refuses it (BatchNorm in training mode, attention dropout) sends the model to the vmap
reference, as does a parameter used outside its layer's ``forward`` (found by a check of
the whole gradient on the first call of each input signature) or shared between layers (a
layer called several times is fine); ``loss_fn`` must return one loss per row.
"""

import weakref
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.mechanisms.clip_policy import ClipPolicy, resolve_policy
from dpvision.mechanisms.clipped_sum import ClippedGradientSum
from dpvision.mechanisms.groups import GroupNorms
from dpvision.per_example import batch_layout
from dpvision.per_example.clip_terms import clip_terms
from dpvision.per_example.layers import (
    Call,
    LayerTerms,
    Strategy,
    claims,
    layer_terms,
    rule_of,
)
from dpvision.per_example.precision import autocast_enabled, exact_arithmetic
from dpvision.per_example.reference import autocast, clipped_gradient_sum
from dpvision.per_example.tape import ActivationTape, UnsupportedError, tracked_layers
from dpvision.profiling import phase

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ClippingMethod(StrEnum):
    """How :func:`clip_and_sum` computes per-example gradient norms."""

    AUTO = "auto"  # book-keeping when the model allows it, else vmap
    BOOKKEEPING = "bookkeeping"
    VMAP = "vmap"


def unsupported_layers(model: nn.Module) -> list[str]:
    """One line for each layer whose trainable parameters book-keeping cannot handle."""
    problems = [p for claim in claims(model) if (p := claim.problem()) is not None]
    owners: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad and id(param) in owners:
            problems.append(f"parameter {name} is shared with {owners[id(param)]}")
        owners.setdefault(id(param), name)
    return problems


def supports_bookkeeping(model: nn.Module) -> bool:
    """Whether every trainable parameter of ``model`` is in a layer book-keeping handles.

    >>> supports_bookkeeping(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))  # training
    False
    >>> supports_bookkeeping(nn.Sequential(nn.Conv2d(1, 2, 3), nn.GroupNorm(1, 2)))
    True
    """
    return not unsupported_layers(model)


def trainable_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name → parameter, for the parameters of ``model`` that require gradients."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _bookkeeping_sum(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    policy: ClipPolicy,
    views: bool,
    mask: torch.Tensor | None,
    strategy: Strategy = "auto",
    precision: torch.dtype | None = None,
    verify_as: Any = None,
) -> ClippedGradientSum:
    params = trainable_params(model)
    batch = inputs.shape[0]
    k = inputs.shape[1] if views else 1
    if batch == 0 or k == 0:
        return ClippedGradientSum(
            grads={name: torch.zeros_like(p) for name, p in params.items()},
            l2_sensitivity=policy.l2_sensitivity,
            count=0,
            nonfinite=0,
            norms=torch.zeros(0, dtype=inputs.dtype if inputs.is_floating_point() else None),
        )
    flat = inputs.reshape(batch * k, *inputs.shape[2:]) if views else inputs
    labels = targets.repeat_interleave(k) if views else targets
    # The call signature to verify (given for the float32 pass below), or None.
    verify = _first_use(model, flat) if verify_as is None else verify_as
    # A forward in low precision: under ``precision``, or under the caller's own autocast
    # (``optimizer.step()`` inside ``torch.autocast``).
    low = precision is not None or autocast_enabled(flat.device)
    if verify is not None and low:
        # Autograd's own parameter gradients, the check's reference, can be less exact in
        # low precision than the per-example terms (CPU bfloat16 kernels sum a LayerNorm's
        # offset gradient in bfloat16): the first call of a signature is verified in a
        # float32 pass of its own, then runs as asked.
        with torch.autocast(flat.device.type, enabled=False):
            _bookkeeping_sum(
                model,
                loss_fn,
                inputs,
                targets,
                policy=policy,
                views=views,
                mask=mask,
                strategy=strategy,
                verify_as=verify,
            )
        verify = None
    tape = ActivationTape(model, mode="edges")
    with tape.attached(), torch.enable_grad():
        with phase("forward"), autocast(flat.device, precision):
            outputs = model(flat)
        if precision is not None:  # the loss in float32, as autocast would compute it
            outputs = outputs.float()
        losses = loss_fn(outputs, labels)
        if losses.dim() == 0 or losses.shape[0] != batch * k:
            raise UnsupportedError(
                f"loss_fn returned shape {tuple(losses.shape)}; book-keeping needs one loss "
                f"per row ({batch * k}), i.e. reduction='none'"
            )
        # Each view weighs 1/K: example i's gradient is the mean of its K view-gradients.
        total = losses.reshape(batch * k, -1).mean(1).sum() / k
        names = list(params) if verify is not None else []
        edges = len(tape.edges)
        sources = [*tape.edges, *(params[name] for name in names)]
        whole: tuple[torch.Tensor | None, ...] = ()
        terms = _LayerTermsOf(tape, batch * k, k, strategy, flat.device)
        if sources:
            tape.on_ready = terms.as_ready  # dense layers' terms during the backward pass
            with phase("backward"):
                grads = torch.autograd.grad(total, sources, allow_unused=True)
            tape.on_ready = None
            terms.raise_failure()
            tape.set_edge_grads(grads[:edges])
            whole = grads[edges:]
            del grads  # the output gradients of layers whose terms are done: freed
        found = terms.all()
    with exact_arithmetic(flat.device):
        if verify is not None:
            true = dict(zip(names, whole, strict=True))
            with phase("verify"):
                reason = unclipped_mismatch(found, true, batch)
            if reason is not None:
                _VERDICTS[model][verify] = reason
                raise UnsupportedError(reason)
        if verify_as is not None:  # the float32 pass that verifies: its sum is not used
            return ClippedGradientSum.zeros(params, l2_sensitivity=policy.l2_sensitivity)
        return clip_terms(found, params, batch, policy=policy, mask=mask)


class _LayerTermsOf:
    """Each recorded layer's terms, computed in the backward pass as soon as the layer's
    output gradients are all there (dense and convolution rules: their inputs and output
    gradients are then freed as the backward goes on, not held to its end), or after it.

    The norms, and later the sums they clip, are computed in IEEE float32 whatever the
    user's TF32, matmul-precision and autocast settings (dpvision.per_example.precision);
    values recorded in a low precision are upcast exactly by layer_terms, or kept by the
    rules that materialise per-example gradients in it.
    """

    def __init__(
        self,
        tape: ActivationTape,
        rows: int,
        views: int,
        strategy: Strategy,
        device: torch.device,
    ) -> None:
        self.tape, self.rows, self.views = tape, rows, views
        self.strategy, self.device = strategy, device
        self.paths = {module: path for path, module in tape.layers}
        self.done: dict[nn.Module, LayerTerms] = {}
        self.failure: BaseException | None = None

    def _terms(self, path: str, module: nn.Module, calls: list[Call]) -> LayerTerms:
        tape = self.tape
        if any(n != self.rows for call in calls for n in tape.rows(module, call)):
            raise UnsupportedError(f"layer {path or 'root'} did not see one row per view")
        # A rule that recomputes its layer must not be recorded.
        with tape.paused(), phase(f"norms[{type(module).__name__}]"):
            return layer_terms(module, calls, self.views, self.strategy)

    def as_ready(self, module: nn.Module) -> None:
        """The tape's on_ready: a dense or convolution layer's terms, now."""
        # The rules that take recorded values as they are (Rule.low_precision) are the
        # dense and convolution ones, which run no autograd of their own: safe inside a
        # backward hook. The others (attention, torch.func) wait for the backward's end.
        if self.failure is not None or not rule_of(module).low_precision:
            return
        try:
            path = self.paths[module]
            with exact_arithmetic(self.device):
                self.done[module] = self._terms(path, module, self.tape.calls_of(path, module))
            self.tape.forget(module)
        except BaseException as error:  # raised after the backward pass, by raise_failure
            self.failure = error

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def all(self) -> list[tuple[str, LayerTerms]]:
        """(path, terms) of every layer with a gradient, in the model's order."""
        found = []
        with exact_arithmetic(self.device):
            for path, module in self.tape.layers:
                if module in self.done:
                    found.append((path, self.done[module]))
                elif calls := self.tape.calls_of(path, module):
                    found.append((path, self._terms(path, module, calls)))
        return found


# Per model: for each call signature, None once book-keeping was verified, else the reason
# it cannot be used (then every call of that signature goes to the vmap reference).
_VERDICTS: "weakref.WeakKeyDictionary[nn.Module, dict[Any, str | None]]" = (
    weakref.WeakKeyDictionary()
)


def _first_use(model: nn.Module, flat: torch.Tensor) -> Any:
    """The signature of this call if it is new for ``model`` (its layout is then probed and
    its gradients must be verified), else None.

    Raises:
      UnsupportedError: the layout or an earlier verification ruled book-keeping out.
    """
    verdicts = _VERDICTS.setdefault(model, {})
    key = batch_layout.signature(model, (flat,), {})
    if key in verdicts:
        reason = verdicts[key]
        if reason is not None:
            raise UnsupportedError(reason)
        return None
    try:
        batch_layout.check_batch_layout(model, tracked_layers(model), (flat,), {})
    except batch_layout.LayoutError as error:
        verdicts[key] = str(error)
        raise UnsupportedError(str(error)) from None
    verdicts[key] = None
    return key


def unclipped_mismatch(
    terms: list[tuple[str, LayerTerms]],
    true: Mapping[str, torch.Tensor | None],
    batch: int,
    *,
    tolerance: float = 1.0,
) -> str | None:
    """Names a parameter whose recorded layer calls do not explain its whole gradient.

    ``true`` holds each trainable parameter's gradient of the same backward pass; the
    layers' unclipped sums Σᵢ Gᵢ must equal it. A parameter also used outside its layer's
    ``forward`` (``F.linear(x, fc.weight)``) fails this, and book-keeping would silently
    drop that use.
    """
    sums: dict[str, torch.Tensor] = {}
    scales: dict[str, float] = {}
    for path, layer in terms:
        like = layer.sq_norms
        # Σᵢ‖Gᵢ‖ over the layer: the size of what was summed, hence of its rounding error.
        # A parameter whose total gradient cancels to ~0 (a gain before GroupNorm) would
        # otherwise fail a tolerance relative to its total alone.
        scale = float(torch.nan_to_num(like.clamp_min(0).sqrt(), posinf=0.0).sum())
        for local, value in layer.clipped_sum(like.new_ones(batch), None).items():
            name = f"{path}.{local}" if path else local
            sums[name], scales[name] = value, scale
    for name, grad in true.items():
        ours = sums.get(name)
        if grad is None and ours is None:
            continue
        if grad is None:  # no gradient reached the parameter at all
            grad = torch.zeros_like(ours)
        ours = torch.zeros_like(grad) if ours is None else ours.to(grad.dtype)
        error = float(torch.linalg.vector_norm(ours - grad))
        allowed = tolerance * (
            1e-3 * float(torch.linalg.vector_norm(grad)) + 1e-4 * scales.get(name, 0.0)
        )
        if not error <= allowed + 1e-6:
            return (
                f"parameter {name} gets gradient from outside its layer's forward (e.g. "
                f"F.linear(x, layer.weight)), which per-layer clipping cannot see, or its "
                f"layer's rule gives per-example gradients that do not add up to its gradient"
            )
    return None


def clip_and_sum(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    max_grad_norm: float | None = None,
    views: bool = False,
    mask: torch.Tensor | None = None,
    method: ClippingMethod | str = ClippingMethod.AUTO,
    precision: torch.dtype | None = None,
    groups: GroupNorms | None = None,
    policy: ClipPolicy | None = None,
) -> ClippedGradientSum:
    """Σᵢ clip(gᵢ, C) by book-keeping or by the vmap reference; both give the same result.

    Args:
      model: any module whose layers treat examples independently (no BatchNorm).
      loss_fn: per-row loss ``loss_fn(outputs, targets)`` with reduction "none" (losses with
        more dimensions per row are averaged over them, as in the reference).
      inputs: (B, ...) or, with ``views=True``, (B, K, ...) augmented views.
      targets: (B,) labels, shared by the views of an example.
      max_grad_norm: C > 0.
      views: whether ``inputs`` carries a view dimension K.
      mask: optional (B,) booleans; rows that are false (padding) contribute nothing.
      method: ``auto`` (book-keeping when :func:`supports_bookkeeping`, else vmap),
        ``bookkeeping`` (raises :class:`~dpvision.errors.DPVisionError` when unsupported) or
        ``vmap`` (:func:`~dpvision.per_example.reference.clipped_gradient_sum`).
      precision: None (float32), or the dtype (``torch.bfloat16``) the model's forward and
        backward passes run in under :func:`torch.autocast`. Everything privacy rests on
        stays in float32: book-keeping upcasts the activations and output gradients the
        layers recorded (exactly: every bfloat16 is a float32) before it computes the
        per-example norms and the clipped sum, so each example's contribution is clipped
        with the norm of that very contribution, and the vmap reference differentiates
        the float32 parameters. The loss is computed in float32. The norms and the sums
        run in IEEE float32 under
        :func:`~dpvision.per_example.precision.exact_arithmetic` whatever the caller's TF32,
        matmul-precision and autocast settings (which the forward and backward keep); a
        caller's autocast around the call is treated like ``precision``.
      groups: group-wise clipping (:mod:`dpvision.mechanisms.groups`): each example's
        gradient restricted to layer g is clipped to C_g; sensitivity √(Σ C_g²).
      policy: instead of ``max_grad_norm`` or ``groups``, any
        :class:`~dpvision.mechanisms.clip_policy.ClipPolicy` (exactly one of the three).

    Returns:
      The clipped sum, its sensitivity C, the counts, and the per-example norms.

    Privacy:
      Releases nothing by itself. The output has L2 sensitivity C under add/remove-one: each
      example's gradient (the mean over its K views, all trainable parameters together) is
      clipped to norm C before the sum, up to float32 rounding (norms and sums in the same
      IEEE float32 arithmetic, never TF32). Non-finite per-example gradients are zeroed and
      counted, never propagated.
    """
    policy = resolve_policy(max_grad_norm, groups, policy)
    try:
        chosen = ClippingMethod(method)
    except ValueError:
        choices = ", ".join(m.value for m in ClippingMethod)
        raise DPVisionError(
            f"unknown clipping method {method!r}; choose one of {choices}"
        ) from None
    batch = (model, loss_fn, inputs, targets)
    how = {"policy": policy, "views": views, "mask": mask, "precision": precision}
    if chosen is not ClippingMethod.VMAP:
        problems = unsupported_layers(model)
        try:
            if problems:
                raise UnsupportedError(problems[0])
            return _bookkeeping_sum(*batch, **how)
        except UnsupportedError as reason:
            if chosen is ClippingMethod.BOOKKEEPING:
                raise DPVisionError(f"book-keeping clipping does not support {reason}") from None

    return clipped_gradient_sum(*batch, **how)


def bookkeeping_clipped_gradient_sum(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    max_grad_norm: float,
    views: bool = False,
    mask: torch.Tensor | None = None,
) -> ClippedGradientSum:
    """Σᵢ clip(gᵢ, C) by book-keeping, with the vmap reference for unsupported models.

    Same contract and result as
    :func:`~dpvision.per_example.reference.clipped_gradient_sum` (see :func:`clip_and_sum`
    with ``method="auto"`` for the arguments), at about the cost of one ordinary training
    step.

    Privacy:
      Releases nothing by itself. The output has L2 sensitivity C under add/remove-one (each
      example's view-averaged gradient is clipped to C); non-finite per-example gradients
      are zeroed and counted.
    """
    return clip_and_sum(
        model,
        loss_fn,
        inputs,
        targets,
        max_grad_norm=max_grad_norm,
        views=views,
        mask=mask,
        method=ClippingMethod.AUTO,
    )
