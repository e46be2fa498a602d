"""What an audit trains: many independent private trainings on D or on D' = D ∪ {z}.

Each target trains with the code users run, configured by the same :class:`TrainConfig` as
``dpvision train``, and returns the loss of the canary z under each trained model:

* :class:`LearnerTarget` (``dp-ls``, ``dp-newton``, ``dp-fc``, ``dp-sgd-linear``): each run
  is :func:`dpvision.runs.features.fit_learner` — the private preprocessing and the learner's
  ``fit`` that ``dpvision train`` calls — on the features of D or D'.
* :class:`DPSGDTarget` (``dp-sgd``): many runs of a small model at once. The R models'
  parameters are stacked (R, ...) and one logical step for all of them is made of dpvision's
  own DP-SGD pieces: :class:`~dpvision.mechanisms.PoissonSampler` draws each run's batch
  independently, :func:`~dpvision.data.augment.augment_views` makes the K views,
  :func:`~dpvision.per_example.reference.functional_clipped_sum` (the ``torch.func``
  reference clipping, vmapped over the runs) clips and sums, and the one DP-SGD update of
  the trainer and ``PrivacyEngine``, :func:`~dpvision.training.engine.noisy_step`, adds the
  noise at the clipped sum's stated sensitivity, records the step, steps the torch
  optimizer and updates the :class:`~dpvision.training.engine.ParameterEMA`, elementwise
  over the runs. With one run, the stacked step draws exactly the
  batches and the noise that :class:`~dpvision.training.engine.DPSGDStep` draws with the
  same seeds (a test checks the two give the same parameters).

All runs of a target start from the same initial parameters (as in De et al.; a random
initialisation only hides the canary), and every run's randomness is fresh.

Privacy: the audit data are the adversary's own; the ledger each run records is the
*claim* under test (:class:`PrivacyClaim`), taken from what actually ran.
"""

import abc
import dataclasses
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch.func import functional_call, vmap

from dpvision.accounting import PrivacyLedger, default_accountant
from dpvision.audit.canaries import AuditData
from dpvision.audit.gradient_canaries import GradientCanaries
from dpvision.averaging import ParameterEMA
from dpvision.config import TrainConfig
from dpvision.data.augment import augment_views
from dpvision.data.inputs import pixel_inputs
from dpvision.errors import DPVisionError
from dpvision.features import extract_features, feature_shape, parse_feature_spec
from dpvision.mechanisms import PoissonSampler
from dpvision.mechanisms.clip_policy import make_clip_policy
from dpvision.mechanisms.clipped_sum import ClippedGradientSum
from dpvision.mechanisms.gradient_release import (
    GradientRelease,
    ReleaseContext,
    noisy_step,
)
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.models.registry import build_model
from dpvision.per_example import functional_clipped_sum
from dpvision.runs import features as feature_runs
from dpvision.runs.auto import apply_recipe
from dpvision.runs.network import pixel_statistics
from dpvision.runs.schedule import noise_multiplier_for, run_seeds
from dpvision.training.optimizers import make_optimizer

Progress = Callable[[int], None]


@dataclasses.dataclass(frozen=True)
class PrivacyClaim:
    """The guarantee the audited training claims, read off the ledger of a run.

    Attributes:
      epsilon: ε at ``delta`` by ``accountant`` (∞ when a step ran without noise).
      delta: δ.
      accountant: the accountant that measured ε.
      noise_multiplier: σ of the run (None: no noise).
      steps: noisy releases.
      sample_rate: their Poisson rate (1: full batch).
      ledger: the ledger's entries.
    """

    epsilon: float
    delta: float
    accountant: str
    noise_multiplier: float | None
    steps: int
    sample_rate: float
    ledger: list[dict[str, Any]]

    @classmethod
    def from_ledger(
        cls, ledger: PrivacyLedger, delta: float, accountant: str | None
    ) -> "PrivacyClaim":
        private = ledger.is_private
        name = accountant or (default_accountant(ledger.dp_event()).value if private else "none")
        last = ledger.entries[-1]
        return cls(
            epsilon=ledger.epsilon(delta, accountant) if private else math.inf,
            delta=delta,
            accountant=name,
            noise_multiplier=last.noise_multiplier if private else None,
            steps=ledger.total_count,
            sample_rate=last.sample_rate,
            ledger=ledger.to_dict()["entries"],
        )


