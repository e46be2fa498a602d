"""What a one-run audit trains: dpvision's own training paths, once, with m canaries.

Each of m canaries joins the audit's D with probability ½ (coins from the audit's seed);
dpvision trains once on D and the canaries drawn in, through the code users run, and
every canary gets a score (higher: more likely trained on), which
:func:`dpvision.audit.one_run.audit_one_run` turns into an ε lower bound.

Canaries (:data:`ONE_RUN_CANARIES`):

* ``dirac`` — white-box canaries that only they and the noise can move, scored on what the
  mechanism *releases* (:func:`dpvision.mechanisms.watching_released`; everything after is
  post-processing):

  - feature learners: the features of D get m extra coordinates that D never uses; canary
    i is 10·C times the i-th of them, with a random label, so once clipped it is C·e_{d+i}.
    Its score sums, over the learner's releases, what it adds there (:data:`CANARY_SIGNAL`:
    b̃ of its class, the diagonals of G̃ and Ã, the gradient sums), each over its noise;
  - ``dp-sgd``: :class:`~dpvision.audit.targets.GradientCanaries`, examples whose gradient
    is 10·C times a Dirac vector at one of m distinct random parameter coordinates,
    sampled and clipped like every example; scored by the released noisy gradient sums
    at its coordinate, summed over the steps, over C.

* ``mislabeled`` — black-box input canaries: m further training images of the dataset
  (after the first |D|) with their labels moved to a random other class, scored by −loss
  (``dp-sgd``) or by the fitted model's score of the canary's label.

The mechanism is fixed before the coins are drawn: σ (and q, T where they depend on the
dataset size) come from the public sizes, as in :mod:`dpvision.audit.targets`.
"""

import abc
import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.func import functional_call

from dpvision.audit.canaries import AuditData
from dpvision.audit.targets import (
    DPSGDTarget,
    GradientCanaries,
    PrivacyClaim,
    fix_learner_mechanism,
)
from dpvision.config import TrainConfig
from dpvision.data.core import ImageDataset
from dpvision.data.inputs import pixel_inputs
from dpvision.errors import DPVisionError
from dpvision.features import extract_features, parse_feature_spec
from dpvision.learners import LEARNERS
from dpvision.mechanisms import Release, watching_released
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.runs import features as feature_runs
from dpvision.runs.network import pixel_statistics
from dpvision.seeds import public_rng, public_sequence

ONE_RUN_CANARIES = ("dirac", "mislabeled")
DIRAC_SCALE = 10.0
"""A Dirac canary's one coordinate, in units of the learner's largest clip norm C: clipped
to exactly C·e (so clipping that is skipped shows), yet small enough for the learner's own
forward pass to stay in its range."""


@dataclass(frozen=True)
class CanaryPlan:
    """|D| (``size``), m (``canaries``), the canary kind and the seed of a one-run audit."""

    size: int
    canaries: int
    canary: str
    seed: int


class OneRunTarget(abc.ABC):
    """Trains once on D and the included canaries; scores every canary.

    Attributes:
      claim: the guarantee the run claims (from the ledger of the fixed mechanism).
      score: what the scores are, in words (for the report).
      canary_labels: the canaries' labels.
    """

    claim: PrivacyClaim
    score: str
    canary_labels: np.ndarray

    @property
    def canaries(self) -> int:
        """m."""
        return len(self.canary_labels)

    @abc.abstractmethod
    def scores(self, included: np.ndarray, seed: int) -> np.ndarray:
        """Trains once with canary i in the training set iff ``included[i]``; returns the
        (m,) scores."""


def _labels(rng: np.random.Generator, m: int, num_classes: int) -> np.ndarray:
    return rng.integers(0, num_classes, m).astype(np.int64)


def _largest_clip_norm(config: TrainConfig, num_classes: int) -> float:
    learner = LEARNERS[config.method](num_classes=num_classes, **config.learner)
    norms = [v for k, v in learner.get_params().items() if k.endswith("clip_norm")]
    return float(max(norms, default=1.0))


