"""DP-SGD, DP-SGD with momentum and DP-Adam on a linear head (Mehta et al. Algorithm 1;
Tramèr & Boneh's ScatterNet+linear).

For a linear model z = Wx + b and a loss ℓ(z, y), example i's gradient is
∂ℓ/∂W = eᵢxᵢᵀ, ∂ℓ/∂b = eᵢ with eᵢ = ∂ℓ/∂z, so its norm is ‖eᵢ‖·√(‖xᵢ‖² + 1) in closed form
and the clipped sum Σᵢ cᵢ eᵢ[xᵢ; 1]ᵀ is one matrix product: no per-example gradient is ever
materialised.
"""

import logging
import math
from typing import Any

import numpy as np
import torch

from dpvision.averaging import ParameterEMA
from dpvision.errors import DPVisionError
from dpvision.learners.base import DPLinearClassifier, PrivateFit
from dpvision.learners.memory import NORMAL_WORK, Footprint
from dpvision.learners.statistics import DEFAULT_CHUNK_SIZE, on_device
from dpvision.learners.step_blocks import BLOCK_BYTES, StepBlocks, row_sq_norms
from dpvision.mechanisms import PoissonSampler, SecureRandom, clipping
from dpvision.mechanisms.clip_policy import ClipPolicy, adaptive_options, make_clip_policy
from dpvision.mechanisms.clipped_sum import ClippedGradientSum
from dpvision.mechanisms.gradient_release import GradientRelease, ReleaseContext, noisy_step

_log = logging.getLogger(__name__)

LOSSES = ("softmax", "sigmoid")
OPTIMIZERS = ("sgd", "momentum", "adam")


def loss_gradient(scores: torch.Tensor, labels: torch.Tensor, loss: str) -> torch.Tensor:
    """eᵢ = ∂ℓ/∂zᵢ for a batch: softmax cross-entropy, or one-vs-all sigmoid cross-entropy.

    ``scores`` (b, m) may be overwritten (the sigmoid is taken in place): pass a fresh
    product. The label's entry, p − 1, is computed without the subtraction (softmax:
    −Σ_{j≠y} pⱼ; sigmoid: −σ(−zᵧ)), so it keeps its relative precision where p is within
    rounding of 1: a last-bit difference in p then moves eᵢ by a last bit, not by a large
    part of itself (which clipping, rescaling eᵢ to norm C, would turn into a large move).
    """
    rows = torch.arange(len(labels), device=labels.device)
    if loss == "softmax":
        errors = torch.softmax(scores, dim=1)
        errors[rows, labels] = 0.0
        errors[rows, labels] = -errors.sum(dim=1)  # pᵧ − 1 = −Σ_{j≠y} pⱼ, no cancellation
        return errors
    at_label = scores[rows, labels]
    errors = scores.sigmoid_()
    errors[rows, labels] = -torch.sigmoid(-at_label)  # σ(zᵧ) − 1 = −σ(−zᵧ)
    return errors