def _run_seed(seed: int, with_canary: bool, run: int) -> int:
    return int(np.random.SeedSequence([seed, int(with_canary), run]).generate_state(1)[0])


def _canary_loss(scores: torch.Tensor, label: int) -> torch.Tensor:
    """Cross-entropy of the canary's label under logits (..., m): the DP-SGD audit's score."""
    return -torch.log_softmax(scores.to(torch.float64), dim=-1)[..., label]


def _linear_loss(scores: torch.Tensor, label: int) -> torch.Tensor:
    """−(score of the canary's label): the feature learners' audit score.

    Their scores are one-vs-all regression outputs or margins, not logits; the canary's own
    class score is where its contribution to the released statistics (its row in b_y, its
    gradient) shows, and the other classes' scores only add noise. On DP-LS it separates
    D from D' markedly better than the cross-entropy of the scores.
    """
    return -scores[..., label].to(torch.float64)


def fix_learner_mechanism(
    config: TrainConfig,
    features: np.ndarray,
    labels: np.ndarray,
    channels: int,
    num_classes: int,
) -> tuple[TrainConfig, PrivacyClaim]:
    """The config whose fits all run one mechanism, and the claim of that mechanism.

    σ is calibrated once, by a fit on ``features`` (the audit's D, whose size is public)
    with the config's target ε; the returned config fixes that σ (and, for
    ``dp-sgd-linear``, q and T), so that fits on D plus canaries run exactly the same
    mechanism: the audited examples must not change it.
    """
    learner = feature_runs.fit_learner(
        config,
        features,
        labels,
        features[:1],
        channels,
        num_classes,
        secret=SecretRandomness(config.seed),  # the auditor's own, replayable runs
    ).learner
    sigma = learner.noise_multiplier_
    fixed_learner = dict(config.learner)
    if config.method == "dp-sgd-linear":
        n = len(features)
        q = learner._sample_rate(n)
        fixed_learner.update(sample_rate=q, steps=learner._steps(n), expected_batch_size=q * n)
    fixed = replace(
        config,
        epsilon=None if sigma is not None else math.inf,
        noise_multiplier=sigma,
        learner=fixed_learner,
    )
    return fixed, PrivacyClaim.from_ledger(learner.privacy_ledger_, config.delta, config.accountant)


class AuditTarget(abc.ABC):
    """Trains on D or D' many times and returns the canary's loss under each model."""

    def __init__(self, config: TrainConfig, data: AuditData) -> None:
        self.config, self.data = config, data

    claim: PrivacyClaim
    """The privacy guarantee each run claims at the config's δ (set by the subclass)."""

    @abc.abstractmethod
    def canary_losses(
        self, with_canary: bool, runs: int, seed: int, progress: Progress | None = None
    ) -> np.ndarray:
        """Trains ``runs`` independent models on D' (``with_canary``) or D; returns (runs,)
        canary losses. ``progress(k)`` is called as k more runs finish."""


