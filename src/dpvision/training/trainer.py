"""``dpvision train --method dp-sgd``: DP-SGD on deep image models, end to end.

One logical step (De et al. 2022, Alg. 1, with the choices of TAN/DP-RandP):

1. Poisson-sample the logical batch at q = B/N (:class:`dpvision.mechanisms.PoissonSampler`);
2. cut it into physical micro-batches of ``physical_batch_size`` examples; make K augmented
   views of each example (:func:`dpvision.data.augment.augment_views`) when ``augmult`` ≥ 1;
3. clip each example's gradient (the mean over its views) to C, sum, add N(0, (σC)²) once,
   divide by the public qN (:class:`dpvision.training.DPSGDStep`), step the optimizer;
4. update the parameter EMA once.

Checkpoints hold the model, the optimizer, the EMA, the sampler's RNG, the noise and
augmentation generators and the ledger, and are written atomically; a run killed at any
point and resumed from its checkpoint ends with the same parameters and the same ledger as
an uninterrupted run. A checkpoint written by a different configuration is refused.

Under ``torchrun`` (:mod:`dpvision.distributed`) every rank samples the same logical batch
and draws the same augmentations, clips its contiguous share, and the clipped sums are
all-reduced before the one noise draw; the run, its checkpoints and its ledger are those of
one process with the same seed (up to the order of float additions), so a run may also be
resumed with another number of processes. Rank 0 alone writes the checkpoint.
"""

import dataclasses
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)

from dpvision.accounting import PrivacyLedger
from dpvision.config import TrainConfig
from dpvision.distributed import Workers, current
from dpvision.errors import DPVisionError
from dpvision.fileio import load_torch
from dpvision.training.encoder import EncoderInfo
from dpvision.training.engine import DPSGDStep, ParameterEMA
from dpvision.training.options import DPSGDOptions, parse_model

CHECKPOINT_FORMAT = "dpvision-dpsgd-checkpoint-v1"

# Published per-dataset channel statistics, used as public constants (as in every paper of
# the field); ``normalization = "none"`` keeps pixels in [0, 1] instead.
DATASET_STATISTICS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),  # jax_privacy
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}

# Config fields that change neither the algorithm nor its privacy: a run may be resumed with
# other values of these (for example a smaller physical batch after running out of memory).
_RESUMABLE_CHANGES = frozenset(
    {
        "data_dir",
        "physical_batch_size",
        "clipping",
        "eval_every",
        "checkpoint_every",
        "eval_batch_size",
    }
)


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[dpvision] {message}", file=sys.stderr, flush=True)


def run_seeds(seed: int) -> dict[str, int]:
    """Independent seeds for each source of randomness, derived from the run's seed."""
    names = ("preprocessing", "init", "sampler", "noise", "augment")
    states = np.random.SeedSequence([seed, 4]).generate_state(len(names), dtype=np.uint64)
    return {name: int(value) % 2**63 for name, value in zip(names, states, strict=True)}


