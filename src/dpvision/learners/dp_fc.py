"""DP-FC: DP-SGD preconditioned by a private feature covariance (Mehta et al., Algorithm 4,
Theorem 2.3).

The feature covariance G = Σᵢ x̃ᵢx̃ᵢᵀ (features clipped to C_G) is released once with noise
and shared by every class and step; then T full-batch steps of clipped gradient sums of the
one-vs-all sigmoid loss (fixed bias −10, as in the paper's code) are released, each
preconditioned by (G̃/n + λI)⁻¹.

The loss is *summed* over the m classes. The paper's code averages it, which divides every
per-example gradient by m: with a clip norm on the scale of the features the gradient
then sits m times below C and the noise is m times too large (measured: chance accuracy
with 1000 classes). Summing is the same method with C and η multiplied by m, and keeps
``clip_norm`` on the scale of ‖x‖.
"""

import math

import numpy as np
import torch

from dpvision.errors import DPVisionError
from dpvision.learners.base import DPLinearClassifier, PrivateFit
from dpvision.learners.dp_sgd_linear import clipped_gradient_sum, loss_gradient, row_sq_norms
from dpvision.learners.linalg import psd_project, symmetrize
from dpvision.learners.memory import CHOLESKY_WORK, EIGH_WORK, NORMAL_WORK, Footprint
from dpvision.learners.statistics import (
    DEFAULT_CHUNK_SIZE,
    gram_statistics,
    on_device,
    read_rows,
)
from dpvision.mechanisms import release_gaussian


