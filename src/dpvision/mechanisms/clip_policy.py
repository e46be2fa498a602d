"""Clip policies: how each example's gradient is bounded, and what a step releases with it.

Every DP-SGD trainer of dpvision (the ``dpvision train`` step, the Opacus-style
:class:`~dpvision.privacy_engine.DPOptimizer`, the linear head of
:class:`~dpvision.learners.DPSGDLinear`) takes one policy, and this is the only module that
tells them apart:

* :class:`FlatClip` — each example's whole gradient clipped to C (Abadi et al.);
* :class:`PerLayerClip` — each layer's part clipped to its own C_g
  (:mod:`dpvision.mechanisms.groups`; Opacus ``clipping="per_layer"``), sensitivity
  √(Σ C_g²);
* :class:`AdaptiveClip` — C follows a quantile of the per-example norms, estimated privately
  every step (:mod:`dpvision.mechanisms.adaptive_clipping`; Opacus ``clipping="adaptive"``).

A policy gives the clipping kernels their clip factors (:meth:`ClipPolicy.factors`), the
clipped sum its sensitivity, the noise its multiplier, and the ledger its entry
(:meth:`ClipPolicy.record`), so a trainer is the same code for all three.
:func:`make_clip_policy` builds one from the names users type, with the defaults in one place.

>>> policy = make_clip_policy("adaptive", 1.0, expected_batch_size=100.0)
>>> policy.name, policy.max_grad_norm, round(policy.noise_multiplier(1.0), 4)
('adaptive', 1.0, 1.0206)
"""

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from dpvision.accounting import PrivacyLedger
from dpvision.distributed import Workers
from dpvision.errors import DPVisionError
from dpvision.mechanisms import clipping as clip_rule  # the module: patchable, as audits do
from dpvision.mechanisms.adaptive_clipping import AdaptiveClipping
from dpvision.mechanisms.groups import GroupNorms, group_of, per_layer
from dpvision.mechanisms.noise import NoiseGenerator
from dpvision.mechanisms.secure import noise_source

__all__ = [
    "ADAPTIVE_DEFAULTS",
    "ADAPTIVE_OPTIONS",
    "CLIP_POLICIES",
    "AdaptiveClip",
    "ClipPolicy",
    "FlatClip",
    "PerLayerClip",
    "adaptive_options",
    "make_clip_policy",
    "resolve_policy",
]

CLIP_POLICIES = ("flat", "per_layer", "adaptive")
"""The policies' names, as Opacus spells them (``per-layer`` is accepted too)."""

ADAPTIVE_DEFAULTS: dict[str, float] = {
    "target_unclipped_quantile": 0.5,
    "clipbound_learning_rate": 0.2,
    "min_clipbound": 1e-6,
    "max_clipbound": 1e6,
}
"""Adaptive clipping's defaults (Opacus' names and values); the noise on the unclipped count,
``unclipped_num_std``, defaults to the expected batch size over
:data:`COUNT_NOISE_DIVISOR` (Andrew et al.)."""

COUNT_NOISE_DIVISOR = 20.0

ADAPTIVE_OPTIONS = (*ADAPTIVE_DEFAULTS, "unclipped_num_std")
"""The keywords of adaptive clipping that :func:`make_clip_policy` takes (Opacus' names)."""


def adaptive_options(source: object) -> dict[str, float | None]:
    """:data:`ADAPTIVE_OPTIONS` read off an options object or estimator that has them all as
    attributes, for :func:`make_clip_policy`."""
    return {name: getattr(source, name) for name in ADAPTIVE_OPTIONS}


# (group, squared per-example norms of a part of that group), computed only if asked for.
Parts = Callable[[], Iterable[tuple[str, torch.Tensor]]]


