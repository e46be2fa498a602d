"""The value a DP-SGD release consumes: Σᵢ clip(gᵢ) per parameter, with its stated sensitivity.

Every clipping kernel (:mod:`dpvision.per_example`, the linear head of
:class:`~dpvision.learners.DPSGDLinear`) returns a :class:`ClippedGradientSum`, and every
release (:mod:`dpvision.mechanisms.gradient_release`) scales its noise to the sensitivity the
sum states, never to a separately typed C.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dpvision.errors import DPVisionError


@dataclass
class ClippedGradientSum:
    """Σᵢ clip(gᵢ, C) per parameter name, with what the privacy argument needs to know.

    Attributes:
      grads: parameter name → summed clipped gradient (the parameter's shape).
      l2_sensitivity: C; adding or removing one example moves ``grads`` (all parameters
        together) by at most this much in L2 norm.
      count: examples that contributed (mask true).
      nonfinite: examples whose gradient was not finite; they contribute zero.
      norms: the per-example gradient norms before clipping (B,), for diagnostics.
    """

    grads: dict[str, torch.Tensor]
    l2_sensitivity: float
    count: int
    nonfinite: int
    norms: torch.Tensor

    @classmethod
    def zeros(
        cls, params: Mapping[str, torch.Tensor], *, l2_sensitivity: float
    ) -> "ClippedGradientSum":
        """The empty sum over ``params`` (name → parameter), of the sensitivity its parts
        will state: what physical micro-batches are accumulated into."""
        like = next(iter(params.values()), None)
        return cls(
            grads={name: torch.zeros_like(p) for name, p in params.items()},
            l2_sensitivity=float(l2_sensitivity),
            count=0,
            nonfinite=0,
            norms=torch.zeros(0) if like is None else like.new_zeros(0),
        )

    def add_(self, other: "ClippedGradientSum") -> None:
        """Adds the clipped sum of other examples (disjoint from these) in place.

        Raises:
          DPVisionError: ``other`` states another sensitivity: the total's would be
            neither, and noise scaled to one of them would be wrong.
        """
        if other.l2_sensitivity != self.l2_sensitivity:
            raise DPVisionError(
                f"cannot add a clipped sum of sensitivity {other.l2_sensitivity:g} to one of "
                f"{self.l2_sensitivity:g}"
            )
        for name, value in other.grads.items():
            self.grads[name] += value
        self.count += other.count
        self.nonfinite += other.nonfinite
        self.norms = torch.cat([self.norms, other.norms.to(self.norms)])
