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

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)

from dpvision.accounting import PrivacyLedger, default_accountant
from dpvision.averaging import ParameterEMA
from dpvision.config import TrainConfig
from dpvision.data.inputs import TrainingData
from dpvision.devices import Placement
from dpvision.distributed import Workers, current
from dpvision.errors import DPVisionError
from dpvision.features.preprocessing import FittedPreprocessing
from dpvision.log import progress, say
from dpvision.mechanisms import PoissonSampler
from dpvision.mechanisms.clip_policy import ClipPolicy, adaptive_options, make_clip_policy
from dpvision.mechanisms.gradient_release import GradientRelease, ReleaseContext
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.runs.inputs import load_inputs
from dpvision.runs.network import check_network, prepare_model, released_model
from dpvision.runs.saved import TrainedModel
from dpvision.runs.schedule import Schedule, prepare_schedule, run_seeds, run_settings
from dpvision.runs.schedule import noise_multiplier_for as noise_multiplier_for  # for audit
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
from dpvision.training.engine import DPSGDStep
from dpvision.training.evaluation import evaluate
from dpvision.training.memory import check_memory, memory_error
from dpvision.training.options import DPSGDOptions
from dpvision.training.transfer import TransferPlan, phase_optimizer

PROGRESS_SECONDS = 30  # a progress line at least this often


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
        ``checkpoint`` when it exists (``secret`` is then the checkpoint's).

        Privacy: the validation counts are recorded in the ledger before σ is calibrated,
        so that σ meets the target with them and any private preprocessing.
        """
        workers = current()
        _check_learner_modes(config, checkpoint, workers)
        quiet = quiet or not workers.is_main
        settings = run_settings(config)
        workers.check_agree(fingerprint(settings), "the configuration")
        options, place = config.dpsgd, config.placement
        data, preprocessing = load_inputs(config, options, secret, quiet)
        check_network(options, data)  # one forward of zeros: a shape mismatch in one line
        data = data.to(place.device)
        schedule, released = prepare_schedule(config, data, secret, validation)
        check_memory(options, data.train_x.shape[1:], place.device)
        plan = None
        if config.method == "dp-randp":
            q, steps = schedule.sample_rate, schedule.steps
            plan = transfer_plan(config, options, data, schedule.sigma, q, steps, quiet)
            options = dataclasses.replace(options, groups=plan.info.groups)
        seeds = run_seeds(config.seed)
        model, start = prepare_model(
            config,
            options,
            data,
            plan,
            quiet=quiet,
            secret=secret,
            seed=seeds["init"],
            init_sha256=settings["learner"].get("init_sha256"),
        )
        state = _prepare_state(
            options,
            model,
            plan,
            schedule,
            secret=secret,
            seed=seeds["augment"],
            ledger=data.ledger,
            device=place.device,
        )
        step_fn = _prepare_step(options, state, schedule, workers, place)
        run = cls(
            config=config,
            options=options,
            data=data,
            steps=schedule.steps,
            sigma=schedule.sigma,
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
        run.announce(schedule)
        return run

    def announce(self, schedule: "Schedule") -> None:
        """The run's first line: the model, the schedule, σ, C and where it runs."""
        options, model, workers = self.options, self.state.model, self.workers
        say(
            f"dp-sgd {options.model} ({sum(p.numel() for p in model.parameters())} parameters) "
            f"on {len(self.data.train_y)} examples: {self.steps} steps at q = "
            f"{schedule.sample_rate:.4g}, σ = {self.sigma:.4g}, C = {options.max_grad_norm:g}"
            + (f", augmult K = {options.augmult}" if options.augmult else ", no augmult")
            + (f", {workers.world_size} processes" if workers.distributed else "")
            + f", on {self.config.placement.describe()}",
            self.quiet,
        )

    def resume(self) -> None:
        """Continues from the checkpoint when there is one (rank 0 reads it)."""
        path = self.checkpoint
        if path is None or not self.workers.from_main(path.exists):
            return
        enter = self.enter_phase if self.plan is not None else None
        resume(path, self.state, self.settings, self.workers, enter_step=enter)
        self.step_fn.context.ledger = self.state.ledger
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
        return released_model(
            self.config,
            self.options,
            self.data,
            self.state,
            plan=self.plan,
            preprocessing=self.preprocessing,
            result=result,
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
            "final_clip_norm": self.state.policy.adapted_clip,
            "n_train": len(self.data.train_y),
            "n_test": len(self.data.test_y),
            "num_features": int(np.prod(self.data.train_x.shape[1:])),
            # Public: the model's input, (C, H, W) of the images (or of the feature maps).
            "input_shape": [int(v) for v in self.data.train_x.shape[1:]],
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


def _check_learner_modes(config: TrainConfig, checkpoint: Path | None, workers: Workers) -> None:
    """Refuses learner modes this run cannot honour, before any data is read."""
    if config.dpsgd.clipping != "flat" and config.method != "dp-sgd":
        raise DPVisionError(
            f"learner.clipping = {config.dpsgd.clipping!r} is for --method dp-sgd "
            "(DP-RandP's phases change which layers train)"
        )
    if config.dpsgd.secure_mode and (checkpoint is not None or workers.distributed):
        raise DPVisionError(
            "learner.secure_mode draws from the operating system's CSPRNG, which has no "
            "state to checkpoint, replay or share between processes: run it without "
            "--checkpoint and without torchrun"
        )


def _prepare_state(
    options: DPSGDOptions,
    model: torch.nn.Module,
    plan: TransferPlan | None,
    schedule: Schedule,
    *,
    secret: SecretRandomness,
    seed: int,
    ledger: PrivacyLedger,
    device: torch.device,
) -> TrainingState:
    """The state a run starts from: the optimizer, the EMA, the Poisson sampler, the noise
    and augmentation generators, the ledger (the releases so far) and the clip policy.

    Privacy: the sampler and the noise draw from ``secret``; only the augmentations draw
    from the public ``seed``.
    """
    num_train, sample_rate = schedule.num_examples, schedule.sample_rate
    return TrainingState(
        model=model,
        optimizer=phase_optimizer(options, model, plan, 0),
        ema=ParameterEMA(model, options.ema_decay) if options.ema_decay > 0 else None,
        sampler=PoissonSampler(
            num_examples=num_train,
            sample_rate=sample_rate,
            steps=schedule.steps,
            seed=secret.coin_seed("sampler"),
            secure=options.secure_mode,
        ),
        # On the device and checkpointed; or the CSPRNG of the secure mode.
        noise=secret.noise("noise", device),
        augment=torch.Generator().manual_seed(seed),
        ledger=ledger,
        policy=clip_policy(options, model, sample_rate * num_train),
        secret=secret,
    )


def _prepare_step(
    options: DPSGDOptions,
    state: TrainingState,
    schedule: Schedule,
    workers: Workers,
    place: Placement,
) -> DPSGDStep:
    """The one noisy DP-SGD update the run repeats, over ``state``'s model and optimizer.

    Privacy: each call releases the clipped gradient sum plus N(0, (σC)²), recorded in
    ``state.ledger`` by the clip policy
    (:func:`dpvision.mechanisms.gradient_release.noisy_step`).
    """
    release = GradientRelease(
        noise_multiplier=schedule.sigma,
        sample_rate=schedule.sample_rate,
        expected_batch_size=schedule.sample_rate * schedule.num_examples,
        normalize_update=options.normalize_update,
    )
    return DPSGDStep(
        state.model,
        state.optimizer,
        lambda out, y: F.cross_entropy(out, y, reduction="none"),
        release=release,
        policy=state.policy,
        context=ReleaseContext(state.ledger, state.noise, workers, state.ema),
        views=options.augmult > 0,
        method=options.performance.grad_sample_mode,
        precision=place.compute_dtype,
    )


def clip_policy(
    options: DPSGDOptions, model: torch.nn.Module, expected_batch_size: float
) -> ClipPolicy:
    """The clip policy ``learner.clipping`` names, over ``model``'s trainable layers."""
    return make_clip_policy(
        options.clipping,
        options.max_grad_norm,
        expected_batch_size=expected_batch_size,
        model=model,
        **adaptive_options(options),
    )


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
