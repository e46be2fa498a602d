"""The shared shape of dpvision's feature learners: scikit-learn estimators with a ledger.

Every learner takes either ``target_epsilon`` (σ is calibrated so the whole fit — including
private preprocessing passed in as ``prior_ledger`` — meets (ε, δ)) or ``noise_multiplier``
(σ is fixed and ε is reported). ``target_epsilon=math.inf`` or ``noise_multiplier=0`` turns
the noise off: the fit is then the non-private baseline and its ledger reports ε = ∞.

After ``fit`` the estimator has ``coef_`` (m, d), ``intercept_`` (m,), ``classes_``,
``noise_multiplier_``, ``privacy_ledger_`` and ``epsilon_`` (at ``target_delta``).
"""

import abc
import dataclasses
import math
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin

from dpvision.accounting import (
    PrivacyLedger,
    calibrate_noise_multiplier,
)
from dpvision.accounting.ledger import NON_PRIVATE, LedgerEntry
from dpvision.data.rows import rows_per_chunk
from dpvision.devices import resolve_device
from dpvision.distributed import Workers, current
from dpvision.errors import DPVisionError, PrivacyWarning
from dpvision.learners.memory import (
    NESTED_SECONDS,
    PROGRESS_SECONDS,
    Footprint,
    check_footprint,
)
from dpvision.learners.statistics import check_features, iter_chunks
from dpvision.log import Progress
from dpvision.mechanisms import SecureRandom
from dpvision.mechanisms.noise import NoiseGenerator


def make_generator(random_state: int | None, device: str = "cpu") -> torch.Generator:
    """A torch generator for the noise on ``device``: seeded when ``random_state`` is given,
    else from the OS."""
    seed = random_state if random_state is not None else int.from_bytes(os.urandom(8), "little")
    return torch.Generator(device=device).manual_seed(int(seed) % (2**63))


def resolve_noise_multiplier(
    *,
    target_epsilon: float | None,
    target_delta: float,
    noise_multiplier: float | None,
    sample_rate: float,
    steps: int,
    prior_ledger: PrivacyLedger,
    accountant: str | None,
) -> float | None:
    """σ for ``steps`` releases at ``sample_rate``; None means the noise is off.

    Exactly one of ``target_epsilon`` and ``noise_multiplier`` must be given. With a target,
    σ is calibrated for the composition of ``prior_ledger`` and the new releases.
    """
    if (target_epsilon is None) == (noise_multiplier is None):
        raise DPVisionError("give exactly one of target_epsilon and noise_multiplier")
    if noise_multiplier is not None:
        if noise_multiplier == 0:
            return None
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise DPVisionError(f"noise_multiplier must be >= 0 and finite, got {noise_multiplier}")
        return float(noise_multiplier)
    assert target_epsilon is not None
    if math.isinf(target_epsilon) and target_epsilon > 0:
        return None
    prior = prior_ledger.dp_event() if len(prior_ledger) else None
    if prior is not None and not prior_ledger.is_private:
        raise DPVisionError("a non-private step already ran, so no finite ε target can be met")
    return calibrate_noise_multiplier(
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        sample_rate=sample_rate,
        steps=steps,
        accountant=accountant,
        preceding_event=prior,
    )


@dataclasses.dataclass(frozen=True)
class PrivateFit:
    """What a learner's private fit works with besides the data.

    Attributes:
      num_classes: m, public (never read off the labels).
      sigma: the noise multiplier of every release, None with the noise off.
      ledger: where each release is recorded as it is made.
      generator: the noise generator (identically seeded on every rank), or the secure
        mode's CSPRNG.
      workers: the processes sharing the rows.
      progress: where the fit reports the work done, in the units of its
        :meth:`~DPLinearClassifier._footprint` (shown when the fit is estimated to be long).
    """

    num_classes: int
    sigma: float | None
    ledger: PrivacyLedger
    generator: NoiseGenerator
    workers: Workers
    progress: Progress = dataclasses.field(default_factory=lambda: Progress(1, "", enabled=False))