class LearnerTarget(AuditTarget):
    """Feature learners (``dp-ls``, ``dp-newton``, ``dp-fc``, ``dp-sgd-linear``), one fit per run.

    The score of a run is −(the fitted model's score of the canary's label on z).

    σ is calibrated once, by a first fit on D with the config's target ε; the audited runs
    then use that σ (the mechanism is fixed before the data are: |D| is public).
    """

    def __init__(self, config: TrainConfig, data: AuditData) -> None:
        super().__init__(config, data)
        spec = parse_feature_spec(config.features)
        images, _ = data.training_set(with_canary=True)
        # Extraction is a fixed per-example map: it costs no privacy (dpvision.features).
        features = np.asarray(extract_features(images, spec, progress=False), dtype=np.float32)
        self.features, self.canary_features = features[:-1], features[-1:]
        if config.preprocessing.channels is not None:
            self.channels = config.preprocessing.channels
        elif spec.projection_dim is not None:
            self.channels = 1
        else:
            shape = feature_shape(tuple(images.shape[1:]), replace(spec, flatten=False))
            self.channels = int(shape[0])
        self.fixed, self.claim = fix_learner_mechanism(
            config, self.features, data.labels, self.channels, data.num_classes
        )

    def canary_losses(
        self, with_canary: bool, runs: int, seed: int, progress: Progress | None = None
    ) -> np.ndarray:
        if with_canary:
            train = np.concatenate([self.features, self.canary_features])
            labels = np.append(self.data.labels, self.data.canary_label)
        else:
            train, labels = self.features, self.data.labels
        losses = np.empty(runs)
        for run in range(runs):
            config = replace(self.fixed, seed=_run_seed(seed, with_canary, run) % 2**62)
            fitted = feature_runs.fit_learner(
                config,
                train,
                labels,
                self.canary_features,
                self.channels,
                self.data.num_classes,
                secret=SecretRandomness(config.seed),  # the auditor's runs: replayable
            )
            learner, canary = fitted.learner, fitted.test
            if learner.privacy_ledger_.to_dict()["entries"] != self.claim.ledger:
                raise DPVisionError("the audited runs recorded other releases than claimed")
            scores = torch.from_numpy(learner.decision_function(canary))
            losses[run] = float(_linear_loss(scores[0], self.data.canary_label))
            if progress is not None:
                progress(1)
        return losses


class _Stack(torch.nn.Module):
    """R runs' parameters, stacked along a leading axis, as one module for the optimizer and
    the EMA (parameter i is ``names[i]`` of the audited model)."""

    def __init__(self, params: dict[str, torch.Tensor], runs: int) -> None:
        super().__init__()
        self.names = list(params)
        for i, value in enumerate(params.values()):
            stacked = value.detach().unsqueeze(0).repeat(runs, *[1] * value.dim())
            self.register_parameter(f"p{i}", torch.nn.Parameter(stacked))

    def stacked(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"p{i}") for i, name in enumerate(self.names)}