def _mislabeled(
    dataset: ImageDataset, size: int, m: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    if size + m > dataset.num_train:
        raise DPVisionError(
            f"mislabeled canaries are training images after the first {size}: {dataset.name} "
            f"has {dataset.num_train} training images, fewer than {size} + {m}"
        )
    images = np.asarray(dataset.train_images[size : size + m])
    shift = rng.integers(1, dataset.num_classes, m)
    labels = (np.asarray(dataset.train_labels[size : size + m]) + shift) % dataset.num_classes
    return images, labels.astype(np.int64)


class LearnerOneRun(OneRunTarget):
    """A feature learner (``dp-ls``, ``dp-newton``, ``dp-fc``, ``dp-sgd-linear``), fitted
    once by :func:`dpvision.runs.features.fit_learner` on D and the included canaries."""

    def __init__(self, config: TrainConfig, dataset: ImageDataset, plan: CanaryPlan) -> None:
        size, canaries, canary, seed = plan.size, plan.canaries, plan.canary, plan.seed
        self.config, self.kind = config, canary
        self.num_classes = dataset.num_classes
        rng = public_rng(seed, "one-run audit canaries")
        spec = parse_feature_spec(config.features)
        images = np.asarray(dataset.train_images[:size])
        self.labels = np.asarray(dataset.train_labels[:size], dtype=np.int64)
        if canary == "dirac":
            if config.preprocessing.kind != "none":
                raise DPVisionError(
                    "dirac canaries audit the learner on the feature vectors themselves: set "
                    "preprocessing.kind = 'none', or audit with --canary mislabeled"
                )
            # Extraction is a fixed per-example map: it costs no privacy (dpvision.features).
            base = np.asarray(extract_features(images, spec, progress=False), np.float32)
            self.base_features = base
            d = base.shape[1]
            self.features = np.concatenate([base, np.zeros((size, canaries), np.float32)], 1)
            self.canary_features = np.zeros((canaries, d + canaries), np.float32)
            scale = DIRAC_SCALE * _largest_clip_norm(config, dataset.num_classes)
            self.canary_features[np.arange(canaries), d + np.arange(canaries)] = scale
            self.canary_labels = _labels(rng, canaries, dataset.num_classes)
            self.coordinates = d + np.arange(canaries)
            channels = 1
        else:
            canary_images, self.canary_labels = _mislabeled(dataset, size, canaries, rng)
            both = np.concatenate([images, canary_images])
            extracted = np.asarray(extract_features(both, spec, progress=False), np.float32)
            self.features, self.canary_features = extracted[:size], extracted[size:]
            self.base_features = self.features
            channels = (
                config.preprocessing.channels
                if config.preprocessing.channels is not None
                else (1 if spec.projection_dim is not None else int(images.shape[-1]))
            )
        self.channels = channels
        # σ (and q, T) depend on |D|, ε and δ, not on the feature dimension: calibrated on
        # D's own features, without the canaries' empty coordinates.
        self.fixed, self.claim = fix_learner_mechanism(
            config, self.base_features, self.labels, channels, dataset.num_classes
        )
        self.statistics = canary == "dirac"
        self.score = (
            "released statistics at the canary's coordinate, each over its noise scale"
            if self.statistics
            else "the fitted model's score of the canary's label"
        )

    def scores(self, included: np.ndarray, seed: int) -> np.ndarray:
        chosen = np.flatnonzero(included)
        train = np.concatenate([self.features, self.canary_features[chosen]])
        labels = np.concatenate([self.labels, self.canary_labels[chosen]])
        order = public_rng(seed, "one-run audit order").permutation(len(train))
        run_seed = int(public_sequence(seed, "one-run audit runs").generate_state(1)[0])
        released: list[Release] = []
        with watching_released(released.append if self.statistics else lambda _: None):
            fitted = feature_runs.fit_learner(
                replace(self.fixed, seed=run_seed),
                train[order],
                labels[order],
                self.canary_features,
                self.channels,
                self.num_classes,
                secret=SecretRandomness(run_seed),  # the auditor's run: replayable
            )
        if fitted.learner.privacy_ledger_.to_dict()["entries"] != self.claim.ledger:
            raise DPVisionError("the audited run recorded other releases than claimed")
        if self.statistics:
            return released_scores(released, self.canary_labels, self.coordinates, self.num_classes)
        scores = fitted.learner.decision_function(fitted.test)
        return np.asarray(scores[np.arange(self.canaries), self.canary_labels], np.float64)


# How a Dirac canary (clipped to C·e_j, label y) shows in each release of a feature
# learner, by the release's ledger name: ``label`` +V[y, j]; ``gradient`` −V[y, j] and
# +V[k, j]/(m − 1) for the other classes k (a loss gradient lowers the label's weight and
# raises the others' a little); ``gradient, all classes`` −V[y, j] + Σₖ V[k, j] (one-vs-all
# losses at 0: every class moves as much); ``diagonal`` V[j, j]; ``class diagonal``
# V[y, j, j]; ``all diagonals`` Σₖ V[k, j, j]. The white-box auditor knows the mechanism
# it audits.
CANARY_SIGNAL = {
    "DP-LS G": "diagonal",
    "DP-LS b_j": "label",
    "DP-LS A_j": "class diagonal",
    "DP-FC feature covariance": "diagonal",
    "DP-FC clipped gradient sum": "gradient",
    "DP-Newton gradient sums": "gradient, all classes",
    "DP-Newton Hessian sums": "all diagonals",
    "linear-head clipped gradient sum": "gradient",
}


def released_scores(
    released: list[Release], labels: np.ndarray, coordinates: np.ndarray, num_classes: int
) -> np.ndarray:
    """The white-box score of Dirac canaries: for every release (parts joined), what the
    canary adds at its coordinate (:data:`CANARY_SIGNAL`), over the release's sensitivity
    and the norm of the weights, summed over the releases.

    Each term is then the canary's share of the release (0 when it was left out) plus
    Gaussian noise of standard deviation σ, the noise multiplier of the release.
    """
    joined: list[Release] = []
    for release in released:
        if release.part and joined:
            last = joined[-1]
            value = torch.cat([last.value, release.value])
            joined[-1] = Release(last.released, value, last.l2_sensitivity)
        else:
            joined.append(release)
    m = len(labels)
    rows, y = torch.arange(m), torch.from_numpy(labels)
    j = torch.from_numpy(coordinates)
    dim = int(coordinates.max()) + 1  # the canaries' coordinates are the last ones
    total = torch.zeros(m, dtype=torch.float64)
    used = 0
    for release in joined:
        kind = CANARY_SIGNAL.get(release.released)
        if kind is None:
            continue
        value = release.value.to(torch.float64).cpu()
        if value.dim() == 1:  # weights, then intercepts
            value = value[: num_classes * dim].reshape(num_classes, dim)
        if kind == "label":
            term = value[y, j]
        elif kind.startswith("gradient"):
            other = 1.0 if kind.endswith("all classes") else 1.0 / max(num_classes - 1, 1)
            weights = torch.full((m, num_classes), other, dtype=torch.float64)
            weights[rows, y] = -1.0
            term = (value[:, j].T * weights).sum(1) / weights.norm(dim=1)
        elif kind == "diagonal":
            term = value[j, j]
        elif kind == "class diagonal":
            term = value[y, j, j]
        else:
            term = value[:, j, j].sum(0) / math.sqrt(num_classes)
        total += term / release.l2_sensitivity
        used += 1
    if not used:
        raise DPVisionError("the audited learner made no release a Dirac canary shows in")
    return total.numpy()


class DPSGDOneRun(OneRunTarget):
    """``dp-sgd`` on pixels, trained once with :class:`~dpvision.audit.targets.DPSGDTarget`'s
    step (the engine's own pieces, step for step the ``DPSGDStep`` engine); q is
    batch_size/(|D| + m), fixed before the coins.

    ``dirac`` canaries are :class:`~dpvision.audit.targets.GradientCanaries` at m distinct
    random parameter coordinates, scored by the sum over steps of the released noisy
    gradient sum at the canary's coordinate, over C; ``mislabeled`` canaries by
    −cross-entropy under the trained model.
    """

    def __init__(self, config: TrainConfig, dataset: ImageDataset, plan: CanaryPlan) -> None:
        size, canaries, canary, seed = plan.size, plan.canaries, plan.canary, plan.seed
        if config.features != "pixels":
            raise DPVisionError("the dp-sgd audit trains on pixels: set features = pixels")
        rng = public_rng(seed, "one-run audit canaries")
        self.config, self.dataset, self.kind = config, dataset, canary
        self.images = np.asarray(dataset.train_images[:size])
        self.labels = np.asarray(dataset.train_labels[:size], dtype=np.int64)
        self.public_size = size + canaries
        if canary == "mislabeled":
            self.canary_images, self.canary_labels = _mislabeled(dataset, size, canaries, rng)
            self.score = "−cross-entropy of the canary under the trained model"
        else:
            self.canary_images = self.images[:1]
            self.canary_labels = np.zeros(canaries, dtype=np.int64)
            self.score = (
                "released noisy gradient sums at the canary's coordinate, summed over steps, over C"
            )
        # The claim, from a target built on D (its σ, q and T are those of every run).
        target = self._target(self.images, self.labels)
        self.claim = target.claim
        parameters = sum(v.numel() for v in target.init.values())
        if canary == "dirac":
            if canaries > parameters:
                raise DPVisionError(
                    f"{canaries} Dirac gradient canaries need as many parameters; the model "
                    f"has {parameters}"
                )
            self.coordinates = rng.choice(parameters, canaries, replace=False)

    def _target(self, images: np.ndarray, labels: np.ndarray) -> DPSGDTarget:
        data = AuditData(
            name=self.dataset.name,
            images=images,
            labels=labels,
            canary=self.kind,
            canary_image=self.canary_images[0],
            canary_label=int(self.canary_labels[0]),
            num_classes=self.dataset.num_classes,
        )
        return DPSGDTarget(self.config, data, public_size=self.public_size)

    def scores(self, included: np.ndarray, seed: int) -> np.ndarray:
        images, labels = self.images, self.labels
        gradient_canaries = None
        if self.kind == "mislabeled":
            chosen = np.flatnonzero(included)
            images = np.concatenate([images, self.canary_images[chosen]])
            labels = np.concatenate([labels, self.canary_labels[chosen]])
        else:
            draws = int(public_sequence(seed, "one-run audit gradient draws").generate_state(1)[0])
            gradient_canaries = GradientCanaries(self.coordinates, included, seed=draws)
        order = public_rng(seed, "one-run audit order").permutation(len(images))
        target = self._target(images[order], labels[order])
        states = public_sequence(seed, "one-run audit runs").generate_state(3)
        released: list[Release] = []
        with watching_released(released.append if gradient_canaries else lambda _: None):
            params = target.train(
                False,
                1,
                sampler_seed=int(states[0]),
                noise_seed=int(states[1]) % 2**63,
                augment_seed=int(states[2]) % 2**63,
                gradient_canaries=gradient_canaries,
            )
        assert target.last_ledger is not None
        if target.last_ledger.to_dict()["entries"] != self.claim.ledger:
            raise DPVisionError("the audited run recorded other releases than claimed")
        if gradient_canaries is not None:
            steps: list[list[torch.Tensor]] = []
            for release in released:  # one step: its parameters' parts, in order
                if not release.part:
                    steps.append([])
                steps[-1].append(release.value[0].reshape(-1).to(torch.float64).cpu())
            flat = torch.stack([torch.cat(parts) for parts in steps])
            clip = self.config.dpsgd.max_grad_norm
            return (flat[:, torch.from_numpy(self.coordinates)].sum(0) / clip).numpy()
        options = self.config.dpsgd
        statistics = pixel_statistics(options, self.dataset.name, self.canary_images.shape[-1])
        inputs = pixel_inputs(self.canary_images, self.dataset.name, statistics).to(target.device)
        one = {name: value[0] for name, value in params.items()}
        with torch.no_grad():
            logits = functional_call(target.model, (one, target.buffers), (inputs,))
        targets = torch.as_tensor(self.canary_labels, device=logits.device)
        log_probs = torch.log_softmax(logits.to(torch.float64), dim=-1)
        return log_probs.gather(1, targets[:, None])[:, 0].cpu().numpy()


def make_one_run_target(
    config: TrainConfig,
    dataset: ImageDataset,
    *,
    size: int,
    canaries: int,
    canary: str | None,
    seed: int,
) -> OneRunTarget:
    """The one-run target of ``config.method`` (``canary`` None: ``dirac``)."""
    if config.method == "dp-randp":
        raise DPVisionError(
            "dpvision audit does not train dp-randp runs; audit its DP-SGD engine with "
            "--method dp-sgd"
        )
    if canary is not None and canary not in ONE_RUN_CANARIES:
        raise DPVisionError(
            f"unknown one-run canary {canary!r}; choose from {', '.join(ONE_RUN_CANARIES)}"
        )
    target = DPSGDOneRun if config.method == "dp-sgd" else LearnerOneRun
    return target(config, dataset, CanaryPlan(size, canaries, canary or "dirac", seed))
