"""Poisson sampling: each example joins each batch independently with probability q.

This is the sampling the Poisson-sampled Gaussian accountant assumes. Batch sizes are
therefore random, Binomial(n, q), mean qn and variance q(1 − q)n, and a batch may be empty
(an empty batch still gets its noise). Shuffled fixed-size batches, which seeds 003 and 004
used while accounting as if Poisson, are *not* offered.
"""

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from dpvision.accounting._checks import check_sample_rate, check_steps
from dpvision.errors import DPVisionError
from dpvision.mechanisms.secure import SecureRandom


class PoissonSampler:
    """Yields, for each of ``steps`` steps, the indices of a Poisson-sampled batch.

    Draw t takes its uniforms from its own stream, seeded by (``seed``, t): example i's coin
    at draw t does not depend on how many examples follow it, so a dataset with one example
    appended keeps every other example's batches (the coins are i.i.d. either way). The
    state (seed and draw count) can be saved and restored (``state_dict`` /
    ``load_state_dict``), so a run resumed from a checkpoint draws exactly the batches an
    uninterrupted run would. ``seed`` must be secret (a stream of the run's
    :class:`~dpvision.mechanisms.secret.SecretRandomness`); ``None``: 128 fresh OS bits.

    Examples:
      >>> sampler = PoissonSampler(num_examples=10, sample_rate=0.5, steps=3, seed=0)
      >>> [len(batch) for batch in sampler]
      [3, 3, 9]
    """

    def __init__(
        self,
        *,
        num_examples: int,
        sample_rate: float,
        steps: int,
        seed: int | None = None,
        secure: bool = False,
    ) -> None:
        if int(num_examples) != num_examples or num_examples < 1:
            raise DPVisionError(f"num_examples must be a whole number >= 1, got {num_examples}")
        self.num_examples = int(num_examples)
        self.sample_rate = check_sample_rate(sample_rate)
        self.steps = check_steps(steps)
        self.step = 0
        self.secure = bool(secure)
        # Secure mode: the uniforms come from the OS CSPRNG (no seed, nothing to replay).
        self._seed = int.from_bytes(os.urandom(16), "little") if seed is None else int(seed)
        self._draws = 0
        self._secure = SecureRandom() if secure else None

    @property
    def expected_batch_size(self) -> float:
        """qn: the public constant a clipped sum is divided by (never the realised size)."""
        return self.sample_rate * self.num_examples

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[np.ndarray]:
        while self.step < self.steps:
            self.step += 1
            yield self.sample()

    def sample(self) -> np.ndarray:
        """One batch: the sorted indices i with Uᵢ < q, for fresh uniforms Uᵢ."""
        if self.sample_rate == 1.0:
            return np.arange(self.num_examples)
        if self._secure is not None:
            uniforms = self._secure.uniform(self.num_examples)
        else:
            uniforms = np.random.default_rng([self._seed, self._draws]).random(self.num_examples)
        self._draws += 1
        return np.flatnonzero(uniforms < self.sample_rate)

    def state_dict(self) -> dict[str, Any]:
        """The step, the secret seed and the draws made (none in secure mode: nothing to
        replay). Private: it replays the batches; kept in checkpoints only."""
        if self.secure:
            return {"step": self.step, "secure": True}
        return {"step": self.step, "seed": self._seed, "draws": self._draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the step (and the generator, when not secure: the same batches follow)."""
        if bool(state.get("secure", False)) != self.secure:
            raise DPVisionError(
                "the checkpoint was written with another noise mode (secure_mode): resume "
                "with the same one"
            )
        self.step = int(state["step"])
        if not self.secure:
            self._seed, self._draws = int(state["seed"]), int(state["draws"])