def check_releases(
    entries: Sequence[LedgerEntry],
    count: int,
    sample_rate: float,
    sigma: float | None,
    learner: str,
) -> None:
    """Checks that a fit recorded exactly the releases it was calibrated for.

    σ was calibrated (or ε is reported) for ``count`` Gaussian releases at ``sample_rate``
    and σ (``_releases``); the ledger is filled by the releases that actually ran. If the
    two disagree, the reported ε would describe another mechanism than the one that ran.

    Raises:
      DPVisionError: the recorded releases differ in number, σ or sample rate.
    """
    recorded = sum(entry.count for entry in entries)
    if sigma is None:
        agree = all(entry.mechanism == NON_PRIVATE for entry in entries)
    else:
        agree = all(
            entry.mechanism != NON_PRIVATE
            and entry.noise_multiplier == sigma
            and entry.sample_rate == sample_rate
            for entry in entries
        )
    if recorded != count or not agree:
        found = ", ".join(
            f"{e.count}× σ={e.noise_multiplier:g} q={e.sample_rate:g} ({e.released})"
            for e in entries
        )
        raise DPVisionError(
            f"{learner} was calibrated for {count} releases at σ = {sigma} and q = "
            f"{sample_rate:g} but recorded {found or 'none'}: this is a bug in dpvision, "
            "please report it"
        )


