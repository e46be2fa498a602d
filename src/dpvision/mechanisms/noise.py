"""The Gaussian mechanism on torch tensors.

For a query f with L2 sensitivity Δ (the largest ‖f(D) − f(D')‖₂ over datasets that differ by
adding or removing one example), releasing f(D) + N(0, (σΔ)² I) is the Gaussian mechanism
with noise multiplier σ; its privacy is accounted by
:func:`dpvision.accounting.gaussian_event` (or the Poisson-sampled event when the data fed
to f was Poisson-sampled at rate q).

Noise comes from ``generator`` when one is given (reproducible runs, and identical draws on
every worker of a distributed step), else from torch's global generator. These are
pseudo-random generators, as in jax_privacy and Opacus without ``secure_mode``: adequate
against the threat model of the published guarantees, not against an adversary who can
observe the generator's state.
"""

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch

from dpvision.accounting import PrivacyLedger
from dpvision.accounting._checks import check_noise_multiplier, check_sample_rate
from dpvision.errors import DPVisionError
from dpvision.mechanisms.secure import SecureRandom, noise_source

NoiseGenerator = torch.Generator | SecureRandom | None
"""Where noise comes from: a seeded torch generator, the secure mode's CSPRNG, or (None)
torch's global generator."""


@dataclass(frozen=True)
class Release:
    """What one release (or one part of it) is, as its mechanism sees it before the noise.

    Attributes:
      released: what the release is, as in the ledger (e.g. ``"DP-LS G"``).
      value: the exact value the noise is about to be added to (private: for tests only).
      l2_sensitivity: the bound on the change of the *whole* release (all its parts
        together) when one example is added or removed.
      part: True when this value continues the previous release (a release drawn in pieces,
        such as DP-LS's stack of class Gram matrices or DP-SGD's per-parameter sums).
    """

    released: str
    value: torch.Tensor
    l2_sensitivity: float
    part: bool = False


ReleaseObserver = Callable[[Release], torch.Tensor]
_OBSERVER: ContextVar[ReleaseObserver | None] = ContextVar(
    "dpvision_release_observer", default=None
)


@contextmanager
def observing_releases(observer: ReleaseObserver) -> Iterator[None]:
    """Shows every release made inside the block to ``observer`` before its noise is added.

    The observer returns the value to release in its place (the same value, or, when it
    replays another run, that run's value, so that both runs continue from the same
    released history). This is how :func:`dpvision.testing.check_sensitivity` watches the
    real release paths; nothing in dpvision observes releases otherwise.
    """
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def observe_release(
    value: torch.Tensor, *, l2_sensitivity: float, released: str, part: bool = False
) -> torch.Tensor:
    """Passes a release's exact value to the active observer, if any; returns what to noise.

    Every noisy release in dpvision calls this right before drawing its noise, also with
    the noise off, so that its stated sensitivity can be checked on neighbouring datasets.

    Privacy:
      Releases nothing (outside an observer, it returns ``value`` itself).
    """
    observer = _OBSERVER.get()
    if observer is None:
        return value
    return observer(Release(released, value.detach().clone(), float(l2_sensitivity), part))


ReleasedWatcher = Callable[[Release], None]
_WATCHER: ContextVar[ReleasedWatcher | None] = ContextVar("dpvision_released_watcher", default=None)


@contextmanager
def watching_released(watcher: ReleasedWatcher) -> Iterator[None]:
    """Shows every value released inside the block to ``watcher``, *after* its noise.

    This is what an adversary who sees the mechanism's output sees (the white-box auditor
    of :mod:`dpvision.audit.one_run_targets` scores its canaries on it); the watcher gets a
    copy (:attr:`Release.value` is then the noisy value) and cannot change the release.
    """
    token = _WATCHER.set(watcher)
    try:
        yield
    finally:
        _WATCHER.reset(token)


def report_released(
    value: torch.Tensor, *, l2_sensitivity: float, released: str, part: bool = False
) -> None:
    """Shows a release's noisy value to the active :func:`watching_released` watcher, if any.

    Privacy:
      Releases nothing beyond ``value``, which the caller releases anyway.
    """
    watcher = _WATCHER.get()
    if watcher is not None:
        watcher(Release(released, value.detach().clone(), float(l2_sensitivity), part))


