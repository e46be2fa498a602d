"""Public seeds: every stream derived from a run's public ``seed``, one named purpose each.

The adversary knows ``seed`` (it is published with the config), so these streams draw only
public randomness — initialisation, augmentation, the order of public rows, the audit's own
bookkeeping — never the noise, the Poisson sampling or a split's coins
(:class:`~dpvision.mechanisms.secret.SecretRandomness` draws those). Each purpose has its
own number in :data:`PURPOSES`, so no two purposes share a stream; a new purpose takes a new
number (changing one would change every run that used it).

>>> seeds = public_seeds(0, "dp-sgd run", ("init", "augment"))
>>> sorted(seeds), seeds == public_seeds(0, "dp-sgd run", ("init", "augment"))
(['augment', 'init'], True)
"""

from collections.abc import Sequence

import numpy as np

PURPOSES: dict[str, int] = {
    "phase-i pretrain": 2,
    "dp-sgd run": 4,
    "supervised pretrain": 5,
    "audit noise canary": 7,
    "one-run audit canaries": 11,
    "one-run audit order": 12,
    "one-run audit runs": 13,
    "one-run audit coins": 14,
    "one-run audit gradient draws": 15,
}
"""Each purpose's number in the seed sequence ``[seed, number]``."""


def public_sequence(seed: int, purpose: str) -> np.random.SeedSequence:
    """The seed sequence of ``purpose`` (one of :data:`PURPOSES`) under the public ``seed``."""
    return np.random.SeedSequence([seed, PURPOSES[purpose]])


def public_seeds(seed: int, purpose: str, names: Sequence[str]) -> dict[str, int]:
    """One independent 63-bit seed for each of ``names``, from ``purpose``'s sequence."""
    states = public_sequence(seed, purpose).generate_state(len(names), dtype=np.uint64)
    return {name: int(value) % 2**63 for name, value in zip(names, states, strict=True)}


def public_rng(seed: int, purpose: str) -> np.random.Generator:
    """A numpy generator on ``purpose``'s sequence."""
    return np.random.default_rng(public_sequence(seed, purpose))
