"""The secure noise mode: randomness from the operating system's CSPRNG.

dpvision's default noise comes from seeded pseudo-random generators (reproducible runs),
as in jax_privacy and Opacus without ``secure_mode``. Against an adversary who could learn
or predict the generator's state, or who exploits the floating-point gaps of a textbook
Gaussian sampler (Mironov, CCS 2012; Jin et al., IEEE S&P 2022), that is not enough. In
secure mode:

* every random bit comes from ``os.urandom`` (``getrandom(2)`` on Linux: the kernel's
  ChaCha20 CSPRNG), never from a seed, and nothing of it can be saved or replayed;
* a standard normal is the sum of four Box–Muller normals divided by two (same
  distribution, N(0, 1)): summing independent draws fills the gaps between the values one
  floating-point draw can take, the mitigation of Holohan & Braghin (2021) that Opacus's
  ``secure_mode`` also uses, computed in float64 from 53-bit uniforms;
* Poisson sampling draws its uniforms from the same source.

It is slower (about 32 random bytes a noise value) and not reproducible. The ledger marks
every release made with it (``noise_source = "secure"``).

>>> rng = SecureRandom()
>>> draws = rng.standard_normal(100_000)
>>> bool(abs(draws.mean()) < 0.02 and abs(draws.std() - 1) < 0.02)
True
"""

import os

import numpy as np

#: Box–Muller normals summed into one secure normal (their sum is divided by √DRAWS).
DRAWS = 4


class SecureRandom:
    """Uniforms and standard normals from the operating system's CSPRNG.

    Pass it wherever dpvision takes a noise ``generator`` (``release_gaussian``, the DP-SGD
    step, the learners' fits); :class:`~dpvision.mechanisms.PoissonSampler` takes it as
    ``rng``. It has no state to save: ``state_dict`` is empty and a resumed run continues
    with fresh randomness (the same privacy, not the same numbers).
    """

    def uniform(self, count: int) -> np.ndarray:
        """``count`` float64 uniforms on (0, 1): (k + ½)/2⁵³ for k of 53 random bits."""
        bits = np.frombuffer(bytearray(os.urandom(8 * int(count))), dtype=np.uint64)
        bits >>= np.uint64(11)
        out = bits.astype(np.float64)
        out += 0.5
        out *= 2.0**-53
        return out

    def standard_normal(self, count: int) -> np.ndarray:
        """``count`` float64 N(0, 1) values, each the sum of :data:`DRAWS` Box–Muller normals
        over √DRAWS."""
        pairs = (DRAWS * int(count) + 1) // 2
        radius = np.sqrt(-2.0 * np.log(self.uniform(pairs)))
        angle = 2.0 * np.pi * self.uniform(pairs)
        normals = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])
        summed: np.ndarray = normals[: DRAWS * int(count)].reshape(DRAWS, int(count)).sum(0)
        summed /= np.sqrt(DRAWS)
        return summed

    def state_dict(self) -> dict[str, object]:
        """Nothing: a CSPRNG has no state to save or replay."""
        return {}

    def __repr__(self) -> str:
        return "SecureRandom(os.urandom)"


def noise_source(generator: object) -> str:
    """``"secure"`` for a :class:`SecureRandom`, else ``"pseudo-random"`` (what the ledger
    records of the noise a release drew)."""
    return "secure" if isinstance(generator, SecureRandom) else "pseudo-random"