class DPSGDTarget(AuditTarget):
    """``dp-sgd`` on pixels: many runs of one (small) model trained at once.

    Args:
      config: a ``dp-sgd`` config; ``learner.batch_size`` is the expected batch of the
        Poisson sampling on D, q = batch_size/|D|, the same q on D' (|D| is public).
      data: the audit data.
      memory_bytes: memory for per-example gradients; runs are trained in chunks that fit.
      public_size: the public dataset size q is computed from (default |D|).
    """

    def __init__(
        self,
        config: TrainConfig,
        data: AuditData,
        memory_bytes: int = 2**28,
        public_size: int | None = None,
    ) -> None:
        super().__init__(config, data)
        public_size = public_size or data.size
        if config.features != "pixels":
            raise DPVisionError("the dp-sgd audit trains on pixels: set features = pixels")
        options = config.dpsgd
        if options.clipping == "adaptive":
            raise DPVisionError(
                "the audit trains flat or per-layer clipping; audit adaptive clipping's "
                "mechanism at a fixed learner.max_grad_norm (clipping = 'flat')"
            )
        if options.batch_size > public_size:
            raise DPVisionError(
                f"learner.batch_size {options.batch_size} exceeds the audit dataset size "
                f"{public_size}"
            )
        self.options = options
        self.device = device = config.placement.device
        images, labels = data.training_set(with_canary=True)
        statistics = pixel_statistics(options, data.name, int(images.shape[-1]))
        self.inputs = pixel_inputs(images, data.name, statistics).to(device)
        self.targets = torch.as_tensor(labels, dtype=torch.long).to(device)
        self.sample_rate = options.batch_size / public_size
        self.public_size = public_size
        self.steps = (
            options.steps
            if options.steps is not None
            else math.ceil((options.epochs or 1.0) / self.sample_rate)
        )
        self.sigma = noise_multiplier_for(config, self.sample_rate, self.steps, PrivacyLedger())
        torch.manual_seed(run_seeds(config.seed)["init"])
        self.model = build_model(
            options.spec, tuple(self.inputs.shape[1:]), data.num_classes, groups=options.groups
        ).to(device)
        self.init = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        self.policy = make_clip_policy(
            options.clipping,
            options.max_grad_norm,
            expected_batch_size=self.sample_rate * self.public_size,
            model=self.model,
        )
        self.buffers = {k: v.detach() for k, v in self.model.named_buffers()}
        parameters = sum(v.numel() for v in self.init.values())
        views = max(options.augmult, 1)
        per_run = 4 * (data.size + 1) * (parameters + views * self.inputs[0].numel())
        self.chunk = max(1, memory_bytes // per_run)
        ledger = PrivacyLedger()
        if self.sigma > 0:
            ledger.record(
                noise_multiplier=self.sigma,
                sample_rate=self.sample_rate,
                count=self.steps,
                l2_sensitivity=options.max_grad_norm,
                released="DP-SGD clipped gradient sum",
            )
        else:
            ledger.record_non_private(released="DP-SGD clipped gradient sum", count=self.steps)
        self.claim = PrivacyClaim.from_ledger(ledger, config.delta, config.accountant)
        self.last_ledger: PrivacyLedger | None = None

    def canary_losses(
        self, with_canary: bool, runs: int, seed: int, progress: Progress | None = None
    ) -> np.ndarray:
        out = []
        for first in range(0, runs, self.chunk):
            count = min(self.chunk, runs - first)
            seeds = np.random.SeedSequence([seed, int(with_canary), first]).generate_state(3)
            params = self.train(
                with_canary,
                count,
                sampler_seed=int(seeds[0]),
                noise_seed=int(seeds[1]) % 2**63,
                augment_seed=int(seeds[2]) % 2**63,
            )
            assert self.last_ledger is not None
            if self.last_ledger.to_dict()["entries"] != self.claim.ledger:
                raise DPVisionError("the audited runs recorded other releases than claimed")
            with torch.no_grad():
                out.append(vmap(self._loss)(params).cpu().numpy())
            if progress is not None:
                progress(count)
        return np.concatenate(out)

    def _loss(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        scores = functional_call(self.model, (params, self.buffers), (self.inputs[-1:],))
        return _canary_loss(scores[0], self.data.canary_label)

    def train(
        self,
        with_canary: bool,
        runs: int,
        *,
        sampler_seed: int,
        noise_seed: int,
        augment_seed: int,
        gradient_canaries: "GradientCanaries | None" = None,
    ) -> dict[str, torch.Tensor]:
        """Trains ``runs`` models at once; returns their released parameters, stacked (the
        EMA when ``ema_decay`` > 0, as ``dpvision train`` reports).

        ``gradient_canaries`` (one run only): crafted examples whose gradient is a Dirac
        vector, sampled like every example and clipped by the same clipping, added to the
        clipped sum (the white-box canaries of a one-run audit).

        Privacy:
          Each run is DP-SGD on its own data: per step, one Poisson batch at rate q drawn
          independently for every run, per-example clipping to C, and Gaussian noise
          N(0, (σC)²) drawn independently for every run's parameters; one step of one run is
          one Poisson-sampled Gaussian release, recorded once per step in
          ``self.last_ledger`` (the ledger of each single run).
        """
        options = self.options
        n = self.data.size + int(with_canary)
        inputs, targets = self.inputs[:n], self.targets[:n]
        stack = _Stack(self.init, runs)
        optimizer = make_optimizer(options, stack)
        ema = ParameterEMA(stack, options.ema_decay) if options.ema_decay > 0 else None
        release = GradientRelease(
            noise_multiplier=self.sigma,
            sample_rate=self.sample_rate,
            expected_batch_size=self.sample_rate * self.public_size,
            normalize_update=options.normalize_update,
        )
        sampler = PoissonSampler(
            num_examples=runs * n, sample_rate=self.sample_rate, steps=self.steps, seed=sampler_seed
        )
        noise = torch.Generator(device=self.device).manual_seed(noise_seed)
        augment = torch.Generator().manual_seed(augment_seed)  # draws on the CPU, views on device
        ledger = PrivacyLedger()
        if gradient_canaries is not None and runs != 1:
            raise DPVisionError("gradient canaries are for one run at a time")

        clipped = self._clipped_sum(targets)
        for indices in sampler:
            keep = torch.zeros(runs * n, dtype=torch.bool, device=self.device)
            keep[torch.as_tensor(indices, dtype=torch.long, device=self.device)] = True
            batch, batch_dim = self._batch(inputs, runs, augment)
            params = {k: v.detach() for k, v in stack.stacked().items()}
            sums = vmap(clipped, in_dims=(0, batch_dim, 0))(params, batch, keep.view(runs, n))
            if gradient_canaries is not None:
                gradient_canaries.add_to(sums, self.sample_rate, self.policy)
            # Each run's clipped sum has sensitivity C; the noise is drawn for every run.
            total = ClippedGradientSum.zeros(
                stack.stacked(), l2_sensitivity=self.policy.l2_sensitivity
            )
            total.grads = sums
            noisy_step(
                total,
                stack.stacked(),
                release=release,
                policy=self.policy,
                optimizer=optimizer,
                context=ReleaseContext(ledger=ledger, generator=noise, ema=ema),
            )
        self.last_ledger = ledger
        if ema is not None:
            return {name: ema.shadow[f"p{i}"] for i, name in enumerate(stack.names)}
        return {k: v.detach() for k, v in stack.stacked().items()}

    def _clipped_sum(
        self, targets: torch.Tensor
    ) -> Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]:
        """One run's clipped gradient sum over the rows ``keep`` marks (vmapped over runs)."""

        def clipped(
            p: dict[str, torch.Tensor], batch: torch.Tensor, keep: torch.Tensor
        ) -> dict[str, torch.Tensor]:
            grads, _, _ = functional_clipped_sum(
                self.model,
                lambda out, y: F.cross_entropy(out, y, reduction="none"),
                p,
                self.buffers,
                batch,
                targets,
                keep,
                policy=self.policy,
            )
            return grads

        return clipped

    def _batch(
        self, inputs: torch.Tensor, runs: int, augment: torch.Generator
    ) -> tuple[torch.Tensor, int | None]:
        """The step's inputs for every run (K augmented views each, drawn from the public
        ``augment``), and the dimension vmap maps over (None: shared by the runs)."""
        options, n = self.options, inputs.shape[0]
        if not options.augmult:
            return inputs.unsqueeze(1), None
        views = augment_views(
            inputs.repeat(runs, 1, 1, 1),
            options.augmult,
            augment,
            padding=options.crop_padding,
            flip=options.flip,
            mode=options.padding_mode,
        )
        return views.view(runs, n, *views.shape[1:]), 0


def make_target(config: TrainConfig, data: AuditData) -> AuditTarget:
    """The audit target for ``config.method``, what it leaves ``auto`` resolved as
    ``dpvision train`` resolves it."""
    config, _ = apply_recipe(config)
    if config.method == "dp-randp":
        raise DPVisionError(
            "dpvision audit does not train dp-randp runs; audit its DP-SGD engine with "
            "--method dp-sgd (Phases II and III are the same noisy steps)"
        )
    if config.method == "dp-sgd":
        return DPSGDTarget(config, data)
    return LearnerTarget(config, data)
