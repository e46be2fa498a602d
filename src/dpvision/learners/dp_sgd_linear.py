"""DP-SGD, DP-SGD with momentum and DP-Adam on a linear head (Mehta et al. Algorithm 1;
Tramèr & Boneh's ScatterNet+linear).

For a linear model z = Wx + b and a loss ℓ(z, y), example i's gradient is
∂ℓ/∂W = eᵢxᵢᵀ, ∂ℓ/∂b = eᵢ with eᵢ = ∂ℓ/∂z, so its norm is ‖eᵢ‖·√(‖xᵢ‖² + 1) in closed form
and the clipped sum Σᵢ cᵢ eᵢ[xᵢ; 1]ᵀ is one matrix product: no per-example gradient is ever
materialised.
"""

import math
from collections.abc import Callable

import numpy as np
import torch

from dpvision.accounting import PrivacyLedger
from dpvision.averaging import ema_decay as ema_schedule
from dpvision.errors import DPVisionError
from dpvision.learners.base import DPLinearClassifier, PrivateFit
from dpvision.learners.statistics import DEFAULT_CHUNK_SIZE, on_device, read_rows
from dpvision.mechanisms import AdaptiveClipping, SecureRandom, clipping, release_gaussian

LOSSES = ("softmax", "sigmoid")
OPTIMIZERS = ("sgd", "momentum", "adam")


def loss_gradient(scores: torch.Tensor, labels: torch.Tensor, loss: str) -> torch.Tensor:
    """eᵢ = ∂ℓ/∂zᵢ for a batch: softmax cross-entropy, or one-vs-all sigmoid cross-entropy.

    ``scores`` (b, m) may be overwritten (the sigmoid is taken in place): pass a fresh
    product. The target is subtracted at the label only, with no (b, m) one-hot matrix, so
    the whole takes one pass over b·m numbers.
    """
    errors = torch.softmax(scores, dim=1) if loss == "softmax" else scores.sigmoid_()
    errors[torch.arange(len(labels), device=labels.device), labels] -= 1.0
    return errors


