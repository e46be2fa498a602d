"""``dpvision train --method dp-sgd`` and ``dp-randp``: DP-SGD on deep image models, end to end.

One logical step (De et al. 2022, Alg. 1, with the choices of TAN/DP-RandP):

1. Poisson-sample the logical batch at q = B/N (:class:`dpvision.mechanisms.PoissonSampler`);
2. cut it into physical micro-batches of ``physical_batch_size`` examples, with K augmented
   views of each example when ``augmult`` ≥ 1 (:mod:`dpvision.training.batching`);
3. clip each example's gradient (the mean over its views) to C, sum, add N(0, (σC)²) once,
   divide by the public qN, step the optimizer and update the parameter EMA
   (:func:`dpvision.training.engine.noisy_step`, the one DP-SGD update).

Checkpoints (:mod:`dpvision.training.checkpoint`) make a killed run resumable bit for bit.
Under ``torchrun`` (:mod:`dpvision.distributed`) every rank samples the same logical batch
and draws the same augmentations, clips its contiguous share, and the clipped sums are
all-reduced before the one noise draw; the run, its checkpoints and its ledger are those of
one process with the same seed (up to the order of float additions), so a run may also be
resumed with another number of processes. Rank 0 alone writes the checkpoint.

Randomness: the public ``seed`` draws the initialisation and the augmentations; the noise,
the Poisson batches, the private preprocessing's noise, the validation split and its noisy
counts come from the run's secret randomness (:mod:`dpvision.mechanisms.secret`), shared by
every rank and kept in the checkpoint (mode 0600).
"""

import copy
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)

from dpvision.accounting import PrivacyLedger, calibrate_noise_multiplier, default_accountant
from dpvision.config import TrainConfig
from dpvision.data.inputs import DATASET_STATISTICS, LazyInputs, TrainingData, lazy_pixel_inputs
from dpvision.data.splits import public_digests, training_rows
from dpvision.distributed import Workers, current
from dpvision.errors import DPVisionError
from dpvision.features import feature_shape, load_or_extract, parse_feature_spec
from dpvision.features.backbone import encoder_digest
from dpvision.features.preprocessing import FittedPreprocessing, preprocess
from dpvision.log import progress, say
from dpvision.mechanisms import PoissonSampler
from dpvision.mechanisms.adaptive_clipping import AdaptiveClipping
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.models.encoder import load_into
from dpvision.models.finetune import apply_finetune
from dpvision.models.registry import build_network, is_external, prepare_for_dp
from dpvision.models.validation import validate_model
from dpvision.models.weights import load_weights, read_weights
from dpvision.per_example import per_layer
from dpvision.runs.saved import TrainedModel, privacy_of
from dpvision.runs.transfer import transfer_plan
from dpvision.runs.validation import ValidationRelease
from dpvision.training.batching import micro_batches
from dpvision.training.checkpoint import (
    TrainingState,
    fingerprint,
    resume,
    save_checkpoint,
    state_digest,
)
from dpvision.training.engine import DPSGDStep, ParameterEMA
from dpvision.training.evaluation import evaluate
from dpvision.training.memory import check_memory, memory_error
from dpvision.training.options import DPSGDOptions
from dpvision.training.supervised import rows_trained_on
from dpvision.training.transfer import TransferPlan, phase_optimizer

PROGRESS_SECONDS = 30  # a progress line at least this often


def run_seeds(seed: int) -> dict[str, int]:
    """Independent seeds for the *public* randomness (initialisation, augmentation), derived
    from the run's public seed; the noise and the sampling never come from it."""
    names = ("init", "augment")
    states = np.random.SeedSequence([seed, 4]).generate_state(len(names), dtype=np.uint64)
    return {name: int(value) % 2**63 for name, value in zip(names, states, strict=True)}


