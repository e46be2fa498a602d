"""``nn.MultiheadAttention`` as it is (no replacement class): its parameters are four
projections, Linear maps on every position, with the attention between them.

The tape records each call whole. The rule recomputes the attention core alone from the
projected queries, keys and values (``F.multi_head_attention_forward`` with identity
projections, so masks and scaling are PyTorch's own) and backpropagates the output gradient
through it: that gives each projection's input and output gradient, and the dense rule
(:mod:`~dpvision.per_example.layers.dense`: ghost norms or materialised, book-keeping sum)
takes it from there. Self-attention (one tensor as query, key and value) treats the packed
input projection as one Linear. Options outside this (``add_bias_kv``, ``add_zero_attn``,
unbatched inputs) go to the ``torch.func`` per-layer rule. Attention dropout is refused:
its mask cannot be replayed per example. This covers ``nn.TransformerEncoderLayer`` and
``nn.TransformerDecoderLayer``, whose other layers have rules of their own.
"""

import inspect
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.per_example.layers.base import Call, LayerTerms, Strategy, register_rule
from dpvision.per_example.layers.dense import DenseTerms
from dpvision.per_example.layers.functional import FunctionalTerms

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _check(module: nn.Module) -> str | None:
    assert isinstance(module, nn.MultiheadAttention)
    if not module.batch_first:
        return "MultiheadAttention with batch_first=False (the examples must come first)"
    if module.dropout > 0:
        return (
            f"MultiheadAttention with dropout={module.dropout} (attention dropout cannot be "
            "replayed per example); set its dropout attribute to 0.0 (in a "
            "TransformerEncoderLayer: layer.self_attn.dropout = 0.0)"
        )
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _projection(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A stand-in Linear for the dense rule (it reads ``weight`` and ``bias`` only)."""
    return cast(nn.Module, SimpleNamespace(weight=weight, bias=bias))


class AttentionTerms(LayerTerms):
    """MultiheadAttention: its projections through the dense rule."""

    def __init__(self, module: nn.Module, calls: list[Call], views: int, strategy: Strategy):
        assert isinstance(module, nn.MultiheadAttention)
        self.module = module
        e = module.embed_dim
        packed = module.in_proj_weight
        weights = (
            list(packed.split(e))
            if packed is not None
            else [module.q_proj_weight, module.k_proj_weight, module.v_proj_weight]
        )
        bias = module.in_proj_bias
        biases = list(bias.split(e)) if bias is not None else [None] * 3
        self_attention = packed is not None and all(self._self_attention(c) for c in calls)
        in_calls: list[list[Call]] = [[], [], []]
        out_calls: list[Call] = []
        for (args, kwargs), grads in calls:
            inputs, grads_qkv, core = self._backward(args, kwargs, grads, weights, biases)
            out_calls.append((core, grads[0]))
            if self_attention:
                in_calls[0].append((inputs[0], torch.cat(grads_qkv, -1)))
            else:
                for block, x, g in zip(in_calls, inputs, grads_qkv, strict=True):
                    block.append((x, g))
        out_proj = module.out_proj
        self.parts: list[tuple[dict[str, str], LayerTerms]] = [
            (
                {"weight": "out_proj.weight", "bias": "out_proj.bias"},
                DenseTerms(out_proj, out_calls, views, strategy),
            )
        ]
        if self_attention:
            assert packed is not None
            names = {"weight": "in_proj_weight", "bias": "in_proj_bias"}
            terms = DenseTerms(_projection(packed, bias), in_calls[0], views, strategy)
            self.parts.append((names, terms))
        else:
            names_of = ["q", "k", "v"]
            for i, (w, b, block) in enumerate(zip(weights, biases, in_calls, strict=True)):
                name = "in_proj_weight" if packed is not None else f"{names_of[i]}_proj_weight"
                terms = DenseTerms(_projection(w, b), block, views, strategy)
                self.parts.append(({"weight": f"{name}#{i}", "bias": f"in_proj_bias#{i}"}, terms))
        self.sq_norms = sum(  # type: ignore[assignment]
            (terms.sq_norms for _, terms in self.parts[1:]), self.parts[0][1].sq_norms
        )

    @staticmethod
    def _self_attention(call: Call) -> bool:
        (args, kwargs), _ = call
        bound = _SIGNATURE.bind(None, *args, **kwargs)
        q, k, v = (bound.arguments.get(n) for n in ("query", "key", "value"))
        return _same(q, k) and _same(k, v)

    def _backward(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        grads: dict[int, torch.Tensor],
        weights: list[torch.Tensor],
        biases: list[torch.Tensor | None],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """(q, k, v inputs), their projections' output gradients, and the attention core
        (out_proj's input), for one call."""
        module = self.module
        bound = _SIGNATURE.bind(None, *args, **kwargs)
        bound.apply_defaults()
        options = bound.arguments
        inputs = [options["query"], options["key"], options["value"]]
        with torch.no_grad():
            projected = [F.linear(x, w, b) for x, w, b in zip(inputs, weights, biases, strict=True)]
        projected = [p.requires_grad_() for p in projected]
        want_weights = 1 in grads
        with torch.enable_grad():
            masked = any(options[name] is not None for name in ("attn_mask", "key_padding_mask"))
            if want_weights or masked or options["is_causal"]:
                core, attention = self._core_with_masks(projected, options, want_weights)
            else:  # no masks, no weights: the core alone, as PyTorch runs it then
                heads = [p.unflatten(-1, (module.num_heads, -1)).transpose(1, 2) for p in projected]
                core = F.scaled_dot_product_attention(*heads).transpose(1, 2).flatten(2)
            outputs = [core]
            cotangents = [grads[0] @ module.out_proj.weight.detach()]
            if want_weights:
                outputs.append(attention)
                cotangents.append(grads[1])
            found = torch.autograd.grad(outputs, projected, cotangents, allow_unused=True)
        grads_qkv = [
            torch.zeros_like(p) if g is None else g for p, g in zip(projected, found, strict=True)
        ]
        return inputs, grads_qkv, core.detach()

    def _core_with_masks(
        self, projected: list[torch.Tensor], options: dict[str, Any], want_weights: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention core and its weights by PyTorch's own function (its mask merging
        and weight averaging), with identity projections."""
        module = self.module
        e = module.embed_dim
        eye = torch.eye(e, dtype=projected[0].dtype, device=projected[0].device)
        core, attention = F.multi_head_attention_forward(
            *(p.transpose(0, 1) for p in projected),
            e,
            module.num_heads,
            None,
            None,
            None,
            None,
            False,
            0.0,
            eye,
            None,
            training=False,
            key_padding_mask=options["key_padding_mask"],
            need_weights=want_weights,
            attn_mask=options["attn_mask"],
            use_separate_proj_weight=True,
            q_proj_weight=eye,
            k_proj_weight=eye,
            v_proj_weight=eye,
            average_attn_weights=options["average_attn_weights"],
            is_causal=options["is_causal"],
        )
        return core.transpose(0, 1), attention

    def clipped_sum(
        self, scale: torch.Tensor, drop: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        blocks: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for names, terms in self.parts:
            for local, value in terms.clipped_sum(scale, drop).items():
                name = names[local]
                if "#" in name:  # one block of a packed parameter
                    base, index = name.split("#")
                    blocks.setdefault(base, []).append((int(index), value))
                else:
                    out[name] = value
        for base, parts in blocks.items():
            if base == "in_proj_weight" or base == "in_proj_bias":
                out[base] = torch.cat([value for _, value in sorted(parts, key=lambda p: p[0])])
            else:
                out[base] = parts[0][1]
        return out


def _supported_fast(module: nn.MultiheadAttention, calls: list[Call]) -> bool:
    if module.bias_k is not None or module.bias_v is not None or module.add_zero_attn:
        return False
    for (args, kwargs), _ in calls:
        query = _SIGNATURE.bind(None, *args, **kwargs).arguments["query"]
        if query.dim() != 3:
            return False
    return True


@register_rule(nn.MultiheadAttention, check=_check, unit=True)
def attention_terms(
    module: nn.Module, calls: list[Call], views: int, strategy: Strategy
) -> LayerTerms:
    """The projection rule where it applies, else torch.func on the layer."""
    assert isinstance(module, nn.MultiheadAttention)
    if _supported_fast(module, calls):
        return AttentionTerms(module, calls, views, strategy)
    return FunctionalTerms(module, calls, views, strategy)
