"""White-box gradient canaries of the one-run audit of DP-SGD."""

import dataclasses

import numpy as np
import torch

from dpvision.mechanisms import clipping
from dpvision.mechanisms.clip_policy import ClipPolicy


@dataclasses.dataclass
class GradientCanaries:
    """White-box canaries of DP-SGD: canary i is an example whose gradient is
    ``scale``·C·e in the flat parameter coordinate ``coordinates[i]``, in the training set
    iff ``included[i]``; each step it joins the Poisson batch with probability q and its
    gradient is clipped by :func:`~dpvision.mechanisms.clipping.clip_factors`, as every
    example's is.

    Attributes:
      coordinates: (m,) flat indices into the parameters, in ``named_parameters`` order.
      included: (m,) bool.
      scale: the canary gradient's norm in units of C.
      seed: seeds the canaries' Poisson draws.
    """

    coordinates: np.ndarray
    included: np.ndarray
    scale: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        self._draws = np.random.default_rng(self.seed)

    def add_to(
        self,
        sums: dict[str, torch.Tensor],
        sample_rate: float,
        policy: ClipPolicy,
    ) -> None:
        """Adds the clipped gradients of the canaries drawn into this step's batch to the
        (one run's) clipped sums ``sums`` (name → (1, ...)), in place; a canary is clipped
        to the policy's bound on its parameter (C_g of its layer, per layer)."""
        drawn = self.included & (self._draws.random(len(self.included)) < sample_rate)
        offset = 0
        for name, value in sums.items():
            bound = policy.bound(name)
            norm = torch.tensor([self.scale * bound], dtype=torch.float64)
            size = float(clipping.clip_factors(norm, bound)[0]) * self.scale * bound
            flat = value.view(-1)
            mine = self.coordinates[drawn]
            mine = mine[(mine >= offset) & (mine < offset + flat.numel())] - offset
            flat[torch.as_tensor(mine, dtype=torch.long, device=flat.device)] += size
            offset += flat.numel()