def run_settings(config: TrainConfig) -> dict[str, Any]:
    """What changes a run: the config without where the data are, what it reproduces, and
    the performance knobs; with a DP-RandP encoder, that file's digest. A checkpoint is
    resumed only by a run of the same settings."""
    data = config.to_dict()
    data.pop("data_dir", None)
    data.pop("reference", None)  # what the run reproduces, not how it runs
    for name in ("validation_fraction", "public_fraction"):
        if not data.get(name):  # as before the option existed: old checkpoints resume
            data.pop(name, None)
    options = config.dpsgd
    data["learner"] = options.run_settings()
    for key in ("encoder", "init"):
        path = getattr(options, key)
        if path is not None and Path(path).is_file():
            # A run resumes only from the very same weights, not another file at the path.
            data["learner"][f"{key}_sha256"] = encoder_digest(path)
    return data


def run_dpsgd(
    config: TrainConfig,
    *,
    quiet: bool = False,
    checkpoint: str | Path | None = None,
    secret: SecretRandomness,
    validation: ValidationRelease | None = None,
) -> tuple[dict[str, Any], TrainedModel]:
    """Trains one DP-SGD configuration; returns the result dict (DESIGN.md contract) and
    the trained model (the EMA parameters where the run keeps an EMA).

    Args:
      config: a validated config with ``method = "dp-sgd"`` or ``"dp-randp"``.
      quiet: no progress lines on stderr.
      checkpoint: a checkpoint file; resumed from when it exists, written every
        ``learner.checkpoint_every`` steps and at the end.
      secret: the run's secret randomness, the same on every rank (a resumed run's is its
        checkpoint's: :func:`dpvision.runs.train.fit` reads it).
      validation: tune's selection mode (:mod:`dpvision.runs.validation`).

    Privacy:
      Every logical step releases the noisy clipped gradient sum (sensitivity C, σ, rate q)
      and is recorded in the ledger; private preprocessing (``private-norm``) is recorded
      before, and the noisy validation counts (:mod:`dpvision.runs.validation`). The reported
      ε is the ledger's at ``config.delta``; with a target ε the σ is calibrated so that it
      never exceeds the target.
    """
    start = time.perf_counter()
    path = None if checkpoint is None else Path(checkpoint)
    run = _Run.start(config, quiet, path, secret, validation)
    loop_start = time.perf_counter()
    while run.state.sampler.step < run.steps:
        run.train_step()
        run.after_step()
    train_seconds = time.perf_counter() - loop_start
    result = run.result(wall_seconds=time.perf_counter() - start, train_seconds=train_seconds)
    return result, run.trained_model(result)