def _noise_std(l2_sensitivity: float, noise_multiplier: float) -> float:
    sigma = check_noise_multiplier(noise_multiplier)
    sensitivity = float(l2_sensitivity)
    if not (math.isfinite(sensitivity) and sensitivity > 0):
        raise DPVisionError(f"l2_sensitivity must be finite and > 0, got {l2_sensitivity}")
    return sigma * sensitivity


def gaussian_noise(
    shape: torch.Size | tuple[int, ...],
    *,
    l2_sensitivity: float,
    noise_multiplier: float,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    generator: NoiseGenerator = None,
) -> torch.Tensor:
    """Draws N(0, (σΔ)²) noise of the given shape: σ = ``noise_multiplier``, Δ = sensitivity
    (from the CSPRNG when ``generator`` is a :class:`~dpvision.mechanisms.secure.SecureRandom`)."""
    std = _noise_std(l2_sensitivity, noise_multiplier)
    if isinstance(generator, SecureRandom):
        noise = torch.empty(shape, dtype=torch.float64)
        return fill_standard_normal(noise, generator).mul_(std).to(dtype=dtype, device=device)
    noise = torch.randn(shape, dtype=dtype, device=device, generator=generator)
    return noise.mul_(std)


#: Numbers per stream of :func:`fill_standard_normal`'s parallel path.
STREAM_SIZE = 2**20


def fill_standard_normal(out: torch.Tensor, generator: NoiseGenerator) -> torch.Tensor:
    """Fills ``out`` with independent N(0, 1) draws and returns it.

    A :class:`~dpvision.mechanisms.secure.SecureRandom` generator fills it from the
    operating system's CSPRNG (the secure mode).

    A large contiguous float64 CPU tensor (DP-LS draws m·d(d+1)/2 numbers, 295 million
    for 1000 classes of 768 features) is cut into parts of :data:`STREAM_SIZE` numbers, each
    filled by NumPy's ziggurat sampler from its own PCG64 stream, in parallel on torch's
    threads: 2.7 times as fast as ``torch.randn`` on 2 cores. The streams' seeds are drawn
    from ``generator``, so the draws are reproducible and do not depend on the number of
    threads. Any other tensor is filled by ``torch.randn``.
    """
    count = out.numel()
    if isinstance(generator, SecureRandom):
        draws = torch.from_numpy(generator.standard_normal(count)).reshape(out.shape)
        return out.copy_(draws)
    large = out.dtype == torch.float64 and count >= 2 * STREAM_SIZE
    if not (large and out.device.type == "cpu" and out.is_contiguous()):
        return torch.randn(out.shape, generator=generator, out=out, dtype=out.dtype)
    flat = out.numpy().reshape(-1)
    starts = range(0, count, STREAM_SIZE)
    seeds = torch.randint(0, 2**62, (len(starts),), generator=generator).tolist()

    def fill(part: int) -> None:
        stream = np.random.Generator(np.random.PCG64(seeds[part]))
        start = starts[part]
        stream.standard_normal(out=flat[start : start + STREAM_SIZE])

    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        list(pool.map(fill, range(len(starts))))
    return out


