"""Per-example clipped gradient sums: Σᵢ clip(gᵢ, C), the quantity DP-SGD releases.

* :mod:`dpvision.per_example.reference` — the ``torch.func`` reference: every gᵢ with
  ``vmap(grad(...))``; any model, B × parameters memory.
* :mod:`dpvision.per_example.bookkeeping` — book-keeping (Bu et al.): per-example norms from
  layer activations and output gradients, then one weighted backward pass; no gᵢ is
  materialised.
* :mod:`dpvision.per_example.layers` — the per-layer rules book-keeping uses.
* :mod:`dpvision.per_example.batch_layout` — probes that each layer sees one row per example.
* :mod:`dpvision.per_example.precision` — :func:`exact_arithmetic`: the norms and the clipped
  sums in IEEE float32 whatever the user's TF32, matmul-precision and autocast settings, so
  that each clip factor bounds the contribution it scales.

:func:`clip_and_sum` chooses among them (``method = auto | bookkeeping | vmap``); all give
the same clipped sum, of the L2 sensitivity its clip policy states
(:mod:`dpvision.mechanisms.clip_policy`: C, or √(Σ C_g²) when clipped per layer). The clip
norms (:mod:`dpvision.mechanisms.groups`, ``GroupNorms``, ``per_layer``) and the sum itself
(``ClippedGradientSum``) live in :mod:`dpvision.mechanisms`, below, and are re-exported here.
"""

from dpvision.mechanisms.clipped_sum import ClippedGradientSum
from dpvision.mechanisms.groups import GroupNorms, per_layer
from dpvision.per_example.bookkeeping import (
    ClippingMethod,
    bookkeeping_clipped_gradient_sum,
    clip_and_sum,
    supports_bookkeeping,
)
from dpvision.per_example.layers import LayerTerms, register_rule
from dpvision.per_example.precision import exact_arithmetic
from dpvision.per_example.reference import clipped_gradient_sum, functional_clipped_sum

CLIPPING_METHODS = tuple(method.value for method in ClippingMethod)

__all__ = [
    "CLIPPING_METHODS",
    "ClippedGradientSum",
    "ClippingMethod",
    "GroupNorms",
    "LayerTerms",
    "bookkeeping_clipped_gradient_sum",
    "clip_and_sum",
    "clipped_gradient_sum",
    "exact_arithmetic",
    "functional_clipped_sum",
    "per_layer",
    "register_rule",
    "supports_bookkeeping",
]
