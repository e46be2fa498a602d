"""Per-example gradient norms and clipped sums of single layers, without per-example backprop.

For a layer whose output is ``a @ Wᵀ`` over positions t (a Linear on any leading dims, or a
convolution after im2col), example i's weight gradient is Gᵢ = Σₜ gᵢₜ aᵢₜᵀ, where aᵢₜ is the
layer input and gᵢₜ the gradient of the loss with respect to the layer output. Its squared
norm is found either

* by the *ghost* trick (Li et al., 2022, "Large Language Models Can Be Strong
  Differentially Private Learners"): ‖Gᵢ‖² = Σₜₜ′ (aᵢₜ·aᵢₜ′)(gᵢₜ·gᵢₜ′), memory B·T², or
* by *materialising* Gᵢ, memory B·p·d,

whichever is cheaper for the layer (mixed ghost clipping, Bu et al., 2023, "Differentially
Private Optimization on Large Model at Small Cost"). Once the clipping factors cᵢ are known,
the clipped sum Σᵢ cᵢGᵢ is one weighted weight-gradient product (book-keeping: no second
backward pass).

Every module with trainable parameters is *claimed* by one rule (:func:`claims`), one small
module per layer kind, registered by type (:func:`register_rule`):

* dense: ``nn.Linear`` on any leading shape (:mod:`~dpvision.per_example.layers.dense`),
  ``WSConv2d`` (:mod:`~dpvision.per_example.layers.wsconv`), ``nn.Conv1d/2d/3d`` with any
  ``groups``, stride, dilation, padding and padding mode
  (:mod:`~dpvision.per_example.layers.conv`);
* small per-example gradients formed directly: affine ``nn.GroupNorm``, ``nn.LayerNorm``,
  ``nn.RMSNorm``, ``nn.InstanceNorm1d/2d/3d`` (no running statistics), ``nn.PReLU`` and
  BatchNorm with frozen statistics (evaluation mode, or
  :class:`~dpvision.models.FrozenBatchNorm`);
* ``nn.Embedding`` (a ghost sum over each example's tokens);
* ``nn.MultiheadAttention`` as it is (its projections through the dense rule);
* *free parameters* a container uses directly (class tokens, position embeddings, layer
  scales), followed where they are broadcast against the batch
  (:mod:`~dpvision.per_example.layers.free_parameters`);
* any other layer without children with parameters: ``torch.func`` on that layer alone
  (:mod:`~dpvision.per_example.layers.functional`).

An example's K augmented views are grouped as one example: its activations have K·T
positions. Adding a layer kind is adding a module with a :class:`LayerTerms` and its
``register_rule``; the model check (:func:`dpvision.per_example.bookkeeping.unsupported_layers`)
asks the same registry.
"""

import dataclasses
from typing import Literal

from torch import nn

# Importing the rule modules registers their layer types.
from dpvision.per_example.layers import (
    attention,
    batch_norm,
    conv,
    dense,
    embedding,
    group_norm,
    instance_norm,
    layer_norm,
    prelu,
    rms_norm,
    wsconv,
)
from dpvision.per_example.layers.base import (
    MATERIALISE_BYTES,
    RULES,
    Call,
    LayerTerms,
    Rule,
    Strategy,
    UnsupportedError,
    float32_calls,
    low_precision,
    output_tensors,
    register_rule,
    sum_calls,
)
from dpvision.per_example.layers.free_parameters import FreeParameterTerms, ParameterTaps
from dpvision.per_example.layers.functional import FunctionalTerms

__all__ = [
    "FALLBACK",
    "FREE",
    "MATERIALISE_BYTES",
    "RULES",
    "Call",
    "Claim",
    "LayerTerms",
    "ParameterTaps",
    "Rule",
    "Strategy",
    "UnsupportedError",
    "attention",
    "batch_norm",
    "claims",
    "conv",
    "dense",
    "embedding",
    "float32_calls",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "layer_terms",
    "low_precision",
    "output_tensors",
    "prelu",
    "register_rule",
    "rms_norm",
    "rule_of",
    "sum_calls",
    "wsconv",
]

# A layer with trainable parameters, no children with trainable parameters and no rule of
# its own: torch.func on that layer alone.
FALLBACK = Rule(FunctionalTerms, lambda _: None, unit=True)
# A container's own parameters used directly in its forward (class tokens, layer scales).
FREE = Rule(FreeParameterTerms, lambda _: None)


def _trainable_children(module: nn.Module) -> bool:
    return any(p.requires_grad for child in module.children() for p in child.parameters())


def rule_of(module: nn.Module) -> Rule:
    """The rule that clips ``module``'s parameters: its registered one, else the per-layer
    ``torch.func`` fallback for a leaf layer, else free parameters for a container."""
    rule = RULES.get(type(module))
    if rule is not None:
        return rule
    return FREE if _trainable_children(module) else FALLBACK


@dataclasses.dataclass(frozen=True)
class Claim:
    """A module whose trainable parameters one rule clips.

    Attributes:
      path: the module's name in the model ("" for the root).
      module: the module.
      rule: its rule (:func:`rule_of`).
      kind: ``layer`` (recorded as (input, output grad)), ``unit`` (the whole call, and the
        rule covers the module's subtree) or ``free`` (free parameters, through
        :class:`ParameterTaps`).
    """

    path: str
    module: nn.Module
    rule: Rule
    kind: Literal["layer", "unit", "free"]

    def problem(self) -> str | None:
        """Why the rule cannot handle this module after all (with where), or None."""
        reason = self.rule.check(self.module)
        return None if reason is None else f"{reason} at {self.path or 'the root'}"


def claims(model: nn.Module) -> list[Claim]:
    """Every module of ``model`` whose trainable parameters a rule clips, in module order.

    A unit's subtree is its own: its children are not claimed again.
    """
    found: list[Claim] = []
    units: list[str] = []
    for path, module in model.named_modules():
        if any(u == "" or path.startswith(u + ".") for u in units):
            continue
        own = any(p.requires_grad for p in module.parameters(recurse=False))
        rule = rule_of(module)
        if rule.unit and (own or (rule is not FALLBACK and _trainable_children(module))):
            found.append(Claim(path, module, rule, "unit"))
            units.append(path)
        elif own:
            found.append(Claim(path, module, rule, "free" if rule is FREE else "layer"))
    return found


def layer_terms(
    module: nn.Module, calls: list[Call], views: int, strategy: Strategy = "auto"
) -> LayerTerms:
    """Per-example terms of ``module`` from its recorded calls (see :func:`claims`).

    Args:
      module: a claimed module whose :meth:`Claim.problem` is None.
      calls: what the tape recorded of every call of ``module`` in the forward pass (more
        than one when the layer is shared); leading dimension B·K.
      views: K, the number of consecutive rows that belong to one example.
      strategy: ``ghost`` or ``materialise`` to force the norm computation (tests).

    Values recorded in a precision below float32 (a pass under autocast) are upcast to
    float32 (exactly) before the rule sees them, unless the rule takes them as they are
    (:attr:`Rule.low_precision`); the terms' norms and sums are float32 either way.
    """
    rule = rule_of(module)
    if not rule.low_precision:  # values recorded under autocast, upcast exactly
        calls = [float32_calls(call) for call in calls]
    terms = rule.terms(module, calls, views, strategy)
    terms.kind = type(module).__name__
    return terms