def add_symmetric_gaussian_noise_(
    matrices: torch.Tensor,
    *,
    l2_sensitivity: float,
    noise_multiplier: float,
    generator: NoiseGenerator = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Adds symmetric Gaussian noise to the lower triangle of each of ``matrices`` (b, d, d),
    in place, and returns them; their strict upper triangles are left as they were.

    The noise S is symmetric, S_ii ~ N(0, (σΔ)²) and S_ij = S_ji ~ N(0, (σΔ)²/2), which is
    the distribution of (N + Nᵀ)/2 for N with i.i.d. N(0, (σΔ)²) entries: for a symmetric
    statistic A, the lower triangle of A + S is distributed as that of the symmetrised
    Gaussian release (A + N + (A + N)ᵀ)/2, with half the random numbers (d(d+1)/2 a
    matrix; Dwork et al.'s "Analyze Gauss" also releases a covariance with symmetric noise).
    For the solvers that read only the lower triangle (``torch.linalg.cholesky``,
    ``torch.linalg.eigh``), the matrices are then the symmetrised release.

    ``scratch``: a float64 tensor of at least b·d(d+1)/2 elements to draw into.

    Privacy:
      The lower triangle of A + S is a post-processing of the Gaussian mechanism that adds
      N(0, (σΔ)² I) to A (Δ = ``l2_sensitivity``, the Frobenius sensitivity of the stack of
      A's, which the caller must guarantee), so it is accounted as that mechanism (same σ,
      same Δ). Recording the release is the caller's job.
    """
    if matrices.dtype != torch.float64 or matrices.dim() != 3:
        raise DPVisionError("symmetric noise needs a (b, d, d) float64 tensor")
    b, d = matrices.shape[0], matrices.shape[-1]
    per_matrix = d * (d + 1) // 2
    if scratch is None:
        scratch = torch.empty(b * per_matrix, dtype=torch.float64, device=matrices.device)
    noise = scratch.reshape(-1)[: b * per_matrix]
    std = _noise_std(l2_sensitivity, noise_multiplier)
    fill_standard_normal(noise, generator).mul_(std / math.sqrt(2))
    noise = noise.view(b, per_matrix)
    rows = torch.arange(d, device=noise.device)
    noise[:, rows * (rows + 3) // 2] *= math.sqrt(2)  # row i's last entry is its diagonal
    start = 0
    for i in range(d):  # row i of the lower triangle: d(d+1)/2 numbers packed row by row
        matrices[:, i, : i + 1] += noise[:, start : start + i + 1]
        start += i + 1
    return matrices


def add_gaussian_noise(
    value: torch.Tensor,
    *,
    l2_sensitivity: float,
    noise_multiplier: float,
    generator: NoiseGenerator = None,
) -> torch.Tensor:
    """Returns ``value`` + N(0, (σΔ)² I), leaving ``value`` itself unchanged.

    Privacy:
      Releases ``value`` with noise calibrated to its L2 sensitivity Δ = ``l2_sensitivity``,
      which the caller must guarantee (e.g. a sum of contributions each clipped to norm Δ,
      under add/remove-one adjacency). Recording the release is the caller's job; use
      :func:`release_gaussian` to do both at once.
    """
    if not value.is_floating_point():
        raise DPVisionError(f"can only add Gaussian noise to a floating tensor, got {value.dtype}")
    noise = gaussian_noise(
        value.shape,
        l2_sensitivity=l2_sensitivity,
        noise_multiplier=noise_multiplier,
        dtype=value.dtype,
        device=value.device,
        generator=generator,
    )
    return value + noise


def release_gaussian(
    value: torch.Tensor,
    *,
    l2_sensitivity: float,
    noise_multiplier: float | None,
    ledger: PrivacyLedger,
    released: str,
    sample_rate: float = 1.0,
    generator: NoiseGenerator = None,
) -> torch.Tensor:
    """Adds Gaussian noise to ``value`` and records the release in ``ledger``.

    ``noise_multiplier=None`` turns the noise off (the non-private baseline): ``value`` is
    returned as it is and the ledger records a release without noise, so ε becomes ∞.

    Privacy:
      Releases ``value`` + N(0, (σΔ)² I), where Δ = ``l2_sensitivity`` bounds the change of
      ``value`` when one example is added or removed. ``sample_rate`` is the Poisson rate at
      which the examples behind ``value`` were drawn (1.0: the whole dataset). The ledger
      entry is written after the noise is drawn, so it records exactly what ran.
    """
    check_sample_rate(sample_rate)
    value = observe_release(value, l2_sensitivity=l2_sensitivity, released=released)
    if noise_multiplier is None:
        ledger.record_non_private(released=f"{released} (noise off)")
        report_released(value, l2_sensitivity=l2_sensitivity, released=released)
        return value
    noisy = add_gaussian_noise(
        value,
        l2_sensitivity=l2_sensitivity,
        noise_multiplier=noise_multiplier,
        generator=generator,
    )
    ledger.record(
        noise_multiplier=noise_multiplier,
        sample_rate=sample_rate,
        l2_sensitivity=l2_sensitivity,
        released=released,
        noise_source=noise_source(generator),
    )
    report_released(noisy, l2_sensitivity=l2_sensitivity, released=released)
    return noisy