class DPFeatureCovariance(DPLinearClassifier):
    """DP-FC classifier on features (``--method dp-fc``).

    Args:
      target_epsilon, target_delta, noise_multiplier, accountant, random_state, num_classes:
        as in :class:`~dpvision.learners.DPLeastSquares`.
      secure_mode: as in :class:`~dpvision.learners.DPLeastSquares`.
      device: as in :class:`~dpvision.learners.DPLeastSquares`.
      covariance_clip_norm: C_G, the L2 bound on feature vectors for the covariance.
      clip_norm: C_g, the L2 bound on each example's gradient (all classes together).
      epochs: T, the number of full-batch preconditioned steps.
      learning_rate: η.
      ridge: λ added to the noisy covariance G̃/n (after PSD projection), in units of C_G²;
        ``"auto"``: λ = max(1e-6, 2σ√d/n)·C_G².
      bias: the fixed bias of every class (−10 in the paper); it is not trained.

    Privacy:
      T + 1 Gaussian releases at noise multiplier σ: G̃ = G + N(0, (σC_G²)²) per entry
      (Frobenius sensitivity C_G²), then per step Σᵢ clip(gᵢ, C_g) + N(0, (σC_g)²) per
      coordinate (L2 sensitivity C_g). Full batch, so exactly (√(T+1)/σ)-GDP — the paper's
      (T+1)/(2σ²)-zCDP, accounted exactly.
    """

    def __init__(
        self,
        *,
        target_epsilon: float | None = None,
        target_delta: float = 1e-5,
        noise_multiplier: float | None = None,
        covariance_clip_norm: float = 1.0,
        clip_norm: float = 1.0,
        epochs: int = 10,
        learning_rate: float = 0.5,
        ridge: float | str = "auto",
        bias: float = -10.0,
        accountant: str | None = None,
        random_state: int | None = None,
        secure_mode: bool = False,
        num_classes: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        device: str = "cpu",
    ) -> None:
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self.noise_multiplier = noise_multiplier
        self.covariance_clip_norm = covariance_clip_norm
        self.clip_norm = clip_norm
        self.epochs = epochs
        self.learning_rate = learning_rate
        self.ridge = ridge
        self.bias = bias
        self.accountant = accountant
        self.random_state = random_state
        self.secure_mode = secure_mode
        self.num_classes = num_classes
        self.chunk_size = chunk_size
        self.device = device

    def _releases(self, n: int, d: int, m: int) -> tuple[int, float]:
        if int(self.epochs) != self.epochs or self.epochs < 1:
            raise DPVisionError(f"epochs must be a whole number >= 1, got {self.epochs}")
        return int(self.epochs) + 1, 1.0

    def _footprint(self, n: int, d: int, m: int, noisy: bool) -> Footprint:
        """At the peak (the PSD projection): G̃, its symmetrised copy over n, the
        eigenvectors, LAPACK's workspace of two, the reassembled matrix and its temporary,
        then the identity and the sum (seven d×d matrices). Work: G (2nd²), the noise, one
        eigendecomposition and one Cholesky factorisation, and the gradient passes."""
        rows = min(n, self.chunk_size)
        return Footprint(
            learner="DP-FC",
            d=d,
            m=m,
            n=n,
            matrices=7.0,
            extra_bytes=2 * 8.0 * rows * d + 8.0 * m * d * 4,
            work=self._covariance_work(n, d, noisy) + int(self.epochs) * 4.0 * n * m * d,
            solves="an eigendecomposition",
        )

    @staticmethod
    def _covariance_work(n: int, d: int, noisy: bool) -> float:
        """Work of the covariance: G, its noise, its projection and factorisation."""
        noise = NORMAL_WORK * d * d if noisy else 0.0
        return 2.0 * n * d * d + noise + (EIGH_WORK + CHOLESKY_WORK) * d**3

    def _fit_private(
        self, features: np.ndarray, labels: np.ndarray, fit: PrivateFit
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, d = features.shape
        cg = self.covariance_clip_norm
        start, stop = fit.workers.row_range(n)
        features, labels = features[start:stop], labels[start:stop]  # this rank's rows
        gram = gram_statistics(
            features,
            labels,
            num_classes=fit.num_classes,
            clip_norm=cg,
            chunk_size=self.chunk_size,
        ).gram
        fit.workers.all_reduce_([gram])  # exact sums over all ranks; the noise comes after
        gram = release_gaussian(
            gram,
            l2_sensitivity=cg * cg,
            noise_multiplier=fit.sigma,
            ledger=fit.ledger,
            released="DP-FC feature covariance",
            generator=fit.generator,
        )
        if self.ridge == "auto":
            ridge = max(1e-6, 2 * (fit.sigma or 0.0) * math.sqrt(d) / n) * cg * cg
        else:
            ridge = float(self.ridge) * cg * cg
        covariance = psd_project(symmetrize(gram) / n) + ridge * torch.eye(d, dtype=torch.float64)
        # One factorisation serves every step.
        factor = torch.linalg.cholesky(covariance)
        del gram, covariance
        fit.progress.update(self._covariance_work(n, d, fit.sigma is not None))
        weight = torch.zeros(fit.num_classes, d, dtype=torch.float64)
        bias = torch.full((fit.num_classes,), float(self.bias), dtype=torch.float64)
        sq_norms = row_sq_norms(features, self.chunk_size)
        for _ in range(int(self.epochs)):
            grad = torch.zeros_like(weight)
            for first in range(0, len(features), self.chunk_size):
                x = read_rows(features, slice(first, first + self.chunk_size))
                y = on_device(
                    torch.from_numpy(
                        np.asarray(labels[first : first + self.chunk_size], dtype=np.int64)
                    )
                )
                errors = loss_gradient(torch.addmm(bias, x, weight.T), y, "sigmoid")
                gw, _, _ = clipped_gradient_sum(
                    x,
                    errors,
                    self.clip_norm,
                    fit_intercept=False,
                    sq_norms=sq_norms[first : first + len(x)],
                )
                grad += gw
            fit.workers.all_reduce_([grad])
            grad = release_gaussian(
                grad,
                l2_sensitivity=self.clip_norm,
                noise_multiplier=fit.sigma,
                ledger=fit.ledger,
                released="DP-FC clipped gradient sum",
                generator=fit.generator,
            )
            # w ← w − η g̃ G̃⁻¹ (rows of w are classes): solve G̃ Δᵀ = g̃ᵀ.
            step = torch.cholesky_solve((grad / n).T, factor).T
            weight -= self.learning_rate * step
            fit.progress.update(4.0 * n * fit.num_classes * d)
        return weight, bias