def clipped_gradient_sum(
    x: torch.Tensor,
    errors: torch.Tensor,
    clip_norm: float,
    *,
    fit_intercept: bool,
    sq_norms: torch.Tensor | None = None,
    unclipped: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Σᵢ clip(gᵢ, C) for the linear head, with gᵢ = eᵢ[xᵢ; 1]ᵀ, via one GEMM.

    Args:
      x: (b, d) features; errors: (b, m) loss gradients eᵢ (scaled in place: overwritten).
      clip_norm: C.
      fit_intercept: whether gᵢ includes the bias part eᵢ.
      sq_norms: ‖xᵢ‖² if already known (saves a pass over x).
      unclipped: a scalar tensor the number of examples with ‖gᵢ‖ ≤ C is added to (exact,
        private: adaptive clipping releases it only with noise).

    Returns:
      (weight-gradient sum (m, d), bias-gradient sum (m,), number of non-finite per-example
      gradients, which were zeroed). Each example contributes at most C in L2 norm (pass
      float64 tensors: in float32, rounding can exceed C by ~1e-6 relative).
    """
    if sq_norms is None:
        sq_norms = (x * x).sum(dim=1)
    sq_norms = sq_norms.to(errors.dtype) + (1.0 if fit_intercept else 0.0)
    norms = torch.linalg.vector_norm(errors, dim=1) * torch.sqrt(sq_norms)
    finite = torch.isfinite(norms)  # a non-finite entry of xᵢ or eᵢ makes its norm non-finite
    bad = int((~finite).sum())
    if unclipped is not None:
        unclipped += (norms <= clip_norm).sum().to(unclipped.dtype)
    scale = clipping.clip_factors(norms, clip_norm)
    if bad:
        x = torch.where(finite.unsqueeze(1), x, torch.zeros_like(x))
        errors = torch.where(finite.unsqueeze(1), errors, torch.zeros_like(errors))
    weighted = errors.mul_(scale[:, None])
    grad_w = (weighted.T @ x).to(torch.float64)
    if fit_intercept:
        grad_b = weighted.sum(dim=0, dtype=torch.float64)
    else:
        grad_b = torch.zeros(errors.shape[1], dtype=torch.float64)
    return grad_w, grad_b, bad


def row_sq_norms(features: np.ndarray, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """‖xᵢ‖² of every row, in float64, one chunk at a time (non-finite rows give inf/nan)."""
    out = torch.empty(len(features), dtype=torch.float64)
    for start in range(0, len(features), chunk_size):
        chunk = read_rows(features, slice(start, start + chunk_size)).cpu().numpy()
        out[start : start + len(chunk)] = torch.from_numpy(np.einsum("ij,ij->i", chunk, chunk))
    return out


def _rows(features: np.ndarray, index: np.ndarray) -> torch.Tensor:
    # float64 throughout: in float32 the clipped contribution of one example was measured
    # to exceed C by 4e-6 (relative), which would break the stated sensitivity.
    return read_rows(features, index)


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
      clipping_mode: ``flat``, or ``adaptive``: C starts at ``clip_norm`` and follows a
        quantile of the per-example norms (:mod:`dpvision.mechanisms.adaptive_clipping`;
        each step also releases the unclipped count, and σ is split between the two).
      target_unclipped_quantile: ``adaptive`` only, γ (Opacus' names, as in ``dpvision
        train``'s DP-SGD options).
      clipbound_learning_rate: η of the geometric update of C.
      unclipped_num_std: σ_b of the count (default: the expected batch size over 20).
      min_clipbound, max_clipbound: the bounds on C.

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
        clipping_mode: str = "flat",
        target_unclipped_quantile: float = 0.5,
        clipbound_learning_rate: float = 0.2,
        unclipped_num_std: float | None = None,
        min_clipbound: float = 1e-6,
        max_clipbound: float = 1e6,
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
        self.secure_mode = secure_mode
        self.num_classes = num_classes
        self.chunk_size = chunk_size
        self.device = device
        self.sample_rate = sample_rate
        self.steps = steps
        self.expected_batch_size = expected_batch_size
        self.ema_decay = ema_decay
        self.clipping_mode = clipping_mode
        self.target_unclipped_quantile = target_unclipped_quantile
        self.clipbound_learning_rate = clipbound_learning_rate
        self.unclipped_num_std = unclipped_num_std
        self.min_clipbound = min_clipbound
        self.max_clipbound = max_clipbound

    def _adaptive(self, expected_batch: float) -> AdaptiveClipping | None:
        """The adaptive clip norm of ``clipping_mode = "adaptive"`` (None: flat)."""
        if self.clipping_mode == "flat":
            return None
        if self.clipping_mode != "adaptive":
            raise DPVisionError(
                f"clipping_mode must be 'flat' or 'adaptive', got {self.clipping_mode!r}"
            )
        std = self.unclipped_num_std
        return AdaptiveClipping(
            initial=float(self.clip_norm),
            count_noise=expected_batch / 20 if std is None else float(std),
            target_quantile=self.target_unclipped_quantile,
            learning_rate=self.clipbound_learning_rate,
            min_clip=self.min_clipbound,
            max_clip=self.max_clipbound,
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
        num_classes, sigma, ledger, generator, workers = fit.unpack()
        n, d = features.shape
        q, steps = self._sample_rate(n), self._steps(n)
        expected_batch = self.expected_batch_size or q * n
        weight = torch.zeros(num_classes, d, dtype=torch.float64)
        bias_init = (
            self.bias_init
            if self.bias_init is not None
            else (-10.0 if self.loss == "sigmoid" else 0.0)
        )
        bias = torch.full(
            (num_classes,), float(bias_init) if self.fit_intercept else 0.0, dtype=torch.float64
        )
        state: dict[str, torch.Tensor] = {}
        # The EMA starts from the initial parameters, as ParameterEMA's does.
        average = (weight.clone(), bias.clone()) if self.ema_decay > 0 else None
        uniforms: Callable[[int, int], np.ndarray]
        if isinstance(generator, SecureRandom):  # the batches, too, from the CSPRNG
            uniforms = lambda count, _: generator.uniform(count)  # noqa: E731
        else:
            # One stream per step: example i's coin at step t is the same whatever comes
            # after i (i.i.d. secret coins; a neighbour appended keeps the others' coins).
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            uniforms = lambda count, t: np.random.default_rng([seed, t]).random(count)  # noqa: E731
        sq_norms = row_sq_norms(features, self.chunk_size)
        all_rows = np.arange(n)
        adaptive = self._adaptive(expected_batch)
        sum_sigma = sigma
        if adaptive is not None and sigma is not None:
            sum_sigma = adaptive.sum_noise_multiplier(sigma)  # the count takes the rest
        for step in range(steps):
            clip = self.clip_norm if adaptive is None else adaptive.clip
            unclipped = None if adaptive is None else torch.zeros((), dtype=torch.float64)
            # Poisson sampling: every example joins independently with probability q.
            batch = np.flatnonzero(uniforms(n, step) < q) if q < 1 else all_rows
            batch = workers.split(batch)  # this rank's share; the sums are all-reduced below
            grad_w = torch.zeros_like(weight)
            grad_b = torch.zeros_like(bias)
            for start in range(0, len(batch), self.chunk_size):
                index = batch[start : start + self.chunk_size]
                x = _rows(features, index)
                y = on_device(torch.from_numpy(np.asarray(labels[index], dtype=np.int64)))
                errors = loss_gradient(torch.addmm(bias, x, weight.T), y, self.loss)
                gw, gb, _ = clipped_gradient_sum(
                    x,
                    errors,
                    clip,
                    fit_intercept=self.fit_intercept,
                    sq_norms=sq_norms[on_device(torch.from_numpy(index))],
                    unclipped=unclipped,
                )
                grad_w += gw
                grad_b += gb
            workers.all_reduce_([grad_w, grad_b])
            flat = torch.cat([grad_w.reshape(-1), grad_b])
            flat = release_gaussian(
                flat,
                l2_sensitivity=clip,
                noise_multiplier=sum_sigma,
                ledger=ledger if adaptive is None else PrivacyLedger(),
                released="linear-head clipped gradient sum",
                sample_rate=q,
                generator=generator,
            )
            if adaptive is not None and unclipped is not None:
                workers.all_reduce_([unclipped])
                adaptive.release(
                    unclipped,
                    sigma=sigma,
                    sample_rate=q,
                    expected_batch_size=expected_batch,
                    ledger=ledger,
                    generator=generator,
                    released="linear-head clipped gradient sum",
                )
            update = self._optimizer_step(flat / expected_batch, state, step)
            weight -= update[: weight.numel()].reshape(weight.shape)
            if self.fit_intercept:
                bias -= update[weight.numel() :]
            if average is not None:
                mu = ema_schedule(self.ema_decay, step)
                for mean, value in zip(average, (weight, bias), strict=True):
                    mean.mul_(mu).add_(value, alpha=1 - mu)
        # Adaptive clipping: the last clip norm (post-processing of the noisy counts).
        self.final_clip_norm_ = None if adaptive is None else adaptive.clip
        return average if average is not None else (weight, bias)

    def _optimizer_step(
        self, grad: torch.Tensor, state: dict[str, torch.Tensor], step: int
    ) -> torch.Tensor:
        """Post-processing of the privatised gradient into a parameter update."""
        lr = self.learning_rate
        if self.optimizer == "sgd":
            return lr * grad
        if self.optimizer == "momentum":
            velocity = state.get("velocity", torch.zeros_like(grad)) * self.momentum + grad
            state["velocity"] = velocity
            return lr * velocity
        beta1, beta2 = self.betas
        m = state.get("m", torch.zeros_like(grad)) * beta1 + (1 - beta1) * grad
        v = state.get("v", torch.zeros_like(grad)) * beta2 + (1 - beta2) * grad * grad
        state["m"], state["v"] = m, v
        m_hat = m / (1 - beta1 ** (step + 1))
        v_hat = v / (1 - beta2 ** (step + 1))
        return lr * m_hat / (v_hat.sqrt() + 1e-8)