def run_dpsgd(
    config: TrainConfig, *, quiet: bool = False, checkpoint: str | Path | None = None
) -> dict[str, Any]:
    """Trains one DP-SGD configuration and returns the result dict (DESIGN.md contract).

    Args:
      config: a validated config with ``method = "dp-sgd"``.
      quiet: no progress lines on stderr.
      checkpoint: a checkpoint file; resumed from when it exists, written every
        ``learner.checkpoint_every`` steps and at the end.

    Privacy:
      Every logical step releases the noisy clipped gradient sum (sensitivity C, σ, rate q)
      and is recorded in the ledger; private preprocessing (``private-norm``) is recorded
      before. The reported ε is the ledger's at ``config.delta``; with a target ε the σ is
      calibrated so that it never exceeds the target.
    """
    from dpvision.accounting import default_accountant

    start = time.perf_counter()
    workers = current()
    quiet = quiet or not workers.is_main
    fingerprint = config_fingerprint(config)
    workers.check_agree(fingerprint, "the configuration")
    options = DPSGDOptions.from_dict(config.learner)
    seeds = run_seeds(config.seed)
    data = _load_data(config, options, seeds["preprocessing"], quiet)
    num_train = len(data.train_y)
    if options.batch_size > num_train:
        raise DPVisionError(
            f"learner.batch_size {options.batch_size} exceeds the {num_train} training examples"
        )
    sample_rate = options.batch_size / num_train
    steps = options.steps if options.steps is not None else math.ceil(options.epochs / sample_rate)
    ledger = data.ledger
    sigma = noise_multiplier_for(config, sample_rate, steps, ledger)
    _check_memory(options, data.train_x.shape[1:])

    plan: _TransferPlan | None = None
    if config.method == "dp-randp":
        plan = _transfer_plan(config, options, data, sigma, sample_rate, steps, quiet)
        options = dataclasses.replace(options, groups=plan.info.groups)
    torch.manual_seed(seeds["init"])
    model = build_model(options, tuple(data.train_x.shape[1:]), data.num_classes)
    if plan is not None:
        from dpvision.training.encoder import load_into

        plan.head, _ = load_into(
            model, plan.encoder, model_name=options.model, input_shape=plan.info.input_shape
        )
    optimizer = _phase_optimizer(options, model, plan, 0)
    sampler = _sampler(num_train, sample_rate, steps, seeds["sampler"])
    noise_generator = torch.Generator().manual_seed(seeds["noise"])
    augment_generator = torch.Generator().manual_seed(seeds["augment"])
    ema = ParameterEMA(model, options.ema_decay) if options.ema_decay > 0 else None
    step_fn = DPSGDStep(
        model=model,
        optimizer=optimizer,
        loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"),
        noise_multiplier=sigma,
        max_grad_norm=options.max_grad_norm,
        sample_rate=sample_rate,
        num_examples=num_train,
        ledger=ledger,
        generator=noise_generator,
        views=options.augmult > 0,
        clipping=options.clipping,
        normalize_update=options.normalize_update,
        workers=workers,
    )
    history: list[dict[str, Any]] = []
    state = {
        "model": model,
        "optimizer": optimizer,
        "ema": ema,
        "sampler": sampler,
        "noise": noise_generator,
        "augment": augment_generator,
        "step_fn": step_fn,
        "history": history,
    }

    def enter_phase(step: int) -> None:
        state["optimizer"] = step_fn.optimizer = _phase_optimizer(options, model, plan, step)

    if plan is not None:
        state["enter_phase"] = enter_phase
    if checkpoint is not None and workers.from_main(Path(checkpoint).exists):
        ledger = _resume(Path(checkpoint), config, fingerprint, state, workers)
        step_fn.ledger = ledger
        _say(f"resumed from {checkpoint} at step {sampler.step} of {steps}", quiet)
    _say(
        f"dp-sgd {options.model} ({sum(p.numel() for p in model.parameters())} parameters) on "
        f"{num_train} examples: {steps} steps at q = {sample_rate:.4g}, σ = {sigma:.4g}, "
        f"C = {options.max_grad_norm:g}, K = {options.augmult}"
        + (f", {workers.world_size} processes" if workers.distributed else ""),
        quiet,
    )
    last_report = loop_start = time.perf_counter()
    while sampler.step < steps:
        indices = sampler.sample()
        sampler.step += 1
        try:
            step_fn(_micro_batches(data, indices, options, augment_generator, workers))
        except RuntimeError as error:
            raise _memory_error(error, options) from None
        if ema is not None:
            ema.update(model)
        done = sampler.step
        if plan is not None and done == plan.phase2_steps:
            enter_phase(done)
            if done < steps:
                evaluation = _evaluate(model, ema, data, options, workers)
                history.append({"step": done, "phase": 2, **evaluation})
                _say(f"Phase II done at step {done}: {history[-1]}; Phase III trains all", quiet)
        if options.eval_every and done % options.eval_every == 0 and done < steps:
            history.append({"step": done, **_evaluate(model, ema, data, options, workers)})
            _say(f"step {done}/{steps}: {history[-1]}", quiet)
        elif time.perf_counter() - last_report > 30:
            _say(f"step {done}/{steps}", quiet)
            last_report = time.perf_counter()
        if checkpoint is not None and (
            (options.checkpoint_every and done % options.checkpoint_every == 0) or done == steps
        ):
            workers.check_agree(_state_digest(model), "the model parameters")
            if workers.is_main:
                save_checkpoint(Path(checkpoint), config, fingerprint, state, ledger)
    train_seconds = time.perf_counter() - loop_start
    workers.check_agree(_state_digest(model), "the model parameters")
    final = _evaluate(model, ema, data, options, workers)
    history.append({"step": sampler.step, **final})
    accountant = config.accountant or default_accountant(ledger.dp_event()).value
    epsilon = ledger.epsilon(config.delta, config.accountant) if ledger.is_private else math.inf
    transfer = {} if plan is None else plan.summary(epsilon)
    return {
        "dataset": data.name,
        "method": config.method,
        "features": config.features,
        "model": options.model,
        "test_accuracy": final["test_accuracy_ema"] if ema is not None else final["test_accuracy"],
        "test_accuracy_last": final["test_accuracy"],
        "test_accuracy_ema": final.get("test_accuracy_ema"),
        "epsilon": epsilon,
        "delta": config.delta,
        "accountant": accountant,
        "noise_multiplier": sigma if sigma > 0 else None,
        "steps": steps,
        "sample_rate": sample_rate,
        "n_train": num_train,
        "n_test": len(data.test_y),
        "num_features": int(np.prod(data.train_x.shape[1:])),
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
        # Post-processing of the releases: whether the released model blew up.
        "diverged": not all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "seed": config.seed,
        "wall_seconds": time.perf_counter() - start,
        "train_seconds": train_seconds,
        "world_size": workers.world_size,
        "epsilon_zcdp": None,
        "history": history,
        **transfer,
        "privacy_ledger": ledger.to_dict()["entries"],
        "config": config.to_dict(),
    }