def clipped_gradient_sum(
    x: torch.Tensor,
    errors: torch.Tensor,
    clip_norm: float,
    *,
    fit_intercept: bool,
    sq_norms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σᵢ clip(gᵢ, C) for the linear head, with gᵢ = eᵢ[xᵢ; 1]ᵀ, via one GEMM.

    Args:
      x: (b, d) features.
      errors: (b, m) loss gradients eᵢ (scaled in place: overwritten).
      clip_norm: C.
      fit_intercept: whether gᵢ includes the bias part eᵢ.
      sq_norms: ‖xᵢ‖² if already known (saves a pass over x).

    Returns:
      (weight-gradient sum (m, d), bias-gradient sum (m,), the per-example norms ‖gᵢ‖ (b,),
      non-finite for the gradients that were zeroed: exact and private). Each example
      contributes at most C in L2 norm (pass float64 tensors: in float32, rounding can
      exceed C by ~1e-6 relative).

    Privacy:
      Releases nothing; the sums have L2 sensitivity C under add/remove-one.
    """
    if sq_norms is None:
        sq_norms = (x * x).sum(dim=1)
    sq_norms = sq_norms.to(errors.dtype) + (1.0 if fit_intercept else 0.0)
    norms = torch.linalg.vector_norm(errors, dim=1) * torch.sqrt(sq_norms)
    finite = torch.isfinite(norms)  # a non-finite entry of xᵢ or eᵢ makes its norm non-finite
    scale = clipping.clip_factors(norms, clip_norm)
    if not bool(finite.all()):
        x = torch.where(finite.unsqueeze(1), x, torch.zeros_like(x))
        errors = torch.where(finite.unsqueeze(1), errors, torch.zeros_like(errors))
    weighted = errors.mul_(scale[:, None])
    grad_w = (weighted.T @ x).to(torch.float64)
    if fit_intercept:
        grad_b = weighted.sum(dim=0, dtype=torch.float64)
    else:
        grad_b = torch.zeros(errors.shape[1], dtype=torch.float64)
    return grad_w, grad_b, norms


class DPSGDLinear(DPLinearClassifier):
    """A linear head trained with DP-SGD / momentum / DP-Adam (``--method dp-sgd-linear``).

    Args:
      target_epsilon, target_delta, noise_multiplier, accountant, random_state, num_classes:
        as in :class:`~dpvision.learners.DPLeastSquares`.
      secure_mode: as in :class:`~dpvision.learners.DPLeastSquares`.
      device: as in :class:`~dpvision.learners.DPLeastSquares`.
      clip_norm: C, the L2 bound on each example's gradient (weights and bias together).
      batch_size: expected Poisson batch size B (sample rate q = B/n); ``None`` = full batch.
      epochs: training length; steps T = ceil(epochs·n/B) (= epochs for full batch).
      sample_rate, steps: q and T themselves, overriding ``batch_size`` and ``epochs``, for a
        mechanism fixed before the data are seen (the audit runs D and D′ at the same q, T).
      expected_batch_size: the public divisor of the noisy sum (default qn, with n treated
        as public); fix it to run D and D′ with the very same post-processing.
      learning_rate, optimizer (``"sgd"``, ``"momentum"``, ``"adam"``), momentum, betas:
        the first-order optimizer applied to the privatised gradient.
      loss: ``"softmax"`` cross-entropy, or one-vs-all ``"sigmoid"`` cross-entropy (Mehta
        et al.), whose bias starts at ``bias_init`` (−10 in the paper).
      fit_intercept: learn a bias (it shares the clipping budget with the weights).
      ema_decay: μ of an exponential moving average of the iterates (0: off), with the
        warm-up of :func:`dpvision.averaging.ema_decay`; the fitted model is then the
        average (post-processing: free).
      clipping: the clip policy (Opacus' name): ``flat``, or ``adaptive``: C starts at
        ``clip_norm`` and follows a quantile of the per-example norms
        (:mod:`dpvision.mechanisms.adaptive_clipping`; each step also releases the
        unclipped count, and σ is split between the two).
      target_unclipped_quantile: ``adaptive`` only, γ (Opacus' names, as in ``dpvision
        train``'s DP-SGD options).
      clipbound_learning_rate: η of the geometric update of C.
      unclipped_num_std: σ_b of the count (default: the expected batch size over 20).
      min_clipbound, max_clipbound: the bounds on C.
      clipping_mode: deprecated, the former name of ``clipping`` (read, with a one-line
        warning, when given).
      sampling_state: seeds the Poisson coins alone (``dpvision train`` gives the run's
        secret coins, which do not depend on the rows, so that neighbouring runs see the
        same batches of the rows they share, while their noise differs); ``None``: drawn
        from ``random_state``'s generator, as the noise.

    Privacy:
      T releases of Σ_{i∈batch} clip(gᵢ, C) + N(0, (σC)² I), the batch Poisson-sampled at
      rate q (or the whole dataset when q = 1); L2 sensitivity C under add/remove-one. The
      sum is divided by the public expected batch size qn, never the realised one; an empty
      batch still gets its noise. Non-finite per-example gradients are zeroed (and not
      counted: an exact count of them would be a statistic of the private data).
    """

    def __init__(
        self,
        *,
        target_epsilon: float | None = None,
        target_delta: float = 1e-5,
        noise_multiplier: float | None = None,
        clip_norm: float = 1.0,
        batch_size: int | None = None,
        epochs: float = 10.0,
        learning_rate: float = 1.0,
        optimizer: str = "momentum",
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        loss: str = "softmax",
        bias_init: float | None = None,
        fit_intercept: bool = True,
        accountant: str | None = None,
        random_state: int | None = None,
        secure_mode: bool = False,
        num_classes: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        device: str = "cpu",
        sample_rate: float | None = None,
        steps: int | None = None,
        expected_batch_size: float | None = None,
        ema_decay: float = 0.0,
        clipping: str = "flat",
        target_unclipped_quantile: float = 0.5,
        clipbound_learning_rate: float = 0.2,
        unclipped_num_std: float | None = None,
        min_clipbound: float = 1e-6,
        max_clipbound: float = 1e6,
        clipping_mode: str | None = None,
        sampling_state: int | None = None,
    ) -> None:
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.batch_size = batch_size
        self.epochs = epochs
        self.learning_rate = learning_rate
        self.optimizer = optimizer
        self.momentum = momentum
        self.betas = betas
        self.loss = loss
        self.bias_init = bias_init
        self.fit_intercept = fit_intercept
        self.accountant = accountant
        self.random_state = random_state
        self.sampling_state = sampling_state
        self.secure_mode = secure_mode
        self.num_classes = num_classes
        self.chunk_size = chunk_size
        self.device = device
        self.sample_rate = sample_rate
        self.steps = steps
        self.expected_batch_size = expected_batch_size
        self.ema_decay = ema_decay
        self.clipping = clipping
        self.target_unclipped_quantile = target_unclipped_quantile
        self.clipbound_learning_rate = clipbound_learning_rate
        self.unclipped_num_std = unclipped_num_std
        self.min_clipbound = min_clipbound
        self.max_clipbound = max_clipbound
        self.clipping_mode = clipping_mode  # deprecated (scikit-learn: stored as given)

    def check_params(self) -> None:
        super().check_params()
        if self.clipping_mode is not None:
            _log.warning(
                "DPSGDLinear(clipping_mode=...) is deprecated: write clipping=%r",
                self.clipping_mode,
            )
        self._clipping()

    def _clipping(self) -> str:
        """The clip policy's name: ``clipping``, or the deprecated ``clipping_mode``."""
        clipping = self.clipping
        if self.clipping_mode is not None:
            if clipping not in ("flat", self.clipping_mode):
                raise DPVisionError(
                    f"clipping_mode is the old name of clipping, and the two differ "
                    f"({self.clipping_mode!r}, {clipping!r}): give only clipping"
                )
            clipping = self.clipping_mode
        if clipping not in ("flat", "adaptive"):
            raise DPVisionError(
                f"clipping must be 'flat' or 'adaptive' (per_layer is for --method dp-sgd: "
                f"a linear head is one layer), got {clipping!r}"
            )
        return clipping

    def _policy(self, expected_batch: float) -> ClipPolicy:
        """The clip policy ``clipping`` names (flat or adaptive)."""
        return make_clip_policy(
            self._clipping(),
            float(self.clip_norm),
            expected_batch_size=expected_batch,
            **adaptive_options(self),
        )

    def _sample_rate(self, n: int) -> float:
        if self.sample_rate is not None:
            if not 0 < self.sample_rate <= 1:
                raise DPVisionError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
            return float(self.sample_rate)
        if self.batch_size is None or self.batch_size >= n:
            return 1.0
        if self.batch_size < 1:
            raise DPVisionError(f"batch_size must be >= 1, got {self.batch_size}")
        return self.batch_size / n

    def _steps(self, n: int) -> int:
        if self.steps is not None:
            if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
                raise DPVisionError(f"steps must be a whole number >= 1, got {self.steps!r}")
            return self.steps
        if not self.epochs > 0:
            raise DPVisionError(f"epochs must be > 0, got {self.epochs}")
        return max(1, math.ceil(self.epochs / self._sample_rate(n) - 1e-9))

    def _footprint(self, n: int, d: int, m: int, noisy: bool) -> Footprint | None:
        """No d×d matrix (memory linear in d); the work of its steps, for the progress and
        the time estimate: per step the expected batch's scores, per-example gradient norms
        and clipped sum (about ten flops per row, feature and class) and the noise."""
        try:
            q, steps = self._sample_rate(n), self._steps(n)
        except (DPVisionError, TypeError):  # refused with its own message by fit
            return None
        return Footprint(
            learner="DP-SGD-linear",
            d=d,
            m=m,
            n=n,
            matrices=0.0,
            extra_bytes=3.0 * min(n, self.chunk_size, max(1, BLOCK_BYTES // (8 * d))) * 8 * d
            + 8.0 * (n + 6 * m * d),
            work=steps * self._step_work(q * n, d, m),
            solves=f"{steps} noisy steps",
        )

    @staticmethod
    def _step_work(batch: float, d: int, m: int) -> float:
        """Work of one step on an expected batch of ``batch`` rows."""
        return 10.0 * batch * d * m + NORMAL_WORK * m * d

    def _releases(self, n: int, d: int, m: int) -> tuple[int, float]:
        if not (isinstance(self.ema_decay, int | float) and 0 <= self.ema_decay < 1):
            raise DPVisionError(f"ema_decay must be in [0, 1), got {self.ema_decay!r}")
        if self.loss not in LOSSES:
            raise DPVisionError(f"unknown loss {self.loss!r}; choose one of: {', '.join(LOSSES)}")
        if self.optimizer not in OPTIMIZERS:
            raise DPVisionError(
                f"unknown optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}"
            )
        return self._steps(n), self._sample_rate(n)

    def _fit_private(
        self, features: np.ndarray, labels: np.ndarray, fit: PrivateFit
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(features, torch.Tensor):  # read as NumPy rows (a CPU tensor: no copy)
            features = features.detach().cpu().numpy()
        n, d = features.shape
        q, steps = self._sample_rate(n), self._steps(n)
        release = GradientRelease(
            noise_multiplier=fit.sigma or 0.0,
            sample_rate=q,
            expected_batch_size=self.expected_batch_size or q * n,
            released=RELEASED,
        )
        head = _Head(fit.num_classes, d, self._bias_init())
        optimizer = self._torch_optimizer(head.parameters())
        if not self.fit_intercept:  # post-processing: the bias part's update is dropped
            optimizer.register_step_pre_hook(head.drop_bias_update)
        ema = ParameterEMA(head, self.ema_decay) if self.ema_decay > 0 else None
        context = ReleaseContext(fit.ledger, fit.generator, fit.workers, ema)
        sampler = self._sampler(n, q, steps, fit.generator, self.sampling_state)
        sq_norms = row_sq_norms(features, self.chunk_size)
        blocks = StepBlocks(features, self.chunk_size, fit.num_classes)
        policy = self._policy(release.expected_batch_size)
        for batch in sampler:
            batch = fit.workers.split(batch)  # this rank's share; the sums are all-reduced
            clipped = self._clipped_sum(features, labels, batch, head, sq_norms, policy, blocks)
            policy.observe(clipped.norms)  # private; only the adaptive count's release uses it
            noisy_step(
                clipped,
                {"theta": head.theta},
                release=release,
                policy=policy,
                optimizer=optimizer,
                context=context,
            )
            fit.progress.update(self._step_work(q * n, d, fit.num_classes))
        # Adaptive clipping: the last clip norm (post-processing of the noisy counts).
        self.final_clip_norm_ = policy.adapted_clip
        averaged = head if ema is None else ema.copy_to(_Head(fit.num_classes, d, 0.0))
        return averaged.weight.detach().clone(), averaged.bias.detach().clone()

    def _bias_init(self) -> float:
        """The bias's start: ``bias_init``, else −10 for the sigmoid loss (Mehta et al.)."""
        if not self.fit_intercept:
            return 0.0
        if self.bias_init is not None:
            return float(self.bias_init)
        return -10.0 if self.loss == "sigmoid" else 0.0

    def _torch_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """The first-order optimizer on the privatised gradient (post-processing)."""
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.learning_rate, betas=self.betas, eps=1e-8)
        momentum = self.momentum if self.optimizer == "momentum" else 0.0
        return torch.optim.SGD(params, lr=self.learning_rate, momentum=momentum)

    @staticmethod
    def _sampler(
        n: int, q: float, steps: int, generator: Any, seed: int | None = None
    ) -> PoissonSampler:
        """Poisson batches from ``seed`` (secret coins), else from the fit's secret
        randomness (the CSPRNG in secure mode)."""
        if isinstance(generator, SecureRandom):
            return PoissonSampler(num_examples=n, sample_rate=q, steps=steps, secure=True)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        return PoissonSampler(num_examples=n, sample_rate=q, steps=steps, seed=seed)

    def _clipped_sum(
        self,
        features: np.ndarray,
        labels: np.ndarray,
        batch: np.ndarray,
        head: "_Head",
        sq_norms: torch.Tensor,
        policy: ClipPolicy,
        blocks: StepBlocks,
    ) -> ClippedGradientSum:
        """Σ_{i∈batch} clip(gᵢ) of the head, one block of rows at a time.

        Each block of rows is read as stored into ``blocks`` (float32 features stay float32
        in memory) and widened to float64 there; its scores, eᵢ and clipped sum
        Σ cᵢeᵢ[xᵢ; 1]ᵀ are taken in float64 from those exact values, with ‖xᵢ‖² from
        :func:`row_sq_norms` of the same values.

        Each row's terms must not depend on where the row sits: where softmax is within
        rounding of 1, a last-bit change of a score can turn the direction of eᵢ, which
        clipping rescales to norm C, so one example inserted before a row, moving it by
        one place, could move that row's term by up to C. A GEMM's rounding of a row does
        depend on its place and on the number of rows (its alignment, the kernel's edge
        rows): privacy reviews moved the sum by 6.2 C with float32 scores, and by 5.5 C
        with MKL's edge rows of a float64 block at m = 100. So a block is scored by
        :meth:`StepBlocks.scores`, checked to give a row the same bits in every slot, and
        eᵢ's label entry is computed without cancellation (:func:`loss_gradient`)
        (``tests/learners/test_step_blocks.py`` keeps the reviews' constructions).

        Privacy:
          Releases nothing; the sum (weights and bias together, flattened as ``theta``) has
          the policy's L2 sensitivity C under add/remove-one: each example's clip factor and
          its term of the sum are computed in float64 from its stored row.
        """
        weight, bias = head.weight.detach(), head.bias.detach()
        grad_w, grad_b = torch.zeros_like(weight), torch.zeros_like(bias)
        norms = []
        for start in range(0, len(batch), blocks.size):
            index = batch[start : start + blocks.size]
            block, count = blocks.read(features, index), len(index)
            y = torch.zeros(blocks.size, dtype=torch.int64)  # a whole block's: see scores
            y[:count] = torch.from_numpy(np.asarray(labels[index], dtype=np.int64))
            errors = loss_gradient(blocks.scores(weight, bias), on_device(y), self.loss)[:count]
            gw, gb, chunk_norms = clipped_gradient_sum(
                block[:count],
                errors,
                policy.max_grad_norm,
                fit_intercept=self.fit_intercept,
                sq_norms=sq_norms[on_device(torch.from_numpy(index))],
            )
            grad_w += gw
            grad_b += gb
            norms.append(chunk_norms)
        return ClippedGradientSum(
            grads={"theta": torch.cat([grad_w.reshape(-1), grad_b])},
            l2_sensitivity=policy.l2_sensitivity,
            count=len(batch),
            nonfinite=0,  # not counted: an exact count would be a statistic of the data
            norms=torch.cat(norms) if norms else torch.zeros(0, dtype=torch.float64),
        )


RELEASED = "linear-head clipped gradient sum"


class _Head(torch.nn.Module):
    """The linear head's parameters as one flat vector θ = [W; b] (float64): one noisy
    release per step over both, as one tensor."""

    def __init__(self, num_classes: int, dim: int, bias: float) -> None:
        super().__init__()
        theta = torch.zeros(num_classes * dim + num_classes, dtype=torch.float64)
        theta[num_classes * dim :] = bias
        self.theta = torch.nn.Parameter(theta)
        self.shape = (num_classes, dim)
        self.bias_slice = slice(num_classes * dim, None)

    def drop_bias_update(self, *_: Any) -> None:
        """Zeroes the bias part of θ's gradient (an optimizer pre-step hook)."""
        if self.theta.grad is not None:
            self.theta.grad[self.bias_slice] = 0.0

    @property
    def weight(self) -> torch.Tensor:
        """W (a view of θ)."""
        return self.theta[: self.bias_slice.start].view(self.shape)

    @property
    def bias(self) -> torch.Tensor:
        """b (a view of θ)."""
        return self.theta[self.bias_slice]
