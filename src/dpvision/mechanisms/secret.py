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

A replayable secret is derived the same way at every entry point (``dpvision.train``,
``dpvision.tune``, ``PrivacyEngine``): from the secret seed and the run's *context* (the
published config, or the engine's σ, C, q, N, optimizer settings and initial parameters),
so two runs that differ in any setting share no stream. Every stream but the split keys is
keyed by the training rows too (:meth:`SecretRandomness.bind_rows`): the noise, and the
*coins* that decide which rows a mechanism sees (the Poisson sampling's, ``tune``'s K and
draws: :meth:`SecretRandomness.coin_key`), so a rerun on data with one example added or
removed shares no randomness with the first run — two such runs compose as independent
mechanisms. Only the split keys stay independent of the data, so that a split moves no row
but the one added. (Neighbouring-dataset tests with the noise off couple the coins of D and
D′ with :func:`dpvision.testing.coupled_coins`, a testing tool.)

>>> a, b = SecretRandomness(secret_seed=7), SecretRandomness(secret_seed=7)
>>> a.source, a.seed("noise") == b.seed("noise"), a.seed("noise") == a.seed("sampler")
('user-secret', True, False)
>>> "7" in repr(a)
False
>>> split, noise = a.split_key(), a.seed("noise")
>>> a.bind_rows(np.arange(4)) is a, a.split_key() == split, a.seed("noise") == noise
(True, True, False)
"""

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dpvision.errors import DPVisionError
from dpvision.mechanisms.secure import SecureRandom

__all__ = ["SECRET_SOURCES", "SecretRandomness", "canonical_context", "rows_digest"]

SECRET_SOURCES = ("os", "user-secret", "csprng")
"""What a result's ``secret_randomness`` may say: fresh OS entropy, a user's secret seed,
or the secure mode's CSPRNG at every draw."""

_SECRET_SEED_DOMAIN = b"dpvision secret_seed v1"
_ROWS_DOMAIN = b"dpvision training rows v1"


def canonical_context(context: Mapping[str, Any]) -> str:
    """A run's context as the canonical text its secret streams are derived from: JSON
    with sorted keys, anything else by ``str``.

    >>> canonical_context({"b": 1, "a": (0.5, None)})
    '{"a": [0.5, null], "b": 1}'
    """
    return json.dumps(context, sort_keys=True, default=str)