def noise_multiplier_for(
    config: TrainConfig, sample_rate: float, steps: int, prior: PrivacyLedger
) -> float:
    """σ of the DP-SGD steps: 0 with the noise off, the config's σ, or σ calibrated so that
    ``prior`` (private preprocessing) and ``steps`` Poisson-sampled steps at ``sample_rate``
    together meet the config's (ε, δ)."""
    from dpvision.accounting import calibrate_noise_multiplier

    if (config.epsilon is not None and math.isinf(config.epsilon)) or (
        config.noise_multiplier == 0
    ):
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


class LazyInputs:
    """Model inputs (N, C, H, W) made from uint8 images (N, H, W, C) a batch at a time.

    The images may be memory-mapped (``npy:DIR`` datasets) and larger than memory: only the
    rows indexed are read and converted (to float in [0, 1], then each of ``transforms``).
    Indexing with a tensor of indices or a slice returns a float32 tensor.

    Privacy: a fixed per-example map with public constants; releases nothing.
    """

    def __init__(
        self,
        images: np.ndarray,
        transforms: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = (),
    ) -> None:
        self.images = images
        self.transforms = transforms

    @property
    def shape(self) -> torch.Size:
        count, height, width, channels = self.images.shape
        return torch.Size((count, channels, height, width))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: torch.Tensor | slice) -> torch.Tensor:
        from dpvision.data.core import images_to_tensor

        rows = index.numpy() if isinstance(index, torch.Tensor) else index
        inputs = images_to_tensor(np.ascontiguousarray(self.images[rows]))
        for transform in self.transforms:
            inputs = transform(inputs)
        return inputs

    def map(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> "LazyInputs":
        """The same inputs followed by ``transform`` (applied per batch)."""
        return LazyInputs(self.images, (*self.transforms, transform))


@dataclasses.dataclass
class _Data:
    name: str
    train_x: torch.Tensor | LazyInputs
    train_y: torch.Tensor
    test_x: torch.Tensor | LazyInputs
    test_y: torch.Tensor
    num_classes: int
    ledger: PrivacyLedger


def _load_data(config: TrainConfig, options: DPSGDOptions, seed: int, quiet: bool) -> _Data:
    """Images (normalised) or ScatterNet feature maps, as float tensors (N, C, H, W)."""
    from dpvision.data import load_dataset
    from dpvision.features import feature_shape, load_or_extract, parse_feature_spec
    from dpvision.pipeline import preprocess

    _say(f"loading dataset {config.dataset}", quiet)
    dataset = load_dataset(
        config.dataset,
        config.data_dir,
        num_classes=config.num_classes,
        channels=config.image_channels,
    )
    ledger = PrivacyLedger()
    train_y = torch.as_tensor(np.asarray(dataset.train_labels), dtype=torch.long)
    test_y = torch.as_tensor(np.asarray(dataset.test_labels), dtype=torch.long)
    spec = parse_feature_spec(config.features)
    if config.features == "pixels":
        if config.preprocessing.kind != "none":
            raise DPVisionError(
                "dp-sgd on pixels takes no feature preprocessing; set preprocessing.kind = "
                "'none' (use learner.normalization for per-dataset pixel normalisation)"
            )
        # Converted a batch at a time: the images may be larger than memory (npy:DIR).
        train_x = lazy_pixel_inputs(dataset.train_images, dataset.name, options.normalization)
        test_x = lazy_pixel_inputs(dataset.test_images, dataset.name, options.normalization)
        return _Data(dataset.name, train_x, train_y, test_x, test_y, dataset.num_classes, ledger)
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
    train, test = preprocess(config, train, test, int(shape[0]), ledger, seed)
    train_x = torch.from_numpy(np.array(train, dtype=np.float32)).view(-1, *shape)
    test_x = torch.from_numpy(np.array(test, dtype=np.float32)).view(-1, *shape)
    return _Data(dataset.name, train_x, train_y, test_x, test_y, dataset.num_classes, ledger)


def lazy_pixel_inputs(images: np.ndarray, dataset: str, normalization: str) -> LazyInputs:
    """:func:`pixel_inputs`, made a batch at a time when indexed."""
    if normalization != "dataset":
        return LazyInputs(images)
    standardize = _standardizer(dataset)
    return LazyInputs(images, (standardize,))


def _standardizer(dataset: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if dataset not in DATASET_STATISTICS:
        raise DPVisionError(
            f"no published statistics for {dataset}; set learner.normalization = 'none' "
            f"(known: {', '.join(DATASET_STATISTICS)})"
        )
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in DATASET_STATISTICS[dataset])
    return lambda inputs: (inputs - mean) / std


def pixel_inputs(images: np.ndarray, dataset: str, normalization: str) -> torch.Tensor:
    """uint8 images (N, H, W, C) → float (N, C, H, W) in [0, 1], then standardised with the
    published per-dataset statistics when ``normalization = "dataset"``.

    Privacy: a fixed per-example map with public constants; releases nothing.
    """
    from dpvision.data.core import images_to_tensor

    inputs = images_to_tensor(images)
    if normalization != "dataset":
        return inputs
    return _standardizer(dataset)(inputs)


def build_model(
    options: DPSGDOptions, input_shape: tuple[int, ...], num_classes: int
) -> torch.nn.Module:
    """The model named by ``options.model`` for inputs of ``input_shape``, validated."""
    from dpvision.models import mlp, scatter_cnn, tanh_cnn, validate_model, wide_resnet

    kind, sizes = parse_model(options.model)
    if kind == "tanh-cnn":
        model: torch.nn.Module = tanh_cnn(input_shape, num_classes=num_classes)
    elif kind == "mlp":
        model = mlp(input_shape, num_classes=num_classes, hidden=sizes["hidden"])
    elif kind == "scatter-cnn":
        model = scatter_cnn(input_shape, num_classes=num_classes, groups=options.groups)
    else:
        groups = options.groups if 16 % max(options.groups, 1) == 0 else 16
        model = wide_resnet(
            sizes["depth"],
            sizes["width"],
            num_classes=num_classes,
            groups=groups,
            in_channels=input_shape[0],
        )
    validate_model(model)
    return model


def make_optimizer(options: DPSGDOptions, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer named by ``options`` over ``model``'s trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if options.optimizer == "adam":
        return torch.optim.Adam(params, lr=options.learning_rate, weight_decay=options.weight_decay)
    return torch.optim.SGD(
        params,
        lr=options.learning_rate,
        momentum=options.momentum,
        nesterov=options.nesterov,
        weight_decay=options.weight_decay,
    )


# --- DP-RandP: Phases II and III --------------------------------------------------------

DEFAULT_PHASE2_STEPS = 96  # Tang et al.: 8 epochs of 12 steps on CIFAR-10 (App. E)


@dataclasses.dataclass
class _TransferPlan:
    """Where a dp-randp run starts from and where Phase II ends."""

    encoder: Path
    info: EncoderInfo
    phase2_steps: int
    steps: int
    phase2_epsilon: float | None
    pretrain: dict[str, Any] | None
    head: list[str] = dataclasses.field(default_factory=list)

    def summary(self, epsilon: float) -> dict[str, Any]:
        fraction = None
        if self.phase2_epsilon is not None and math.isfinite(epsilon) and epsilon > 0:
            fraction = self.phase2_epsilon / epsilon
        return {
            "encoder": str(self.encoder),
            "encoder_trained_on": self.info.metadata.get("trained_on"),
            "phase2_steps": self.phase2_steps,
            "phase3_steps": self.steps - self.phase2_steps,
            "phase2_epsilon": self.phase2_epsilon,
            "phase2_epsilon_fraction": fraction,
            "phase2_parameters": list(self.head),
            "pretrain": self.pretrain,
        }


def _phase_optimizer(
    options: DPSGDOptions, model: torch.nn.Module, plan: _TransferPlan | None, step: int
) -> torch.optim.Optimizer:
    """A fresh optimizer for the phase that ``step`` falls in.

    Phase II (steps before N₁) trains the head only: the other parameters are frozen, so
    the clipped sums, the noise and the updates cover the head's parameters alone. Phase III
    trains every parameter, with a new optimizer, as in TAN/DP-RandP's second
    ``make_private``.
    """
    phase2 = plan is not None and step < plan.phase2_steps
    for name, param in model.named_parameters():
        param.requires_grad_(not phase2 or (plan is not None and name in plan.head))
    rate = options.learning_rate
    if phase2 and options.phase2_learning_rate is not None:
        rate = options.phase2_learning_rate
    return make_optimizer(dataclasses.replace(options, learning_rate=rate), model)


def _transfer_plan(
    config: TrainConfig,
    options: DPSGDOptions,
    data: "_Data",
    sigma: float,
    sample_rate: float,
    steps: int,
    quiet: bool,
) -> _TransferPlan:
    """Finds (or makes, with Phase I) the encoder, normalises the images with its public
    statistics, and splits the steps into Phase II and Phase III."""
    from dpvision.training.encoder import read_encoder

    if config.features != "pixels":
        raise DPVisionError(
            "dp-randp trains the whole network on pixels (features = 'pixels'); to probe an "
            "encoder's features with a feature learner use --features encoder:path=FILE"
        )
    shape = tuple(int(v) for v in data.train_x.shape[1:])
    pretrain_summary = None
    if options.encoder is not None:
        encoder = Path(options.encoder)
    else:
        encoder, pretrain_summary = _phase_one(config, options, shape, quiet)
    info, _ = read_encoder(encoder)
    if tuple(info.input_shape) != shape:
        raise DPVisionError(
            f"encoder {encoder} takes images of shape {tuple(info.input_shape)}, "
            f"{data.name}'s are {shape}: pre-train with --size {shape[-1]} --channels {shape[0]}"
        )
    assert isinstance(data.train_x, LazyInputs)
    assert isinstance(data.test_x, LazyInputs)
    data.train_x = data.train_x.map(info.normalize)
    data.test_x = data.test_x.map(info.normalize)
    phase2 = phase2_steps_for(config, options, sigma, sample_rate, steps, data.ledger)
    phase2_epsilon = None
    if sigma > 0:
        ledger = PrivacyLedger(data.ledger.entries)
        if phase2:
            ledger.record(
                noise_multiplier=sigma,
                sample_rate=sample_rate,
                count=phase2,
                released="DP-SGD clipped gradient sum",
            )
        phase2_epsilon = ledger.epsilon(config.delta, config.accountant) if len(ledger) else 0.0
    return _TransferPlan(encoder, info, phase2, steps, phase2_epsilon, pretrain_summary)


def phase2_steps_for(
    config: TrainConfig,
    options: DPSGDOptions,
    sigma: float,
    sample_rate: float,
    steps: int,
    prior: PrivacyLedger,
) -> int:
    """N₁: ``learner.phase2_steps``, else the most steps whose ε is at most
    ``phase2_fraction`` of the whole run's, else 96 (at most ``steps``).

    The split is a choice of the public schedule, made from σ, q and the step counts only:
    it looks at no data. Both phases add the same noise at the same rate, so the whole run
    is one composition of ``steps`` Poisson-sampled Gaussian steps whatever N₁ is.
    """
    if options.phase2_steps is not None:
        if options.phase2_steps > steps:
            raise DPVisionError(
                f"learner.phase2_steps = {options.phase2_steps} exceeds the run's {steps} steps"
            )
        return options.phase2_steps
    if options.phase2_fraction is None:
        return min(DEFAULT_PHASE2_STEPS, steps)
    if options.phase2_fraction >= 1:
        return steps
    if sigma == 0:
        raise DPVisionError(
            "learner.phase2_fraction needs a private run (with the noise off, give "
            "learner.phase2_steps)"
        )

    from dpvision.accounting import calibrate_steps

    def epsilon(count: int) -> float:
        ledger = PrivacyLedger(prior.entries)
        ledger.record(
            noise_multiplier=sigma,
            sample_rate=sample_rate,
            count=count,
            released="DP-SGD clipped gradient sum",
        )
        return ledger.epsilon(config.delta, config.accountant)

    budget = options.phase2_fraction * epsilon(steps)
    if options.phase2_fraction == 0 or epsilon(1) > budget:
        return 0
    return calibrate_steps(
        target_epsilon=budget,
        target_delta=config.delta,
        noise_multiplier=sigma,
        sample_rate=sample_rate,
        accountant=config.accountant,
        preceding_event=prior.dp_event() if len(prior) else None,
        max_steps=steps,
    )


def _phase_one(
    config: TrainConfig, options: DPSGDOptions, shape: tuple[int, ...], quiet: bool
) -> tuple[Path, dict[str, Any]]:
    """Runs Phase I with the ``[pretrain]`` options, or reuses the encoder it made before
    (cached in the ``encoders`` folder of the feature cache, keyed by the options)."""
    from dpvision.features.cache import default_cache_dir
    from dpvision.training.pretrain import PretrainOptions, pretrain

    if len(shape) != 3 or shape[1] != shape[2]:
        raise DPVisionError(f"Phase I makes square images; the dataset's are {shape}")
    kind, _ = parse_model(options.model)
    groups = options.groups if kind != "wrn" or 16 % max(options.groups, 1) == 0 else 16
    pretrain_options = PretrainOptions.from_dict(
        {
            **config.pretrain,
            "model": options.model,
            "groups": groups,
            "size": shape[1],
            "channels": shape[0],
        }
    )
    folder = default_cache_dir() / "encoders"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{options.model}-{pretrain_options.fingerprint()}.pt"
    workers = current()
    if workers.sum(int(path.exists())) == workers.world_size:
        _say(f"Phase I: reusing the encoder {path}", quiet)
        return path, {"cached": True, "options": dataclasses.asdict(pretrain_options)}
    if workers.distributed:
        raise DPVisionError(
            "Phase I (pre-training on synthetic images) runs in one process: run `dpvision "
            "pretrain` first (or this run without torchrun once), then set learner.encoder "
            f"to the encoder file, on every machine (this run's would be {path})"
        )
    summary = pretrain(pretrain_options, path, checkpoint=path.with_suffix(".ckpt"), quiet=quiet)
    path.with_suffix(".ckpt").unlink(missing_ok=True)
    return path, {"cached": False, **summary}


def _sampler(num_train: int, sample_rate: float, steps: int, seed: int) -> Any:
    from dpvision.mechanisms import PoissonSampler

    return PoissonSampler(num_examples=num_train, sample_rate=sample_rate, steps=steps, seed=seed)


def _micro_batches(
    data: _Data,
    indices: np.ndarray,
    options: DPSGDOptions,
    generator: torch.Generator,
    workers: Workers | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the logical batch ``indices`` in physical chunks, with K views
    each when augmult ≥ 1.

    The views' random choices are drawn for the whole logical batch first (on every rank
    alike), so an example gets the same views whatever the physical batch size and the
    number of processes.
    """
    from dpvision.data.augment import apply_views, draw_views

    workers = workers or Workers()
    draws = None
    if options.augmult:
        draws = draw_views(
            len(indices),
            options.augmult,
            generator,
            padding=options.crop_padding,
            flip=options.flip,
        )
    start, stop = workers.row_range(len(indices))
    for first in range(start, stop, options.physical_batch_size):
        last = min(first + options.physical_batch_size, stop)
        chunk = torch.as_tensor(indices[first:last], dtype=torch.long)
        inputs = data.train_x[chunk]
        if draws is not None:
            inputs = apply_views(
                inputs,
                draws[first:last],
                padding=options.crop_padding,
                mode=options.padding_mode,
            )
        yield inputs, data.train_y[chunk]


@torch.no_grad()
def _accuracy(
    model: torch.nn.Module,
    params: dict[str, torch.Tensor] | None,
    x: torch.Tensor | LazyInputs,
    y: torch.Tensor,
    batch: int,
    workers: Workers,
) -> float:
    """Accuracy on (x, y); each rank scores its share of the rows and the counts are summed."""
    from torch.func import functional_call

    start, stop = workers.row_range(len(y))
    correct = 0
    for first in range(start, stop, batch):
        xb, yb = x[first : min(first + batch, stop)], y[first : min(first + batch, stop)]
        out = model(xb) if params is None else functional_call(model, params, (xb,))
        correct += int((out.argmax(1) == yb).sum())
    return workers.sum(correct) / max(workers.sum(stop - start), 1)


def _evaluate(
    model: torch.nn.Module,
    ema: ParameterEMA | None,
    data: _Data,
    options: DPSGDOptions,
    workers: Workers | None = None,
) -> dict[str, float]:
    """Test accuracy of the raw parameters and, with an EMA, of the averaged ones.

    Privacy: the test set is not private training data; nothing here touches the
    training examples.
    """
    workers = workers or Workers()
    batch = options.eval_batch_size
    out = {"test_accuracy": _accuracy(model, None, data.test_x, data.test_y, batch, workers)}
    if ema is not None:
        out["test_accuracy_ema"] = _accuracy(
            model, ema.shadow, data.test_x, data.test_y, batch, workers
        )
    return out


def _state_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters and buffers, to check that all ranks hold the same model."""
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# --- memory -------------------------------------------------------------------------------


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_memory(options: DPSGDOptions, input_shape: torch.Size) -> None:
    """Refuses a physical batch whose input views alone would not fit in memory."""
    available = _available_memory()
    views = max(options.augmult, 1)
    needed = options.physical_batch_size * views * int(np.prod(input_shape)) * 4
    if available is not None and needed > available:
        raise DPVisionError(
            _memory_advice(options, f"its inputs alone need {needed / 2**30:.1f} GiB")
        )


def _memory_advice(options: DPSGDOptions, what: str) -> str:
    smaller = max(options.physical_batch_size // 4, 1)
    return (
        f"learner.physical_batch_size = {options.physical_batch_size} (× {max(options.augmult, 1)} "
        f"views) does not fit in memory ({what}); lower it, e.g. --set "
        f"learner.physical_batch_size={smaller} (it changes speed, not the privacy or the result)"
    )


def _memory_error(error: RuntimeError, options: DPSGDOptions) -> BaseException:
    text = str(error)
    if (
        isinstance(error, torch.OutOfMemoryError)
        or "out of memory" in text
        or "can't allocate" in text
    ):
        return DPVisionError(_memory_advice(options, "the allocator ran out"))
    return error


# --- checkpoints --------------------------------------------------------------------------


def config_fingerprint(config: TrainConfig) -> str:
    """A hash of everything in the config that changes the run (not memory or logging knobs)."""
    return hashlib.sha256(json.dumps(_significant(config), sort_keys=True).encode()).hexdigest()[
        :16
    ]


def _significant(config: TrainConfig) -> dict[str, Any]:
    data = config.to_dict()
    data.pop("data_dir", None)
    data.pop("reference", None)  # what the run reproduces, not how it runs
    options = dataclasses.asdict(DPSGDOptions.from_dict(config.learner))
    data["learner"] = {k: v for k, v in options.items() if k not in _RESUMABLE_CHANGES}
    if options["encoder"] is not None and Path(options["encoder"]).is_file():
        from dpvision.features.backbone import encoder_digest

        # A run resumes only from the very same encoder, not another file at the same path.
        data["learner"]["encoder_sha256"] = encoder_digest(options["encoder"])
    return data


def save_checkpoint(
    path: Path, config: TrainConfig, fingerprint: str, state: dict[str, Any], ledger: PrivacyLedger
) -> None:
    """Writes the whole training state to ``path`` atomically (temporary file, fsync, rename).

    Privacy: a checkpoint holds model parameters and optimizer moments, which are
    post-processing of the noisy releases recorded in its ledger, plus RNG states.
    """
    ema = state["ema"]
    payload = {
        "format": CHECKPOINT_FORMAT,
        "fingerprint": fingerprint,
        "config": _significant(config),
        "model": state["model"].state_dict(),
        "optimizer": state["optimizer"].state_dict(),
        "ema": None if ema is None else ema.state_dict(),
        "sampler": state["sampler"].state_dict(),
        "noise": state["noise"].get_state(),
        "augment": state["augment"].get_state(),
        "history": list(state["history"]),
        "ledger": ledger.to_json(),
    }
    from dpvision.pipeline import atomic_open

    with atomic_open(path, "wb") as out:
        torch.save(payload, out)


def _read_checkpoint(path: Path) -> dict[str, Any]:
    try:
        payload = load_torch(path)
    except Exception as error:
        raise DPVisionError(
            f"cannot read checkpoint {path} ({type(error).__name__}); it was left untouched: "
            "move it away to start afresh"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise DPVisionError(f"{path} is not a dpvision DP-SGD checkpoint; it was left untouched")
    return payload


def _resume(
    path: Path,
    config: TrainConfig,
    fingerprint: str,
    state: dict[str, Any],
    workers: Workers | None = None,
) -> PrivacyLedger:
    """Restores ``state`` from the checkpoint at ``path``; refuses one of another config.

    Rank 0 reads the file and sends its contents to the other ranks, so only rank 0 needs
    to see it.
    """
    payload = (workers or Workers()).from_main(lambda: _read_checkpoint(path))
    if payload["fingerprint"] != fingerprint:
        ours, theirs = _flatten(_significant(config)), _flatten(payload["config"])
        differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        raise DPVisionError(
            f"checkpoint {path} was written by a different configuration (differs in: "
            f"{', '.join(differ) or 'unknown'}); resume with the same config, or give another "
            "--checkpoint path (the existing file is left untouched)"
        )
    state["model"].load_state_dict(payload["model"])
    state["sampler"].load_state_dict(payload["sampler"])
    if "enter_phase" in state:  # dp-randp: the optimizer of the phase the run stopped in
        state["enter_phase"](state["sampler"].step)
    state["optimizer"].load_state_dict(payload["optimizer"])
    if state["ema"] is not None:
        state["ema"].load_state_dict(payload["ema"])
    state["noise"].set_state(payload["noise"])
    state["augment"].set_state(payload["augment"])
    state["history"][:] = payload["history"]
    return PrivacyLedger.from_json(payload["ledger"])


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