@dataclasses.dataclass
class _Run:
    """One DP-SGD run: its data, schedule, state and the step it repeats."""

    config: TrainConfig
    options: DPSGDOptions
    data: TrainingData
    steps: int
    sigma: float
    state: TrainingState
    step_fn: DPSGDStep
    plan: TransferPlan | None
    preprocessing: FittedPreprocessing | None
    workers: Workers
    quiet: bool
    checkpoint: Path | None
    settings: dict[str, Any]
    secret: SecretRandomness
    validation: ValidationRelease
    start_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    last_report: float = dataclasses.field(default_factory=time.perf_counter)
    started: float = dataclasses.field(default_factory=time.perf_counter)
    first_step: int = 0  # where this process started (after a resume)

    @classmethod
    def start(
        cls,
        config: TrainConfig,
        quiet: bool,
        checkpoint: Path | None,
        secret: SecretRandomness,
        validation: ValidationRelease | None,
    ) -> "_Run":
        """Loads the data, calibrates σ, builds the model and the state, and resumes from
        ``checkpoint`` when it exists (``secret`` is then the checkpoint's)."""
        workers = current()
        if config.dpsgd.clipping_mode != "flat" and config.method != "dp-sgd":
            raise DPVisionError(
                f"learner.clipping_mode = {config.dpsgd.clipping_mode!r} is for --method dp-sgd "
                "(DP-RandP's phases change which layers train)"
            )
        if config.dpsgd.secure_mode and (checkpoint is not None or workers.distributed):
            raise DPVisionError(
                "learner.secure_mode draws from the operating system's CSPRNG, which has no "
                "state to checkpoint, replay or share between processes: run it without "
                "--checkpoint and without torchrun"
            )
        quiet = quiet or not workers.is_main
        settings = run_settings(config)
        workers.check_agree(fingerprint(settings), "the configuration")
        options = config.dpsgd
        place = config.placement
        seeds = run_seeds(config.seed)
        data, preprocessing = load_inputs(config, options, secret, quiet)
        data = data.to(place.device)
        num_train = len(data.train_y)
        if options.batch_size > num_train:
            raise DPVisionError(
                f"learner.batch_size {options.batch_size} exceeds the {num_train} training examples"
            )
        sample_rate = options.batch_size / num_train
        steps = (
            options.steps if options.steps is not None else math.ceil(options.epochs / sample_rate)
        )
        released = ValidationRelease.plan(
            config,
            validation_count(config, options, steps, data.validation_y is not None),
            data.ledger,
            secret,
            validation,
        )
        sigma = noise_multiplier_for(config, sample_rate, steps, data.ledger)
        check_memory(options, data.train_x.shape[1:], place.device)
        plan = None
        if config.method == "dp-randp":
            plan = transfer_plan(config, options, data, sigma, sample_rate, steps, quiet)
            options = dataclasses.replace(options, groups=plan.info.groups)
        torch.manual_seed(seeds["init"])
        model, start = initial_model(
            config, options, data, plan, quiet, settings["learner"].get("init_sha256")
        )
        model = model.to(place.device)  # before the optimizer and the EMA take its tensors
        # Randomness inside training (dropout, drop-path) draws from torch's global
        # generator in batch order: from here on it is secret, never the public seed.
        torch.manual_seed(secret.seed("global"))
        if options.performance.compile:
            model.compile()  # in place: names, hooks and the saved state dict unchanged
        start.update(device=place.describe(), precision=place.precision)
        state = TrainingState(
            model=model,
            optimizer=phase_optimizer(options, model, plan, 0),
            ema=ParameterEMA(model, options.ema_decay) if options.ema_decay > 0 else None,
            sampler=PoissonSampler(
                num_examples=num_train,
                sample_rate=sample_rate,
                steps=steps,
                seed=secret.seed("sampler"),
                secure=options.secure_mode,
            ),
            # On the device and checkpointed; or the CSPRNG of the secure mode.
            noise=secret.noise("noise", place.device),
            augment=torch.Generator().manual_seed(seeds["augment"]),
            ledger=data.ledger,
            adaptive=adaptive_clipping(options, sample_rate * num_train),
            secret=secret,
        )
        step_fn = DPSGDStep(
            model=model,
            optimizer=state.optimizer,
            loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"),
            noise_multiplier=sigma,
            max_grad_norm=options.max_grad_norm,
            sample_rate=sample_rate,
            num_examples=num_train,
            ledger=state.ledger,
            generator=state.noise,
            views=options.augmult > 0,
            clipping=options.performance.clipping,
            normalize_update=options.normalize_update,
            workers=workers,
            ema=state.ema,
            precision=place.compute_dtype,
            groups=(
                per_layer(model, options.max_grad_norm)
                if options.clipping_mode == "per-layer"
                else None
            ),
            adaptive=state.adaptive,
        )
        run = cls(
            config=config,
            options=options,
            data=data,
            steps=steps,
            sigma=sigma,
            state=state,
            step_fn=step_fn,
            plan=plan,
            preprocessing=preprocessing,
            workers=workers,
            quiet=quiet,
            checkpoint=checkpoint,
            settings=settings,
            secret=secret,
            validation=released,
            start_info=start,
        )
        run.resume()
        say(
            f"dp-sgd {options.model} ({sum(p.numel() for p in model.parameters())} parameters) "
            f"on {num_train} examples: {steps} steps at q = {sample_rate:.4g}, σ = {sigma:.4g}, "
            f"C = {options.max_grad_norm:g}"
            + (f", augmult K = {options.augmult}" if options.augmult else ", no augmult")
            + (f", {workers.world_size} processes" if workers.distributed else "")
            + f", on {place.describe()}",
            quiet,
        )
        return run

    def resume(self) -> None:
        """Continues from the checkpoint when there is one (rank 0 reads it)."""
        path = self.checkpoint
        if path is None or not self.workers.from_main(path.exists):
            return
        enter = self.enter_phase if self.plan is not None else None
        resume(path, self.state, self.settings, self.workers, enter_step=enter)
        self.step_fn.ledger = self.state.ledger
        self.step_fn.optimizer = self.state.optimizer
        # The validation counts released before the checkpoint: the next draws fresh noise.
        keys = ("validation_accuracy", "validation_accuracy_ema")
        self.validation.made = sum(key in entry for entry in self.state.history for key in keys)
        say(f"resumed from {path} at step {self.state.sampler.step} of {self.steps}", self.quiet)
        self.first_step = self.state.sampler.step

    def enter_phase(self, step: int) -> torch.optim.Optimizer:
        """A fresh optimizer for the DP-RandP phase that ``step`` falls in."""
        optimizer = phase_optimizer(self.options, self.state.model, self.plan, step)
        self.state.optimizer = self.step_fn.optimizer = optimizer
        return optimizer

    def train_step(self) -> None:
        """One logical step: sample, cut into micro-batches, the noisy update."""
        state, options = self.state, self.options
        indices, step = state.sampler.sample(), state.sampler.step
        state.sampler.step += 1
        try:
            batches = micro_batches(self.data, indices, options, state.augment, self.workers, step)
            self.step_fn(batches)
        except RuntimeError as error:
            raise memory_error(error, options) from None

    def evaluate(self, split: str | None = None) -> dict[str, float]:
        """Accuracies on ``split``; by default the validation split when there is one (the
        test set is then evaluated once, at the end).

        Privacy: validation accuracies are released as noisy counts (one planned release
        each, :mod:`dpvision.runs.validation`); in tune's selection mode none is shown.
        """
        if split is None:
            split = "test" if self.data.validation_x is None else "validation"
        batch = self.options.performance.eval_batch_size
        exact = evaluate(self.state.model, self.state.ema, self.data, batch, self.workers, split)
        if split == "test":
            return exact
        n = len(self.data.validation_y) if self.data.validation_y is not None else 0
        released = {key: self.validation.accuracy(value, n) for key, value in exact.items()}
        return {k: v for k, v in released.items() if not math.isnan(v)}

    def after_step(self) -> None:
        """The phase switch, evaluation, progress and checkpoint due after a step."""
        done, history = self.state.sampler.step, self.state.history
        performance = self.options.performance
        if self.plan is not None and done == self.plan.phase2_steps:
            self.enter_phase(done)
            if done < self.steps:
                # With a validation split, no extra (unplanned) validation release here.
                metrics = self.evaluate() if self.data.validation_x is None else {}
                history.append({"step": done, "phase": 2, **metrics})
                say(
                    f"Phase II done at step {done}"
                    + (f": {format_metrics(history[-1])}" if metrics else "")
                    + "; Phase III trains all",
                    self.quiet,
                )
        if performance.eval_every and done % performance.eval_every == 0 and done < self.steps:
            history.append({"step": done, **self.evaluate()})
            say(f"step {done}/{self.steps}: {format_metrics(history[-1])}", self.quiet)
        elif time.perf_counter() - self.last_report > PROGRESS_SECONDS:
            # No training loss: it would be an unreleased statistic of the private batch.
            seconds = time.perf_counter() - self.started
            say(progress(done, self.steps, seconds, self.first_step), self.quiet)
            self.last_report = time.perf_counter()
        every = performance.checkpoint_every
        if self.checkpoint is not None and ((every and done % every == 0) or done == self.steps):
            self.workers.check_agree(state_digest(self.state.model), "the model parameters")
            if self.workers.is_main:
                save_checkpoint(self.checkpoint, self.state, self.settings)

    def trained_model(self, result: dict[str, Any]) -> TrainedModel:
        """The released model (EMA parameters when kept) and how inputs reach it."""
        model = self.state.model
        if self.state.ema is not None:
            model = self.state.ema.copy_to(copy.deepcopy(model))
        mean = std = None
        if self.plan is not None:
            mean, std = self.plan.info.mean, self.plan.info.std
        elif self.config.features == "pixels" and self.options.normalization == "dataset":
            mean, std = DATASET_STATISTICS[self.data.name]
        return TrainedModel(
            method=self.config.method,
            dataset=self.data.name,
            num_classes=self.data.num_classes,
            image_shape=self.data.image_shape,
            features=self.config.features,
            preprocessing=self.preprocessing,
            privacy=privacy_of(result),
            config=self.config.to_dict(),
            pixel_mean=None if mean is None else tuple(mean),
            pixel_std=None if std is None else tuple(std),
            input_shape=tuple(int(v) for v in self.data.train_x.shape[1:]),
            network=model.eval().cpu(),  # the saved model is read on any machine
            model_name=self.options.model,
            groups=self.options.groups,
            batchnorm=self.options.batchnorm_mode,
            class_names=self.data.class_names,
        )

    def _validation(self, final: dict[str, float]) -> dict[str, Any]:
        if self.data.validation_y is None or self.validation.mode == "selection":
            return {}
        ema = "validation_accuracy_ema" in final
        return {
            "validation_accuracy": final[
                "validation_accuracy_ema" if ema else "validation_accuracy"
            ],
            "n_validation": len(self.data.validation_y),
            **self.validation.summary(),
        }

    def result(self, *, wall_seconds: float, train_seconds: float) -> dict[str, Any]:
        """The result dict of DESIGN.md, after the final evaluation."""
        config, state, model = self.config, self.state, self.state.model
        self.workers.check_agree(state_digest(model), "the model parameters")
        final = self.evaluate("test")
        if self.data.validation_x is not None:
            final = {**self.evaluate("validation"), **final}
        state.history.append({"step": state.sampler.step, **final})
        ledger = state.ledger
        accountant = config.accountant or default_accountant(ledger.dp_event()).value
        epsilon = ledger.epsilon(config.delta, config.accountant) if ledger.is_private else math.inf
        ema = state.ema is not None
        return {
            "dataset": self.data.name,
            "method": config.method,
            "features": config.features,
            "model": self.options.model,
            "test_accuracy": final["test_accuracy_ema"] if ema else final["test_accuracy"],
            "test_accuracy_last": final["test_accuracy"],
            "test_accuracy_ema": final.get("test_accuracy_ema"),
            **self._validation(final),
            "epsilon": epsilon,
            "delta": config.delta,
            "accountant": accountant,
            "noise_multiplier": self.sigma if self.sigma > 0 else None,
            "steps": self.steps,
            "sample_rate": self.step_fn.release.sample_rate,
            # Adaptive clipping: the last clip norm, post-processing of the noisy counts.
            "final_clip_norm": None if self.state.adaptive is None else self.state.adaptive.clip,
            "n_train": len(self.data.train_y),
            "n_test": len(self.data.test_y),
            "num_features": int(np.prod(self.data.train_x.shape[1:])),
            "num_parameters": int(sum(p.numel() for p in model.parameters())),
            "num_trained_parameters": int(
                sum(p.numel() for p in model.parameters() if p.requires_grad)
            ),
            # Post-processing of the releases: whether the released model blew up.
            "diverged": not all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "seed": config.seed,
            "secret_randomness": self.secret.source,
            "wall_seconds": wall_seconds,
            "train_seconds": train_seconds,
            "world_size": self.workers.world_size,
            "epsilon_zcdp": None,
            "history": state.history,
            **({} if self.plan is None else self.plan.summary(epsilon)),
            **self.start_info,
            "privacy_ledger": ledger.to_dict()["entries"],
            "config": config.to_dict(),
        }


