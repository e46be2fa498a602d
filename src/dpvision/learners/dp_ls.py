"""DP-LS: differentially private least squares (Mehta et al., Algorithm 3, Theorem 2.2).

The one-vs-all weighted least-squares objective

    L(θ) = ½ Σᵢ Σⱼ [ yᵢⱼ (xᵢᵀθⱼ − 1)² + α (xᵢᵀθⱼ)² ] + ½ λ Σⱼ ‖θⱼ‖²

has the solution θⱼ = (Aⱼ + αG + λI)⁻¹ bⱼ with G = Σᵢ xᵢxᵢᵀ, Aⱼ = Σ_{yᵢ=j} xᵢxᵢᵀ and
bⱼ = Σ_{yᵢ=j} xᵢ. DP-LS clips each feature vector to norm C and releases G, all Aⱼ and all
bⱼ with Gaussian noise, then solves. G is released once and shared by every class, so the
noise does not grow with the number of classes.
"""

import math

import numpy as np
import torch

from dpvision.errors import DPVisionError
from dpvision.learners.base import DPLinearClassifier, PrivateFit
from dpvision.learners.linalg import solve_psd, symmetrize
from dpvision.learners.memory import CHOLESKY_WORK, EIGH_WORK, NORMAL_WORK, Footprint
from dpvision.learners.statistics import (
    DEFAULT_CHUNK_SIZE,
    ClassIndex,
    class_grams,
    gram_statistics,
)
from dpvision.mechanisms import (
    add_symmetric_gaussian_noise_,
    observe_release,
    release_gaussian,
    report_released,
)
from dpvision.mechanisms.secure import noise_source