def rows_digest(*arrays: object) -> bytes:
    """A 32-byte digest of a run's training rows: the dtype, shape and bytes of each array
    (images, labels; NumPy arrays or tensors), in order.

    >>> same, longer = rows_digest(np.zeros(3)), rows_digest(np.zeros(4))
    >>> rows_digest(np.zeros(3)) == same, same == longer
    (True, False)

    Privacy:
      Secret: it only keys the streams of a :class:`SecretRandomness` (never written to any
      output), so that a replayable run on other rows draws other noise.
    """
    hasher = hashlib.blake2b(_ROWS_DOMAIN, digest_size=32)
    for array in arrays:
        if isinstance(array, torch.Tensor):
            array = array.detach().cpu().contiguous().numpy()
        values = np.ascontiguousarray(np.asarray(array))
        hasher.update(f"{values.dtype.str}{values.shape};".encode())
        hasher.update(values.reshape(-1).view(np.uint8).data)
    return hasher.digest()


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
      context: what the run is (its published config, or a :class:`PrivacyEngine` call's
        settings, as canonical text: :func:`canonical_context`): with a ``secret_seed``,
        runs of different contexts get independent streams, so two runs that share a
        secret seed (a sweep over ε, σ, learning rates or public seeds) never share their
        noise; the same context, rows and secret seed replay the same run.

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
        self._streams = self._secret  # the key of every stream but the split keys
        self._rows: bytes | None = None
        self._binds_rows = True
        self._split_key: bytes | None = None

    @classmethod
    def from_state(cls, state: dict[str, object]) -> "SecretRandomness":
        """The secret of a checkpoint (:meth:`state`), to resume a run with the same streams
        (it is bound to the rows again as the run reads them: :meth:`bind_rows`)."""
        secret, source, split = state.get("secret"), state.get("source"), state.get("split_key")
        if not isinstance(secret, bytes) or len(secret) != 32 or source not in SECRET_SOURCES:
            raise DPVisionError("the checkpoint's secret randomness is malformed")
        out = cls.__new__(cls)
        out._secret, out.source, out.secure = secret, str(source), source == "csprng"
        out._streams, out._rows = secret, None
        # A checkpoint from before the rows keyed the streams resumes as it ran.
        out._binds_rows = state.get("binds_rows") is True
        out._split_key = split if isinstance(split, bytes) else None
        return out

    def state(self) -> dict[str, object]:
        """What a checkpoint keeps to resume the same streams and the same validation split
        (private: never published)."""
        return {
            "secret": self._secret,
            "source": self.source,
            "split_key": self.split_key(),
            "binds_rows": self._binds_rows,
        }

    def __repr__(self) -> str:
        return f"SecretRandomness(source={self.source!r})"

    @property
    def replayable(self) -> bool:
        """Whether the streams are derived from a ``secret_seed`` (the same seed, context and
        rows draw them again)."""
        return self.source == "user-secret"

    def bind_rows(self, *rows: object) -> "SecretRandomness":
        """Keys every stream but the split keys by the run's training rows (the arrays of
        :func:`rows_digest`, or a callable that returns them, given once the run has read
        them and before it draws any noise or coin), and returns ``self``.

        A replayable run on data with one example added or removed then draws independent
        noise, batches and coins: publishing both runs never gives back the difference of
        their exact releases, and the two compose as independent mechanisms (shared
        Poisson coins would cost more than the sum of their ε). The split keys
        (:meth:`split_key`) stay independent of the rows, so that the splits stay
        neighbour-stable. Fresh OS bits need no binding (the
        rows are then not even hashed); the first binding holds, so a run that reads its
        rows twice keeps its streams.

        Privacy:
          Releases nothing; see the module docstring.
        """
        if self._rows is None and self._binds_rows and self.replayable:
            if len(rows) == 1 and callable(rows[0]):
                rows = tuple(rows[0]())
            self._rows = rows_digest(*rows)
            self._streams = hashlib.blake2b(
                _ROWS_DOMAIN + self._rows, key=self._secret, digest_size=32
            ).digest()
        return self

    def key(self, name: str) -> bytes:
        """32 secret bytes for the stream ``name`` (e.g. a keyed hash's key), keyed by the
        rows once they are bound (:meth:`bind_rows`)."""
        return hashlib.blake2b(name.encode(), key=self._streams, digest_size=32).digest()

    def coin_key(self, name: str) -> bytes:
        """32 secret bytes for the coins ``name``: what decides which rows a mechanism sees
        (Poisson sampling, ``tune``'s K and draws); keyed by the rows once they are bound,
        as the noise (:meth:`bind_rows`)."""
        return hashlib.blake2b(
            b"coins " + name.encode(), key=self._streams, digest_size=32
        ).digest()

    def unbound_coin_key(self, name: str) -> bytes:
        """:meth:`coin_key` as if no rows were bound: for
        :func:`dpvision.testing.coupled_coins` only, never a run's coins."""
        return hashlib.blake2b(b"coins " + name.encode(), key=self._secret, digest_size=32).digest()

    def coin_seed(self, name: str) -> int:
        """A secret 63-bit seed for the coins ``name`` (:meth:`coin_key`)."""
        return int.from_bytes(self.coin_key(name)[:8], "little") % 2**63

    def coins(self, name: str) -> np.random.Generator:
        """A NumPy generator of the coins ``name`` (:meth:`coin_key`)."""
        return np.random.default_rng(int.from_bytes(self.coin_key(name), "little"))

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
        derived from this one's (rows included) under ``name``, and the same validation
        split."""
        out = SecretRandomness.__new__(SecretRandomness)
        out._secret, out.source, out.secure = self.key(f"child {name}"), self.source, self.secure
        out._streams, out._rows, out._binds_rows = out._secret, None, self._binds_rows
        out._split_key = self.split_key()
        return out

    def split_key(self) -> bytes:
        """The key of the validation split's keyed hash
        (:func:`dpvision.data.splits.validation_split`); shared with every :meth:`child`,
        and independent of the rows (:meth:`bind_rows`)."""
        if self._split_key is None:
            self._split_key = hashlib.blake2b(
                b"validation split", key=self._secret, digest_size=32
            ).digest()
        return self._split_key
