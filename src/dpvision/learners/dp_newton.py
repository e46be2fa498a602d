"""DP-Newton: a private Newton's method for one-vs-all logistic regression (Mehta et al.,
Algorithm 2, Theorem 2.1).

Features are clipped to C once. At every iteration the per-class gradient and Hessian sums
are released with Gaussian noise, then each class takes a Newton step with the noisy
Hessian (PSD-projected, plus λI).
"""

import math

import numpy as np
import torch

from dpvision.errors import DPVisionError
from dpvision.learners.base import DPLinearClassifier, PrivateFit
from dpvision.learners.linalg import solve_psd
from dpvision.learners.memory import CHOLESKY_WORK, EIGH_WORK, NORMAL_WORK, Footprint
from dpvision.learners.statistics import DEFAULT_CHUNK_SIZE, iter_chunks
from dpvision.mechanisms import clip_rows, release_gaussian

# |ℓ''| ≤ 1/4 for the logistic loss (σ(z)(1 − σ(z)) ≤ 1/4), and |ℓ'| ≤ 1.
HESSIAN_BOUND = 0.25


class DPNewton(DPLinearClassifier):
    """DP-Newton classifier on features (``--method dp-newton``).

    Args:
      target_epsilon, target_delta, noise_multiplier, accountant, random_state, num_classes:
        as in :class:`~dpvision.learners.DPLeastSquares`.
      secure_mode: as in :class:`~dpvision.learners.DPLeastSquares`.
      device: as in :class:`~dpvision.learners.DPLeastSquares`.
      clip_norm: C, the L2 bound on each feature vector.
      iterations: T, the number of Newton steps.
      learning_rate: η, the Newton step size.
      ridge: λ, the L2 regularisation of the (mean) logistic loss; also keeps the noisy
        Hessian invertible. ``"auto"``: λ = max(1e-4, 2σ√(md)/(4n))·C².

    Privacy:
      2T Gaussian releases at noise multiplier σ. Per iteration: the stacked gradient sums of
      all m classes (L2 sensitivity √m·C, since |ℓ'| ≤ 1 and ‖x̃‖ ≤ C) and the stacked Hessian
      sums (Frobenius sensitivity √m·C²/4, since |ℓ''| ≤ 1/4). Full batch, so exactly
      (√(2T)/σ)-GDP — the paper's T/σ²-zCDP, accounted exactly.
    """

    def __init__(
        self,
        *,
        target_epsilon: float | None = None,
        target_delta: float = 1e-5,
        noise_multiplier: float | None = None,
        clip_norm: float = 1.0,
        iterations: int = 1,
        learning_rate: float = 1.0,
        ridge: float | str = "auto",
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
        self.clip_norm = clip_norm
        self.iterations = iterations
        self.learning_rate = learning_rate
        self.ridge = ridge
        self.accountant = accountant
        self.random_state = random_state
        self.secure_mode = secure_mode
        self.num_classes = num_classes
        self.chunk_size = chunk_size
        self.device = device

    def _releases(self, n: int, d: int, m: int) -> tuple[int, float]:
        if int(self.iterations) != self.iterations or self.iterations < 1:
            raise DPVisionError(f"iterations must be a whole number >= 1, got {self.iterations}")
        return 2 * int(self.iterations), 1.0

    def _footprint(self, n: int, d: int, m: int, noisy: bool) -> Footprint:
        """At the peak (the solve): the m noisy Hessians, their mean over n, the symmetrised
        copy, the Cholesky factors and (noisy: solved through eigenvalues) a copy, the
        eigenvectors and LAPACK's workspace: about seven m·d×d matrices. Work per
        iteration: the m weighted Gram sums (2nd² each), their noise and m solves."""
        rows = min(n, self.chunk_size)
        return Footprint(
            learner="DP-Newton",
            d=d,
            m=m,
            n=n,
            matrices=(7.0 if noisy else 4.0) * m,
            extra_bytes=2 * 8.0 * rows * d + 8.0 * rows * m * 3,
            work=int(self.iterations) * self._iteration_work(n, d, m, noisy),
            solves=f"{int(self.iterations) * m} "
            f"{'eigendecompositions' if noisy else 'Cholesky factorisations'}",
        )

    @staticmethod
    def _iteration_work(n: int, d: int, m: int, noisy: bool) -> float:
        """Work of one Newton step: statistics, noise and the m solves."""
        solve = EIGH_WORK + CHOLESKY_WORK if noisy else 2 * CHOLESKY_WORK
        noise = NORMAL_WORK * m * d * d if noisy else 0.0
        return 2.0 * n * m * d * d + noise + solve * m * d**3

    def _fit_private(
        self, features: np.ndarray, labels: np.ndarray, fit: PrivateFit
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, d = features.shape
        m, c = fit.num_classes, self.clip_norm
        if self.ridge == "auto":
            ridge = max(1e-4, 2 * (fit.sigma or 0.0) * math.sqrt(m * d) * HESSIAN_BOUND / n) * c * c
        else:
            ridge = float(self.ridge) * c * c
        weight = torch.zeros(m, d, dtype=torch.float64)
        for _ in range(int(self.iterations)):
            grad = torch.zeros(m, d, dtype=torch.float64)
            hessian = torch.zeros(m, d, d, dtype=torch.float64)
            # At w = 0 every σ(z)(1 − σ(z)) is exactly 1/4, so all m Hessian sums equal G/4:
            # one Gram matrix instead of m weighted ones (the same exact statistic).
            at_zero = not bool(weight.any())
            start, stop = fit.workers.row_range(n)  # this rank's rows; sums all-reduced below
            rows = (features[start:stop], labels[start:stop])
            for x, y in iter_chunks(*rows, chunk_size=self.chunk_size):
                assert y is not None
                x = clip_rows(x, c)
                targets = torch.nn.functional.one_hot(y, m).to(torch.float64)
                probs = torch.sigmoid(x @ weight.T)
                grad += (probs - targets).T @ x
                if at_zero:
                    hessian[0].addmm_(x.T, x, alpha=HESSIAN_BOUND)
                    continue
                curvature = probs * (1 - probs)  # (rows, m)
                for j in range(m):
                    hessian[j].addmm_((x * curvature[:, j : j + 1]).T, x)
            fit.workers.all_reduce_([grad, hessian[0] if at_zero else hessian])
            if at_zero:
                hessian[1:] = hessian[0]
            common = {
                "noise_multiplier": fit.sigma,
                "ledger": fit.ledger,
                "generator": fit.generator,
            }
            grad = release_gaussian(
                grad,
                l2_sensitivity=math.sqrt(m) * c,
                released="DP-Newton gradient sums",
                **common,
            )
            hessian = release_gaussian(
                hessian,
                l2_sensitivity=math.sqrt(m) * c * c * HESSIAN_BOUND,
                released="DP-Newton Hessian sums",
                **common,
            )
            # Newton step on the mean loss + (λ/2)‖w‖² (regulariser's terms are public).
            mean_grad = grad / n + ridge * weight
            step = solve_psd(hessian / n, mean_grad, ridge=ridge)
            weight -= self.learning_rate * step
            del hessian, step
            fit.progress.update(self._iteration_work(n, d, m, fit.sigma is not None))
        return weight, torch.zeros(m, dtype=torch.float64)