def softmax(scores: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 (the maximum subtracted first, so large scores do not
    overflow): class probabilities from scores (n, m)."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.size == 0:
        return scores.reshape(scores.shape)
    shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
    return np.asarray(shifted / shifted.sum(axis=1, keepdims=True))


def _warn_inside_a_search(name: str) -> None:
    """Warns when scikit-learn's model selection (``GridSearchCV``, ``cross_val_score``, …)
    calls this fit: each fit's ε covers that fit alone, while the search looks at the
    private data once per candidate and fold and releases its choice unaccounted. Depends on
    the caller only, never on the data."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("sklearn.model_selection"):
            warnings.warn(
                f"{name}.fit runs inside scikit-learn's model selection (GridSearchCV, "
                "cross_val_score, ...): each fit's epsilon_ covers that fit alone, but the "
                "search sees the private data once per candidate and fold and releases its "
                "choice, which nothing accounts for; `dpvision tune` searches privately "
                "(docs/guide/tune.md)",
                PrivacyWarning,
                stacklevel=3,
            )
            return
        frame = frame.f_back


SCORE_BYTES = 2**26
"""Bytes of float64 rows :meth:`DPLinearClassifier.decision_function` reads at a time."""


class DPLinearClassifier(ClassifierMixin, BaseEstimator, abc.ABC):  # type: ignore[misc]
    """Base class: a linear classifier over features, trained under differential privacy.

    Subclasses implement ``_releases(n, d, m)`` (how many Gaussian releases, at which sample
    rate, the fit makes: the accounting of their theorem) and ``_fit_private``. ``fit``
    checks at run time that the releases ``_fit_private`` recorded are exactly those σ was
    calibrated for (:func:`check_releases`).
    """

    # Subclasses set these as constructor keywords (scikit-learn style).
    target_epsilon: float | None
    target_delta: float
    noise_multiplier: float | None
    accountant: str | None
    random_state: int | None
    secure_mode: bool
    num_classes: int | None
    chunk_size: int
    device: str

    def check_params(self) -> None:
        """One-line errors for option values out of range, before any data is read
        (``dpvision train`` calls it when it validates the config)."""
        for name in ("clip_norm", "covariance_clip_norm"):
            value = getattr(self, name, 1.0)
            if not (isinstance(value, int | float) and 0 < value < math.inf):
                raise DPVisionError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(self.secure_mode, bool):
            raise DPVisionError(f"secure_mode must be true or false, got {self.secure_mode!r}")
        if not (isinstance(self.chunk_size, int) and self.chunk_size >= 1):
            raise DPVisionError(f"chunk_size must be a whole number >= 1, got {self.chunk_size!r}")
        resolve_device(self.device)

    @abc.abstractmethod
    def _releases(self, n: int, d: int, m: int) -> tuple[int, float]:
        """(number of Gaussian releases at one common σ, their Poisson sample rate)."""

    def _footprint(self, n: int, d: int, m: int, noisy: bool) -> Footprint | None:
        """The d×d matrices and the work of a fit on n rows of d features and m classes
        (:mod:`dpvision.learners.memory`); None where not estimated."""
        return None

    def footprint(self, n: int, d: int, *, noisy: bool | None = None) -> Footprint | None:
        """The memory and work of a fit on n rows of d features (None: memory linear in
        d); ``noisy``: whether it adds noise (default: read off ``target_epsilon`` and
        ``noise_multiplier``). Privacy: reads the shape (n, d, m) only, which is public."""
        if self.num_classes is None:
            return None
        if noisy is None:
            noisy = not (
                (self.target_epsilon is not None and math.isinf(self.target_epsilon))
                or self.noise_multiplier == 0
            )
        return self._footprint(n, d, int(self.num_classes), noisy)

    def check_resources(
        self, n: int, d: int, *, noisy: bool | None = None, device: str | None = None
    ) -> float:
        """Refuses, in one line naming the alternatives, a fit on n rows of d features whose
        d×d matrices do not fit in the free memory of ``device`` (default: the learner's);
        warns when it will be long. Returns the estimated seconds (0: not estimated).

        ``dpvision train`` calls it before extracting the features, when d follows from the
        config and the image shape; ``fit`` calls it again before allocating.

        Privacy: reads the shape (n, d, m) only, which is public.
        """
        where = resolve_device(self.device if device is None else device)
        return check_footprint(self.footprint(n, d, noisy=noisy), where)

    @abc.abstractmethod
    def _fit_private(
        self, features: np.ndarray, labels: np.ndarray, fit: PrivateFit
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fits on the data, adding noise at ``fit.sigma`` (None: no noise) and recording
        every release in ``fit.ledger``.

        Under ``torchrun`` every rank gets the whole (memory-mapped) data and
        ``fit.workers``: it reduces only its share of the rows (``workers.row_range(n)``),
        the exact sums are all-reduced, and the noise is drawn after the reduction from
        ``fit.generator``, which is in the same state on every rank, so all ranks release
        and return the same values.

        Returns (coef (m, d), intercept (m,)).
        """

    def fit(
        self, X: np.ndarray, y: np.ndarray, *, prior_ledger: PrivacyLedger | None = None
    ) -> "DPLinearClassifier":
        """Trains on features ``X`` (n, d) — an array or a memory map — and labels ``y``.

        Privacy:
          Releases the model (and records every noisy statistic in ``privacy_ledger_``).
          The label set {0, …, m−1} and the number of examples n are treated as public, as in
          the papers; m is ``num_classes``, which must be given (read off the labels, it
          would let one added example change the model's shape). ``prior_ledger`` holds what
          already ran on the same data (e.g. private normalisation) and counts against
          ``target_epsilon``.
        """
        self.check_params()
        _warn_inside_a_search(type(self).__name__)
        y = np.asarray(y)
        if not np.issubdtype(y.dtype, np.integer):
            raise DPVisionError(f"labels must be integers 0..m-1, got dtype {y.dtype}")
        if self.num_classes is None:
            raise DPVisionError(
                "give num_classes: the number of classes fixes the model's shape, so it must "
                "be public, not read off the private labels"
            )
        num_classes = int(self.num_classes)
        check_features(X, y, num_classes)
        n, d = X.shape
        ledger = PrivacyLedger(prior_ledger.entries if prior_ledger is not None else ())
        count, sample_rate = self._releases(n, d, num_classes)
        sigma = resolve_noise_multiplier(
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            noise_multiplier=self.noise_multiplier,
            sample_rate=sample_rate,
            steps=count,
            prior_ledger=ledger,
            accountant=self.accountant,
        )
        workers = current()
        if workers.distributed and (self.random_state is None or self.secure_mode):
            raise DPVisionError(
                "under torchrun every rank must draw the same noise: give random_state "
                "(and no secure_mode, whose noise cannot be drawn alike on every rank)"
            )
        own = PrivacyLedger()  # this fit's releases alone, checked against the calibration
        device = resolve_device(self.device)
        generator: NoiseGenerator = (
            SecureRandom() if self.secure_mode else make_generator(self.random_state, device)
        )
        # The d×d matrices must fit before one is allocated (refused in one line if not).
        footprint = self._footprint(n, d, num_classes, sigma is not None)
        seconds = check_footprint(footprint, device)
        progress = Progress(
            footprint.work if footprint is not None else 1,
            f"{footprint.learner if footprint is not None else type(self).__name__} on {d} "
            "features",
            counts=False,
            # Inside another bar (an audit's runs), only a fit long enough to need its own.
            enabled=seconds > (PROGRESS_SECONDS if Progress.open_bars == 0 else NESTED_SECONDS)
            and workers.is_main,
            expected_seconds=seconds,
        )
        fit = PrivateFit(num_classes, sigma, own, generator, workers, progress)
        # Statistics, noise and solves on ``device``: tensors made without a device land there.
        with torch.device(device), progress:
            coef, intercept = self._fit_private(X, y, fit)
        check_releases(own.entries, count, sample_rate, sigma, type(self).__name__)
        ledger.extend(own)
        self.coef_ = coef.to(torch.float64).cpu().numpy()
        self.intercept_ = intercept.to(torch.float64).cpu().numpy()
        self.classes_ = np.arange(num_classes)
        self.n_features_in_ = d
        self.noise_multiplier_ = sigma
        self.privacy_ledger_ = ledger
        self.epsilon_ = ledger.epsilon(self.target_delta, self.accountant)
        return self

    def decision_function(self, X: np.ndarray) -> np.ndarray:
        """Scores (n, m) = X·coefᵀ + intercept, computed in chunks."""
        if not hasattr(self, "coef_"):
            raise DPVisionError("this model is not fitted yet: call fit first")
        if getattr(X, "ndim", None) != 2 or X.shape[1] != self.n_features_in_:
            raise DPVisionError(
                f"expected features of shape (n, {self.n_features_in_}), got "
                f"{getattr(X, 'shape', None)}"
            )
        coef = torch.from_numpy(self.coef_)
        intercept = torch.from_numpy(self.intercept_)
        # At most SCORE_BYTES of float64 rows at a time: scoring a test set takes no copy of it.
        rows = min(self.chunk_size, rows_per_chunk(X, SCORE_BYTES))
        scores = [x @ coef.T + intercept for x, _ in iter_chunks(X, chunk_size=rows)]
        return torch.cat(scores).numpy()

    def predict(self, X: np.ndarray) -> np.ndarray:
        return np.asarray(self.classes_[self.decision_function(X).argmax(axis=1)])

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """Class probabilities (n, m), float64, each row summing to 1: the softmax of
        :meth:`decision_function`, so the most probable class is :meth:`predict`'s.

        For DP-Newton and DP-SGD-linear (cross-entropy) this is the model's own probability;
        for DP-LS and DP-FC (least squares and one-vs-all fits) it is the same multinomial
        logit link applied to their scores: ordered like the scores, not calibrated
        (scikit-learn's ``RidgeClassifier`` offers none; wrap the learner in
        ``sklearn.calibration.CalibratedClassifierCV`` on public data to calibrate).

        Privacy:
          Post-processing of the released model: no privacy cost.
        """
        return softmax(self.decision_function(X))

    def privacy_report(self) -> dict[str, Any]:
        """ε, δ, accountant and ledger of the fit, ready for a result JSON."""
        if not hasattr(self, "privacy_ledger_"):
            raise DPVisionError("this model is not fitted yet: call fit first")
        return {
            "epsilon": self.epsilon_,
            "delta": self.target_delta,
            "accountant": self.accountant or "auto",
            "noise_multiplier": self.noise_multiplier_,
            "privacy_ledger": self.privacy_ledger_.to_dict(),
        }