def adaptive_clipping(options: DPSGDOptions, expected_batch_size: float) -> AdaptiveClipping | None:
    """The adaptive clip norm of ``clipping_mode = "adaptive"`` (None otherwise)."""
    if options.clipping_mode != "adaptive":
        return None
    count_noise = options.unclipped_num_std
    return AdaptiveClipping(
        initial=options.max_grad_norm,
        count_noise=expected_batch_size / 20 if count_noise is None else count_noise,
        target_quantile=options.target_unclipped_quantile,
        learning_rate=options.clipbound_learning_rate,
        min_clip=options.min_clipbound,
        max_clip=options.max_clipbound,
    )


def initial_model(
    config: TrainConfig,
    options: DPSGDOptions,
    data: TrainingData,
    plan: TransferPlan | None,
    quiet: bool,
    init_sha256: str | None = None,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model a run starts from: built, weights loaded (``learner.init`` or the DP-RandP
    encoder), BatchNorm frozen or replaced, the parameters ``learner.finetune`` leaves out
    frozen; and what the result should say of it (``init_sha256``: the init file's digest,
    when the caller has it already).

    Privacy: the architecture, the weights and what is frozen come from the config and the
    weight file, never from the private data. Weights trained on any of this run's private
    rows were refused by :func:`load_inputs` (their cost is outside this run's ledger)
    unless ``learner.init_allow_same_dataset`` is set.
    """
    shape = tuple(int(v) for v in data.train_x.shape[1:])
    model = build_network(options.model, shape, data.num_classes, groups=options.groups)
    info: dict[str, Any] = {}
    if plan is not None:
        plan.head, _ = load_into(
            model, plan.encoder, model_name=options.model, input_shape=plan.info.input_shape
        )
    elif options.init is not None:
        report = load_weights(model, options.init)  # its record was checked by load_inputs
        say(report.message(), quiet)
        info["init"] = {
            "path": str(options.init),
            "sha256": init_sha256 or encoder_digest(options.init),
            "head_replaced": report.head_replaced,
            "trained_on": report.record.get("trained_on") or report.record.get("dataset"),
        }
    if is_external(options.model):
        model = prepare_for_dp(model, options.batchnorm_mode)
        info["batchnorm"] = options.batchnorm_mode
    else:
        validate_model(model)
    trained = apply_finetune(model, options.finetune)
    info["finetune"] = options.finetune
    if options.finetune != "all":
        say(f"fine-tuning {options.finetune}: {len(trained)} parameter tensors train", quiet)
    return model, info


def format_metrics(entry: dict[str, Any]) -> str:
    """A history entry as text: ``test accuracy 81.20 % (EMA 82.05 %)``, no step or phase."""
    parts = []
    for key, value in entry.items():
        if key in ("step", "phase") or key.endswith("_ema") or value is None:
            continue
        text = f"{key.replace('_', ' ')} {100 * value:.2f} %"
        if entry.get(f"{key}_ema") is not None:
            text += f" (EMA {100 * entry[f'{key}_ema']:.2f} %)"
        parts.append(text)
    return ", ".join(parts)


def noise_multiplier_for(
    config: TrainConfig, sample_rate: float, steps: int, prior: PrivacyLedger
) -> float:
    """σ of the DP-SGD steps: 0 with the noise off, the config's σ, or σ calibrated so that
    ``prior`` (private preprocessing) and ``steps`` Poisson-sampled steps at ``sample_rate``
    together meet the config's (ε, δ)."""
    if config.noise_off:
        return 0.0
    if config.noise_multiplier is not None:
        return config.noise_multiplier
    assert config.epsilon is not None
    return calibrate_noise_multiplier(
        target_epsilon=config.epsilon,
        target_delta=config.delta,
        sample_rate=sample_rate,
        steps=steps,
        accountant=config.accountant,
        preceding_event=prior.dp_event() if len(prior) else None,
    )


def validation_count(
    config: TrainConfig, options: DPSGDOptions, steps: int, has_validation: bool
) -> int:
    """How many validation counts a run releases: one per evaluation of the validation
    split (every ``eval_every`` steps before the end, and the final one), two each with an
    EMA (the raw and the averaged parameters). dp-randp's Phase II switch shows no
    validation accuracy (its step is known only once σ is)."""
    if not has_validation:
        return 0
    every = options.performance.eval_every
    evaluations = 1 + (len(range(every, steps, every)) if every else 0)
    return evaluations * (2 if options.ema_decay > 0 else 1)


def load_inputs(
    config: TrainConfig, options: DPSGDOptions, secret: SecretRandomness, quiet: bool
) -> tuple[TrainingData, FittedPreprocessing | None]:
    """Images (normalised) or ScatterNet feature maps, as float tensors (N, C, H, W), with
    the validation split of ``config.validation_fraction`` held out of the training rows
    (each example's side its own keyed hash under ``secret``'s split key)."""
    say(f"loading dataset {config.dataset}", quiet)
    dataset = config.load_dataset()
    ledger = PrivacyLedger()
    labels = np.asarray(dataset.train_labels)
    also_public = None
    if options.init is not None:  # copies of the weights' public rows are public too
        also_public = rows_trained_on(
            read_weights(options.init)[1],
            dataset.name,
            dataset.train_images,
            labels,
            config.public_fraction,
            what=f"learner.init {options.init}",
            allow=options.init_allow_same_dataset,
            override="learner.init_allow_same_dataset = true",
        )
    split = training_rows(
        dataset.train_images,
        labels,
        public_fraction=config.public_fraction,
        validation_fraction=config.validation_fraction,
        key=secret.split_key(),
        also_public=also_public,
    )
    rows, held = split.train, split.validation
    subset = len(rows) < len(labels)

    def data(train: Any, test: Any, validation: Any) -> TrainingData:
        return TrainingData(
            dataset.name,
            train,
            torch.as_tensor(labels[rows], dtype=torch.long),
            test,
            torch.as_tensor(np.asarray(dataset.test_labels), dtype=torch.long),
            dataset.num_classes,
            ledger,
            validation_x=validation if len(held) else None,
            validation_y=torch.as_tensor(labels[held], dtype=torch.long) if len(held) else None,
            image_shape=tuple(int(v) for v in dataset.train_images.shape[1:]),
            class_names=dataset.class_names,
            # Each row's own digest keys its augmentations (neighbour-stable views).
            train_keys=public_digests(dataset.train_images, labels)[rows]
            if options.augmult
            else None,
        )

    spec = parse_feature_spec(config.features)
    if config.features == "pixels":
        if config.preprocessing.kind != "none":
            raise DPVisionError(
                "dp-sgd on pixels takes no feature preprocessing; set preprocessing.kind = "
                "'none' (use learner.normalization for per-dataset pixel normalisation)"
            )
        # Converted a batch at a time: the images may be larger than memory (npy:DIR); a
        # validation split copies the training images it keeps into memory.
        images = dataset.train_images

        def lazy(pixels: np.ndarray) -> LazyInputs:
            return lazy_pixel_inputs(pixels, dataset.name, options.normalization)

        inputs = data(
            lazy(images[rows] if subset else images),
            lazy(dataset.test_images),
            lazy(images[held]) if len(held) else None,
        )
        return inputs, None
    if options.augmult:
        raise DPVisionError(
            "augmult needs pixel inputs: ScatterNet features are extracted once, so set "
            "learner.augmult = 0 with features other than pixels"
        )
    if spec.projection_dim is not None or spec.pool != 1:
        raise DPVisionError("dp-sgd takes unpooled, unprojected feature maps (e.g. scatternet)")
    shape = feature_shape(
        tuple(dataset.train_images.shape[1:]), dataclasses.replace(spec, flatten=False)
    )
    # Under torchrun rank 0 extracts and caches the features, then the others read them.
    train, test = current().main_first(lambda: load_or_extract(dataset, spec, progress=not quiet))
    if subset:  # the held-out rows (validation, then test) are only transformed
        train, test = np.asarray(train[rows]), np.concatenate([np.asarray(train[held]), test])
    train, test, fitted = preprocess(
        config.preprocessing,
        train,
        test,
        int(shape[0]),
        ledger,
        secret.noise("preprocessing"),
        noise_off=config.noise_off,
    )
    train_x = torch.from_numpy(np.array(train, dtype=np.float32)).view(-1, *shape)
    test_x = torch.from_numpy(np.array(test, dtype=np.float32)).view(-1, *shape)
    return data(train_x, test_x[len(held) :], test_x[: len(held)]), fitted


# --- DP-RandP: Phases II and III --------------------------------------------------------


# --- memory -------------------------------------------------------------------------------


# --- checkpoints --------------------------------------------------------------------------