class DPLeastSquares(DPLinearClassifier):
    """DP-LS classifier on features (``--method dp-ls``).

    Args:
      target_epsilon: ε of the whole fit; σ is calibrated (exact Gaussian accountant by
        default). ``math.inf`` turns the noise off.
      target_delta: δ.
      noise_multiplier: σ instead of a target (mutually exclusive with ``target_epsilon``).
      clip_norm: C, the L2 bound each feature vector is clipped to.
      alpha: α, the weight of the negative-class term.
      ridge: λ added after the (noisy) statistics, in units of C²; ``"auto"`` picks
        λ = max(1e-6·n, 2σ√d)·C², a multiple of the spectral norm of the symmetrised noise.
      accountant: which accountant measures ε (``None``: the tightest valid one).
      random_state: seeds the noise (``None``: fresh OS entropy).
      secure_mode: draw the noise from the operating system's CSPRNG instead
        (:mod:`dpvision.mechanisms.secure`; slower, not reproducible; ignores
        ``random_state``); the ledger marks each release ``noise_source = "secure"``.
      num_classes: m, required (public: never read off the private labels).
      chunk_size: rows per chunk when accumulating statistics.
      device: where the statistics, the noise and the solves are computed (``cpu``,
        ``cuda``, ``cuda:N`` or ``auto``); the data stay where they are, read a chunk at a
        time. Results differ from the CPU's in rounding only.
      max_block_bytes: memory for the per-class d×d matrices solved at once (classes are
        processed in blocks, so m·d² need not fit in memory); the fit needs about two and a
        half times this at its peak (the statistics, the noise, the Cholesky factors).

    Privacy:
      Three Gaussian releases with noise multiplier σ each, on statistics of clipped
      features x̃ (add/remove-one adjacency, one label per example, k = 1):
      G̃ = G + N(0, (σC²)²) per entry (Frobenius sensitivity C²), Ãⱼ likewise for the stack
      of all classes (sensitivity C²; drawn as the symmetrised noise directly, see
      :func:`~dpvision.mechanisms.add_symmetric_gaussian_noise_`), b̃ⱼ = bⱼ + N(0, (σC)²)
      (L2 sensitivity C). Together:
      exactly (√3/σ)-GDP, i.e. the paper's 3/(2σ²)-zCDP accounted exactly.
    """

    def __init__(
        self,
        *,
        target_epsilon: float | None = None,
        target_delta: float = 1e-5,
        noise_multiplier: float | None = None,
        clip_norm: float = 1.0,
        alpha: float = 1.0,
        ridge: float | str = "auto",
        accountant: str | None = None,
        random_state: int | None = None,
        secure_mode: bool = False,
        num_classes: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        device: str = "cpu",
        max_block_bytes: int = 2**28,
    ) -> None:
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.alpha = alpha
        self.ridge = ridge
        self.accountant = accountant
        self.random_state = random_state
        self.secure_mode = secure_mode
        self.num_classes = num_classes
        self.chunk_size = chunk_size
        self.device = device
        self.max_block_bytes = max_block_bytes

    def check_params(self) -> None:
        super().check_params()
        if self.ridge != "auto" and not (
            isinstance(self.ridge, int | float) and 0 <= self.ridge < math.inf
        ):
            raise DPVisionError(f'ridge must be "auto" or a number >= 0, got {self.ridge!r}')
        if not (isinstance(self.alpha, int | float) and 0 <= self.alpha < math.inf):
            raise DPVisionError(f"alpha must be a number >= 0, got {self.alpha!r}")

    def _releases(self, n: int, d: int, m: int) -> tuple[int, float]:
        return 3, 1.0

    def _block(self, d: int, m: int) -> int:
        """Classes whose d×d matrices are processed at once (``max_block_bytes``)."""
        return min(m, max(1, self.max_block_bytes // (8 * d**2)))

    def _footprint(self, n: int, d: int, m: int, noisy: bool) -> Footprint:
        """At the peak: the shared αG̃ and, per class of a block, its statistic, half of its
        noise and its factor, plus (noisy: the systems are indefinite, so solved through
        eigenvalues) a copy, the eigenvectors and LAPACK's workspace of two. The release of
        G itself needs three (G, its noise, G̃). Work: G and all Aⱼ (2nd² flops each), the
        noise, and two Cholesky factorisations or one eigendecomposition per class."""
        block = self._block(d, m)
        per_class = 6.5 if noisy else 2.5
        rows = min(n, self.chunk_size)
        return Footprint(
            learner="DP-LS",
            d=d,
            m=m,
            n=n,
            matrices=max(3.0, 1.0 + per_class * block),
            extra_bytes=2 * 8.0 * rows * d + 8.0 * m * d * 4,
            work=self._statistics_work(n, d)
            + m * self._class_work(n, d, m, noisy)
            + (NORMAL_WORK * d * d if noisy else 0.0),
            solves=f"{m} {'eigendecompositions' if noisy else 'Cholesky factorisations'}",
        )

    @staticmethod
    def _statistics_work(n: int, d: int) -> float:
        """Work of G = Σ x̃x̃ᵀ (a product of n rows)."""
        return 2.0 * n * d * d

    @staticmethod
    def _class_work(n: int, d: int, m: int, noisy: bool) -> float:
        """Work of one class: its Aⱼ (its share of the n rows), noise and solve."""
        solve = EIGH_WORK + CHOLESKY_WORK if noisy else 2 * CHOLESKY_WORK
        noise = NORMAL_WORK * d * d / 2 if noisy else 0.0
        return 2.0 * n / max(m, 1) * d * d + noise + solve * d**3

    def _ridge(self, n: int, d: int, sigma: float | None) -> float:
        c2 = self.clip_norm**2
        if self.ridge == "auto":
            return max(1e-6 * n, 2 * (sigma or 0.0) * math.sqrt(d)) * c2
        return float(self.ridge) * c2

    def _fit_private(
        self, features: np.ndarray, labels: np.ndarray, fit: PrivateFit
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.clip_norm
        n, d = features.shape
        start, stop = fit.workers.row_range(n)
        local_x, local_y = features[start:stop], labels[start:stop]
        stats = gram_statistics(
            local_x, local_y, num_classes=fit.num_classes, clip_norm=c, chunk_size=self.chunk_size
        )
        gram, sums = stats.gram, stats.class_sums
        del stats  # the exact G is dropped as soon as G̃ exists (one d×d matrix less)
        fit.progress.update(self._statistics_work(n, d))
        fit.workers.all_reduce_([gram, sums])  # exact sums over all ranks; the noise comes after
        common = {"noise_multiplier": fit.sigma, "ledger": fit.ledger, "generator": fit.generator}
        gram = release_gaussian(gram, l2_sensitivity=c * c, released="DP-LS G", **common)
        sums = release_gaussian(sums, l2_sensitivity=c, released="DP-LS b_j", **common)
        shared = symmetrize(gram).mul_(self.alpha)  # in place: no second d×d temporary
        del gram
        noisy = fit.sigma is not None
        fit.progress.update(NORMAL_WORK * d * d if noisy else 0.0)
        ridge = self._ridge(n, d, fit.sigma)
        index = ClassIndex(local_y, fit.num_classes)
        coef = torch.zeros(fit.num_classes, d, dtype=torch.float64)
        block = self._block(d, fit.num_classes)
        # Two buffers reused by every block (fresh allocations of this size cost as much as
        # the noise draw): the block's d×d statistics, and its noise.
        grams_buffer = torch.empty(min(block, fit.num_classes), d, d, dtype=torch.float64)
        scratch = torch.empty(len(grams_buffer) * d * (d + 1) // 2, dtype=torch.float64)
        for first in range(0, fit.num_classes, block):
            classes = range(first, min(first + block, fit.num_classes))
            grams = class_grams(
                local_x, index, classes, clip_norm=c, chunk_size=self.chunk_size, out=grams_buffer
            )
            fit.workers.all_reduce_([grams])
            # The stack of all Aⱼ is one Gaussian release (sensitivity C²); its i.i.d. noise
            # is drawn block by block, which is the same mechanism, and recorded below.
            grams = observe_release(
                grams, l2_sensitivity=c * c, released="DP-LS A_j", part=first > 0
            )
            if fit.sigma is not None:
                # Symmetric noise on the lower triangles: the symmetrised Gaussian release
                # with half the random numbers (the solve reads lower triangles only).
                add_symmetric_gaussian_noise_(
                    grams,
                    l2_sensitivity=c * c,
                    noise_multiplier=fit.sigma,
                    generator=fit.generator,
                    scratch=scratch,
                )
            report_released(grams, l2_sensitivity=c * c, released="DP-LS A_j", part=first > 0)
            # Post-processing: regularise, project to PSD and solve.
            # Each rank solves its share of the block's classes; the others stay zero in its
            # coef, so the final all-reduce assembles every class's solution exactly.
            first_mine, last_mine = fit.workers.row_range(len(classes))
            mine = slice(classes.start + first_mine, classes.start + last_mine)
            grams = grams[first_mine:last_mine]
            grams += shared
            coef[mine] = solve_psd(grams, sums[mine], ridge=ridge, overwrite_matrix=True)
            fit.progress.update(len(classes) * self._class_work(n, d, fit.num_classes, noisy))
        # Recorded once every block's noise has been drawn (the fit.ledger lists what ran).
        if fit.sigma is None:
            fit.ledger.record_non_private(released="DP-LS A_j (noise off)")
        else:
            fit.ledger.record(
                noise_multiplier=fit.sigma,
                l2_sensitivity=c * c,
                released="DP-LS A_j",
                noise_source=noise_source(fit.generator),
            )
        fit.workers.all_reduce_([coef])
        return coef, torch.zeros(fit.num_classes, dtype=torch.float64)