class ClipPolicy(Protocol):
    """What a DP-SGD step needs to know of its clipping.

    Attributes:
      name: ``flat``, ``per_layer`` or ``adaptive``.
    """

    name: str

    @property
    def max_grad_norm(self) -> float:
        """C of this step (√(Σ C_g²) per layer; C_t when adaptive)."""
        ...

    @property
    def l2_sensitivity(self) -> float:
        """How far one example moves this step's clipped sum (all parameters together)."""
        ...

    @property
    def adapted_clip(self) -> float | None:
        """The clip norm the policy has learned from its releases (None: fixed norms)."""
        ...

    def group(self, name: str) -> str:
        """The group whose clip norm bounds parameter ``name`` (flat: one group, ``""``)."""
        ...

    def bound(self, name: str) -> float:
        """The clip norm of parameter ``name``'s group (C, C_g or C_t)."""
        ...

    def factors(
        self, norms: torch.Tensor, parts: Parts, keep: torch.Tensor
    ) -> Mapping[str, torch.Tensor]:
        """Per-example clip factors of each group, from the whole norms ``norms`` or the
        groups' squared norms ``parts``; zero where ``keep`` is false or a norm is not
        finite."""
        ...

    def noise_multiplier(self, sigma: float) -> float:
        """The clipped sum's noise multiplier when the step's is ``sigma``."""
        ...

    def observe(self, norms: torch.Tensor) -> None:
        """Takes in the per-example norms of a part of the logical batch (private)."""
        ...

    def discard(self) -> None:
        """Forgets what :meth:`observe` took in since the last release (nothing released)."""
        ...

    def record(
        self,
        ledger: PrivacyLedger,
        *,
        noise_multiplier: float,
        sample_rate: float,
        expected_batch_size: float,
        released: str,
        generator: NoiseGenerator,
        workers: Workers,
    ) -> None:
        """Releases what the policy adds to the step, then records the step in ``ledger``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The policy's state, for checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`."""
        ...


