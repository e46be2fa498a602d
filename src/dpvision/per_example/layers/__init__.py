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

Supported: ``nn.Linear``, ``nn.Conv2d`` (zeros padding, ``groups=1``), ``WSConv2d``
(gradients mapped through the weight standardisation to the raw weight and the gain), and
the layers whose per-example gradients are small and formed directly: affine
``nn.GroupNorm``, ``nn.LayerNorm`` (any leading shape), ``nn.InstanceNorm1d/2d/3d``
(without running statistics) and ``nn.PReLU``; and ``nn.Embedding``, by a ghost sum over
each example's tokens. An example's K augmented views are grouped
as one example: its activations have K·T positions.
"""

from torch import nn

# Importing the rule modules registers their layer types.
from dpvision.per_example.layers import (
    dense,
    embedding,
    group_norm,
    instance_norm,
    layer_norm,
    prelu,
)
from dpvision.per_example.layers.base import (
    MATERIALISE_BYTES,
    RULES,
    Call,
    LayerTerms,
    Rule,
    Strategy,
    register_rule,
    sum_calls,
)

__all__ = [
    "MATERIALISE_BYTES",
    "RULES",
    "Call",
    "LayerTerms",
    "Rule",
    "Strategy",
    "dense",
    "embedding",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "layer_terms",
    "prelu",
    "register_rule",
    "sum_calls",
    "unsupported_reason",
]


def unsupported_reason(module: nn.Module) -> str | None:
    """Why book-keeping cannot handle ``module``'s own trainable parameters, or None.

    Only parameters held directly by ``module`` count (children are checked on their own).
    """
    own = [name for name, p in module.named_parameters(recurse=False) if p.requires_grad]
    if not own:
        return None
    rule = RULES.get(type(module))
    if rule is None:
        return f"{type(module).__name__} with trainable parameters {', '.join(own)}"
    return rule.check(module)


def layer_terms(
    module: nn.Module, calls: list[Call], views: int, strategy: Strategy = "auto"
) -> LayerTerms:
    """Per-example terms of ``module`` from the inputs and output gradients of its calls.

    Args:
      module: a layer that :func:`unsupported_reason` accepts.
      calls: (input, output gradient) of every call of ``module`` in the forward pass (more
        than one when the layer is shared); leading dimension B·K.
      views: K, the number of consecutive rows that belong to one example.
      strategy: ``ghost`` or ``materialise`` to force the norm computation (tests).
    """
    return RULES[type(module)].terms(module, calls, views, strategy)
