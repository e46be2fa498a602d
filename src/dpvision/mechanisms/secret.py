"""A run's secret randomness: what every guarantee rests on, apart from the public ``seed``.

The adversary of ``docs/guarantees.md`` knows the code, the config (``seed`` included) and
every byte a run publishes. Randomness drawn from ``seed`` is therefore *public*: it may
initialise weights, draw augmentations or synthetic images, never noise. Everything a
guarantee rests on — the Gaussian noise, Poisson sampling, the validation split's coins,
``tune``'s number of runs and its candidate draws — comes from a :class:`SecretRandomness`:

* by default 256 bits from ``os.urandom`` (the kernel's CSPRNG), fresh in every run
  (``source = "os"``);
* with ``secret_seed``, 256 bits derived from it, so that a researcher can replay a run
  (``source = "user-secret"``); the secret seed is never written to any output, and a
  guessable one (0, 1, 2, …) protects nothing against an adversary who guesses it;
* with ``secure_mode``, the noise and Poisson sampling draw from the OS CSPRNG itself at
  every draw (:class:`~dpvision.mechanisms.secure.SecureRandom`, ``source = "csprng"``).

Each use gets its own stream, named (``"noise"``, ``"sampler"``, ``"validation split"``,
…): the stream is a keyed BLAKE2b of its name under the 256-bit secret, so adding a stream
never shifts another, and no stream reveals the secret or another stream. Only the source
is ever published (the result's ``secret_randomness``).

>>> a, b = SecretRandomness(secret_seed=7), SecretRandomness(secret_seed=7)
>>> a.source, a.seed("noise") == b.seed("noise"), a.seed("noise") == a.seed("sampler")
('user-secret', True, False)
>>> "7" in repr(a)
False
"""

import hashlib
import os

import numpy as np
import torch

from dpvision.errors import DPVisionError
from dpvision.mechanisms.secure import SecureRandom

__all__ = ["SECRET_SOURCES", "SecretRandomness"]

SECRET_SOURCES = ("os", "user-secret", "csprng")
"""What a result's ``secret_randomness`` may say: fresh OS entropy, a user's secret seed,
or the secure mode's CSPRNG at every draw."""

_SECRET_SEED_DOMAIN = b"dpvision secret_seed v1"


def check_secret_seed(secret_seed: object) -> int | None:
    """``secret_seed`` as a whole number in [0, 2**256), or None; a one-line error otherwise."""
    if secret_seed is None:
        return None
    if isinstance(secret_seed, bool) or not isinstance(secret_seed, int):
        raise DPVisionError("secret_seed must be a whole number")
    if not 0 <= secret_seed < 2**256:
        raise DPVisionError("secret_seed must be a whole number in [0, 2**256)")
    return secret_seed


class SecretRandomness:
    """The secret randomness of one run (see the module docstring).

    Args:
      secret_seed: makes the run replayable (research); ``None`` (the default): 256 bits
        of fresh OS entropy.
      secure: the secure mode: noise and Poisson sampling from the OS CSPRNG at every draw
        (:meth:`noise` returns a :class:`~dpvision.mechanisms.secure.SecureRandom`).
        A secure run cannot be replayed, so ``secret_seed`` is then refused.
      context: what the run is (its published config, as canonical text): with a
        ``secret_seed``, runs of different configs get independent streams, so two runs
        that share a secret seed (a sweep over ε or public seeds) never share their noise;
        the same config and secret seed replay the same run.

    Privacy:
      Releases nothing: its ``repr`` and :attr:`source` never show the secret. Checkpoints
      keep :meth:`state` (they are as private as the data).
    """

    def __init__(
        self, secret_seed: int | None = None, *, secure: bool = False, context: str = ""
    ) -> None:
        secret_seed = check_secret_seed(secret_seed)
        if secure and secret_seed is not None:
            raise DPVisionError(
                "secret_seed replays a run, secure_mode draws from the OS CSPRNG and cannot be "
                "replayed: give one of them"
            )
        self.secure = bool(secure)
        self.source = "csprng" if secure else "os" if secret_seed is None else "user-secret"
        if secret_seed is None:
            self._secret = os.urandom(32)
        else:
            digest = hashlib.sha256(_SECRET_SEED_DOMAIN)
            digest.update(secret_seed.to_bytes(32, "little"))
            digest.update(context.encode())
            self._secret = digest.digest()
        self._split_key: bytes | None = None

    @classmethod
    def from_state(cls, state: dict[str, object]) -> "SecretRandomness":
        """The secret of a checkpoint (:meth:`state`), to resume a run with the same streams."""
        secret, source, split = state.get("secret"), state.get("source"), state.get("split_key")
        if not isinstance(secret, bytes) or len(secret) != 32 or source not in SECRET_SOURCES:
            raise DPVisionError("the checkpoint's secret randomness is malformed")
        out = cls.__new__(cls)
        out._secret, out.source, out.secure = secret, str(source), source == "csprng"
        out._split_key = split if isinstance(split, bytes) else None
        return out

    def state(self) -> dict[str, object]:
        """What a checkpoint keeps to resume the same streams and the same validation split
        (private: never published)."""
        return {"secret": self._secret, "source": self.source, "split_key": self.split_key()}

    def __repr__(self) -> str:
        return f"SecretRandomness(source={self.source!r})"

    def key(self, name: str) -> bytes:
        """32 secret bytes for the stream ``name`` (e.g. a keyed hash's key)."""
        return hashlib.blake2b(name.encode(), key=self._secret, digest_size=32).digest()

    def seed(self, name: str) -> int:
        """A secret 63-bit seed for the stream ``name`` (torch generators, learners'
        ``random_state``)."""
        return int.from_bytes(self.key(name)[:8], "little") % 2**63

    def numpy(self, name: str) -> np.random.Generator:
        """A NumPy generator seeded with the 256 secret bits of the stream ``name``."""
        return np.random.default_rng(int.from_bytes(self.key(name), "little"))

    def torch_generator(self, name: str, device: torch.device | str = "cpu") -> torch.Generator:
        """A torch generator on ``device`` seeded from the stream ``name``."""
        return torch.Generator(device=device).manual_seed(self.seed(name))

    def noise(
        self, name: str, device: torch.device | str = "cpu"
    ) -> torch.Generator | SecureRandom:
        """The noise generator of the stream ``name``: the CSPRNG in secure mode."""
        return SecureRandom() if self.secure else self.torch_generator(name, device)

    def child(self, name: str) -> "SecretRandomness":
        """The secret randomness of a sub-run (one of ``tune``'s runs): its own streams,
        derived from this one under ``name``, and the same validation split."""
        out = SecretRandomness.__new__(SecretRandomness)
        out._secret, out.source, out.secure = self.key(f"child {name}"), self.source, self.secure
        out._split_key = self.split_key()
        return out

    def split_key(self) -> bytes:
        """The key of the validation split's keyed hash
        (:func:`dpvision.data.splits.validation_split`); shared with every :meth:`child`."""
        return self._split_key or self.key("validation split")