class _Stateless(abc.ABC):
    """What flat and per-layer clipping share: no private state between steps."""

    name: str
    adapted_clip: float | None = None  # fixed norms

    @property
    @abc.abstractmethod
    def l2_sensitivity(self) -> float:
        """The clip norms' joint bound (each subclass states its own)."""

    def noise_multiplier(self, sigma: float) -> float:
        """σ itself: the clipped sum is the step's only release."""
        return sigma

    def observe(self, norms: torch.Tensor) -> None:
        """Nothing to take in."""
        return None

    def discard(self) -> None:
        """Nothing to forget."""
        return None

    def record(
        self,
        ledger: PrivacyLedger,
        *,
        noise_multiplier: float,
        sample_rate: float,
        expected_batch_size: float,
        released: str,
        generator: NoiseGenerator,
        workers: Workers,
    ) -> None:
        """Records the clipped sum's release (sensitivity :attr:`l2_sensitivity`).

        Privacy:
          Releases nothing more; the entry is one Gaussian step of multiplier
          ``noise_multiplier`` at rate q, written after the noise was drawn.
        """
        if noise_multiplier > 0:
            ledger.record(
                noise_multiplier=noise_multiplier,
                sample_rate=sample_rate,
                l2_sensitivity=self.l2_sensitivity,
                released=released,
                noise_source=noise_source(generator),
            )
        else:
            ledger.record_non_private(released=f"{released} without noise")

    def state_dict(self) -> dict[str, Any]:
        """Nothing to keep."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""
        return None


class FlatClip(_Stateless):
    """Each example's whole gradient clipped to C: cᵢ = min(1, C/‖gᵢ‖).

    Privacy:
      The clipped sum has L2 sensitivity C under add/remove-one.
    """

    name = "flat"

    def __init__(self, max_grad_norm: float) -> None:
        if not max_grad_norm > 0:
            raise DPVisionError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        self.clip = float(max_grad_norm)

    @property
    def max_grad_norm(self) -> float:
        """C."""
        return self.clip

    @property
    def l2_sensitivity(self) -> float:
        """C."""
        return self.clip

    def group(self, name: str) -> str:
        """One group for every parameter."""
        return ""

    def bound(self, name: str) -> float:
        """C."""
        return self.clip

    def factors(
        self, norms: torch.Tensor, parts: Parts, keep: torch.Tensor
    ) -> Mapping[str, torch.Tensor]:
        """min(1, C/‖gᵢ‖) for the one group (releases nothing)."""
        return {"": clip_rule.clip_factors(norms, self.clip, keep)}


class PerLayerClip(_Stateless):
    """Each layer's part of an example's gradient clipped to its own C_g.

    Privacy:
      The clipped sum has L2 sensitivity √(Σ_g C_g²) under add/remove-one.
    """

    name = "per_layer"

    def __init__(self, groups: GroupNorms) -> None:
        self.groups = groups

    @property
    def max_grad_norm(self) -> float:
        """√(Σ_g C_g²)."""
        return self.groups.l2_sensitivity

    @property
    def l2_sensitivity(self) -> float:
        """√(Σ_g C_g²)."""
        return self.groups.l2_sensitivity

    def group(self, name: str) -> str:
        """The layer owning parameter ``name``."""
        return group_of(name)

    def bound(self, name: str) -> float:
        """C_g of the layer owning parameter ``name``."""
        return self.groups.norm(group_of(name))

    def factors(
        self, norms: torch.Tensor, parts: Parts, keep: torch.Tensor
    ) -> Mapping[str, torch.Tensor]:
        """min(1, C_g/‖g_{i,g}‖) for every group (releases nothing)."""
        sq_by_group: dict[str, torch.Tensor] = {}
        for group, sq in parts():
            sq_by_group[group] = sq_by_group[group] + sq if group in sq_by_group else sq
        return self.groups.factors(sq_by_group, keep)


class AdaptiveClip:
    """Flat clipping at C_t, C_t following a quantile of the per-example norms (Andrew et al.).

    Each step also releases the number of the batch's examples whose norm was at most C_t,
    with noise σ_b, and σ is split between the sum (σ_s) and that count.

    Privacy:
      The clipped sum has sensitivity C_t; with the count (sensitivity 1) it is one Gaussian
      release of the step's multiplier σ (:mod:`dpvision.mechanisms.adaptive_clipping`),
      recorded once by :meth:`record`. The count :meth:`observe` accumulates is exact and
      private: only its noisy release is ever used.
    """

    name = "adaptive"

    def __init__(self, adaptive: AdaptiveClipping) -> None:
        self.adaptive = adaptive
        self._count = torch.zeros((), dtype=torch.float64)

    @property
    def max_grad_norm(self) -> float:
        """C_t."""
        return self.adaptive.clip

    @property
    def l2_sensitivity(self) -> float:
        """C_t."""
        return self.adaptive.clip

    @property
    def adapted_clip(self) -> float | None:
        """C_t, post-processing of the noisy counts."""
        return self.adaptive.clip

    def group(self, name: str) -> str:
        """One group for every parameter."""
        return ""

    def bound(self, name: str) -> float:
        """C_t."""
        return self.adaptive.clip

    def factors(
        self, norms: torch.Tensor, parts: Parts, keep: torch.Tensor
    ) -> Mapping[str, torch.Tensor]:
        """min(1, C_t/‖gᵢ‖) for the one group (releases nothing)."""
        return {"": clip_rule.clip_factors(norms, self.adaptive.clip, keep)}

    def noise_multiplier(self, sigma: float) -> float:
        """σ_s: the sum's share of σ (the count takes the rest)."""
        return self.adaptive.sum_noise_multiplier(sigma)

    def observe(self, norms: torch.Tensor) -> None:
        """Adds the number of ``norms`` at most C_t to the step's count (exact, private)."""
        self._count = self._count.to(norms.device) + self.adaptive.unclipped(norms)

    def discard(self) -> None:
        """Forgets the count of an unfinished step."""
        self._count = torch.zeros((), dtype=torch.float64)

    def record(
        self,
        ledger: PrivacyLedger,
        *,
        noise_multiplier: float,
        sample_rate: float,
        expected_batch_size: float,
        released: str,
        generator: NoiseGenerator,
        workers: Workers,
    ) -> None:
        """Releases the count (all ranks' shares summed) with noise σ_b, moves C, and records
        the sum and the count as one Gaussian release of multiplier ``noise_multiplier``.

        Privacy: see the class docstring; the entry is written after both noises are drawn.
        """
        count, self._count = self._count, torch.zeros((), dtype=torch.float64)
        workers.all_reduce_([count])
        self.adaptive.release(
            count,
            sigma=noise_multiplier,
            sample_rate=sample_rate,
            expected_batch_size=expected_batch_size,
            ledger=ledger,
            generator=generator,
            released=released,
        )

    def state_dict(self) -> dict[str, Any]:
        """C_t."""
        return self.adaptive.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores C_t."""
        self.adaptive.load_state_dict(state)


def make_clip_policy(
    clipping: str,
    max_grad_norm: float | Sequence[float],
    *,
    expected_batch_size: float,
    model: nn.Module | None = None,
    target_unclipped_quantile: float | None = None,
    clipbound_learning_rate: float | None = None,
    unclipped_num_std: float | None = None,
    min_clipbound: float | None = None,
    max_clipbound: float | None = None,
) -> ClipPolicy:
    """The policy ``clipping`` names (``flat``, ``per_layer``/``per-layer``, ``adaptive``).

    Args:
      clipping: the policy's name.
      max_grad_norm: C; per layer also one norm per layer with trainable parameters (a
        number C gives each of the G layers C/√G: the sensitivity stays C); adaptive: C₀.
      expected_batch_size: qN, the default of ``unclipped_num_std`` is qN/20.
      model: the model whose layers ``per_layer`` clips (required for it).
      target_unclipped_quantile: adaptive only, γ (None: :data:`ADAPTIVE_DEFAULTS`, as the
        options below).
      clipbound_learning_rate: adaptive only, η of the geometric update of C.
      unclipped_num_std: adaptive only, σ_b of the count (None: qN/20).
      min_clipbound: adaptive only, the lower bound on C.
      max_clipbound: adaptive only, the upper bound on C.

    Raises:
      DPVisionError: an unknown name, or options that do not fit it (one line).
    """
    kind = clipping.replace("-", "_")
    if kind not in CLIP_POLICIES:
        raise DPVisionError(
            f"unknown clipping {clipping!r}; choose one of: {', '.join(CLIP_POLICIES)}"
        )
    if kind == "per_layer":
        if model is None:
            raise DPVisionError("per-layer clipping needs the model")
        return PerLayerClip(per_layer(model, max_grad_norm))
    if not isinstance(max_grad_norm, int | float):
        raise DPVisionError(
            f"{kind} clipping takes one max_grad_norm, got {len(list(max_grad_norm))} norms "
            "(several norms are for clipping='per_layer')"
        )
    if kind == "flat":
        return FlatClip(float(max_grad_norm))
    options = {
        "target_unclipped_quantile": target_unclipped_quantile,
        "clipbound_learning_rate": clipbound_learning_rate,
        "min_clipbound": min_clipbound,
        "max_clipbound": max_clipbound,
    }
    given = {
        key: ADAPTIVE_DEFAULTS[key] if value is None else value for key, value in options.items()
    }
    count_noise = (
        expected_batch_size / COUNT_NOISE_DIVISOR
        if unclipped_num_std is None
        else unclipped_num_std
    )
    return AdaptiveClip(
        AdaptiveClipping(
            initial=float(max_grad_norm),
            count_noise=float(count_noise),
            target_quantile=given["target_unclipped_quantile"],
            learning_rate=given["clipbound_learning_rate"],
            min_clip=given["min_clipbound"],
            max_clip=given["max_clipbound"],
        )
    )


def resolve_policy(
    max_grad_norm: float | None, groups: GroupNorms | None, policy: ClipPolicy | None
) -> ClipPolicy:
    """The policy of a clipping kernel's arguments: ``policy``, or flat clipping at
    ``max_grad_norm``, or per-layer clipping by ``groups`` (exactly one of the three).

    Raises:
      DPVisionError: none or several of them are given.
    """
    if policy is not None:
        if max_grad_norm is not None or groups is not None:
            raise DPVisionError("pass either a clip policy or max_grad_norm/groups, not both")
        return policy
    if groups is not None:  # the groups' norms replace C
        return PerLayerClip(groups)
    if max_grad_norm is None:
        raise DPVisionError("pass max_grad_norm, groups or a clip policy")
    return FlatClip(float(max_grad_norm))
