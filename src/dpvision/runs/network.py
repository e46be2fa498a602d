"""The network of a DP-SGD run: the one it starts from (:func:`prepare_model`,
:func:`initial_model`), built from the registry with the public seed, its weights loaded
(``learner.init`` or DP-RandP's encoder), BatchNorm frozen or replaced, the parameters that
``learner.finetune`` leaves out frozen; and the one it releases (:func:`released_model`).

Privacy: the initial network comes from the config and the weight files, never from the
private data; the released one is post-processing of the run's noisy steps.
"""

import copy
from typing import Any

import torch

from dpvision.config import TrainConfig
from dpvision.data.datasets import same_dataset
from dpvision.data.inputs import Statistics, TrainingData, dataset_statistics
from dpvision.features.backbone import encoder_digest
from dpvision.features.preprocessing import FittedPreprocessing
from dpvision.log import say
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.models.encoder import load_into
from dpvision.models.finetune import apply_finetune
from dpvision.models.registry import build_network, check_forward, prepare_for_dp
from dpvision.models.sources import timm_models
from dpvision.models.validation import validate_model
from dpvision.models.weights import load_weights, weights_record
from dpvision.runs.saved import TrainedModel, privacy_of
from dpvision.training.checkpoint import TrainingState
from dpvision.training.options import DPSGDOptions
from dpvision.training.transfer import TransferPlan


def prepare_model(
    config: TrainConfig,
    options: DPSGDOptions,
    data: TrainingData,
    plan: TransferPlan | None,
    *,
    quiet: bool,
    secret: SecretRandomness,
    seed: int,
    init_sha256: str | None,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The initial model (drawn with the public ``seed``) on the run's device, compiled when
    asked; and what the result says of it (``init_sha256``: ``learner.init``'s digest).

    Privacy: the model comes from the config and the weight files only
    (:func:`initial_model`). From here on torch's global generator
    (dropout, drop-path) is the run's secret one, never the public seed.
    """
    place = config.placement
    torch.manual_seed(seed)
    model, start = initial_model(config, options, data, plan, quiet, init_sha256)
    model = model.to(place.device)  # before the optimizer and the EMA take its tensors
    # Randomness inside training (dropout, drop-path) draws from torch's global
    # generator in batch order: from here on it is secret, never the public seed.
    torch.manual_seed(secret.seed("global"))
    if options.performance.compile:
        model.compile()  # in place: names, hooks and the saved state dict unchanged
    start.update(device=place.describe(), precision=place.precision)
    return model, start


def check_network(options: DPSGDOptions, data: TrainingData) -> None:
    """Builds the run's network and passes one batch of zeros of the inputs' shape through
    it (:func:`dpvision.models.registry.check_forward`), so that a model that cannot take
    these images (a timm ViT built for 224×224 given 32×32 images) is refused in one line
    naming both fixes (``image_size``, ``learner.model_args``) before calibration, Phase I
    or any training step, not by a traceback from inside the first one.

    Only external models (timm, torchvision, ``python:``) are checked: dpvision's own check
    their input shape as they are built, and the check would cost a WRN-16-4 run 1.6 s
    (build and forward on the shared 2-core CPU; 0.04 s for the Tanh CNN). A timm
    ViT-Tiny takes 2.7 s there, once per run.

    Privacy: the shape of the inputs is public (the dataset's image shape, or the shape of
    its public feature map); the batch is zeros.
    """
    if not options.spec.external:
        return
    shape = tuple(int(v) for v in data.train_x.shape[1:])
    with torch.random.fork_rng(devices=[]):  # the run's own draws stay as they were
        model = build_network(options.spec, shape, data.num_classes, groups=options.groups)
    check_forward(options.spec, model, shape, data.num_classes)


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
    weight file, never from the private data. The rows the weight file was trained on were
    left out of the run by :func:`dpvision.runs.inputs.load_inputs`, and a file trained on
    this run's own dataset by name refused, unless ``learner.init_allow_same_dataset`` is
    set.
    """
    shape = tuple(int(v) for v in data.train_x.shape[1:])
    model = build_network(options.spec, shape, data.num_classes, groups=options.groups)
    info: dict[str, Any] = {}
    if plan is not None:
        plan.head, _ = load_into(
            model, plan.encoder, model_name=options.model, input_shape=plan.info.input_shape
        )
    elif options.init is not None:
        head = head_init_for(options, data.name)
        report = load_weights(model, options.init, head)  # its record was checked by load_inputs
        say(report.message(), quiet)
        info["init"] = {
            "path": str(options.init),
            "sha256": init_sha256 or encoder_digest(options.init),
            "head_replaced": report.head_replaced,
            "head_init": report.head_init,
            "trained_on": report.record.get("trained_on") or report.record.get("dataset"),
        }
    if options.spec.external:
        model = prepare_for_dp(model, options.batchnorm_mode)
        info["batchnorm"] = options.batchnorm_mode
    else:
        validate_model(model)
    trained = apply_finetune(model, options.finetune)
    info["finetune"] = options.finetune
    if options.finetune != "all":
        say(f"fine-tuning {options.finetune}: {len(trained)} parameter tensors train", quiet)
    return model, info


def released_model(
    config: TrainConfig,
    options: DPSGDOptions,
    data: TrainingData,
    state: TrainingState,
    *,
    plan: TransferPlan | None,
    preprocessing: FittedPreprocessing | None,
    result: dict[str, Any],
) -> TrainedModel:
    """The model a run releases (its EMA parameters when it keeps an EMA) and how inputs
    reach it, with the privacy of ``result``.

    Privacy: post-processing of the run's noisy steps; the input normalisation is public
    (the dataset's published statistics or the DP-RandP encoder's).
    """
    model = state.model
    if state.ema is not None:
        model = state.ema.copy_to(copy.deepcopy(model))
    mean = std = None
    if plan is not None:
        mean, std = plan.info.mean, plan.info.std
    elif config.features == "pixels":
        statistics = pixel_statistics(options, data.name, int(data.train_x.shape[1]))
        mean, std = statistics if statistics is not None else (None, None)
    return TrainedModel(
        method=config.method,
        dataset=data.name,
        num_classes=data.num_classes,
        image_shape=data.image_shape,
        features=config.features,
        preprocessing=preprocessing,
        privacy=privacy_of(result),
        config=config.to_dict(),
        pixel_mean=None if mean is None else tuple(mean),
        pixel_std=None if std is None else tuple(std),
        input_shape=tuple(int(v) for v in data.train_x.shape[1:]),
        network=model.eval().cpu(),  # the saved model is read on any machine
        model_name=options.spec.absolute().text,  # a python: factory's file from anywhere
        model_args=options.spec.kwargs,
        groups=options.groups,
        batchnorm=options.batchnorm_mode,
        class_names=data.class_names,
    )


def head_init_for(options: DPSGDOptions, dataset: str) -> str:
    """How the classifier starts (``learner.head_init``): ``auto`` keeps the head of
    ``learner.init`` when its file says it was trained on ``dataset`` (its outputs are this
    run's classes, as a public slice's are), and zeroes it otherwise — a file trained on
    other classes (Fashion-MNIST's for digits) or one that does not say (a timm state dict).

    Measured (issue 40, ``benchmarks/results/transfer_pairs.md``): Fashion-MNIST weights
    fine-tuned on digits at ε = 1 lost to scratch with their own 10-class head kept (its
    logits name clothes) and gained with it zeroed.

    Privacy: decided by the config and the weight file's record, never by the private data.
    """
    if options.head_init != "auto" or options.init is None:
        return options.head_init
    record = weights_record(options.init)
    trained_on = record.get("dataset")
    return "keep" if trained_on is not None and same_dataset(trained_on, dataset) else "zero"


def pixel_statistics(options: DPSGDOptions, dataset: str, channels: int) -> Statistics | None:
    """The per-channel ``(mean, std)`` a DP-SGD run standardises its pixels with, or
    ``None`` (pixels in [0, 1]): ``learner.normalization``, with ``auto`` meaning ``init``
    when ``learner.init`` is set and ``none`` otherwise.

    ``init``: the statistics the weights were trained with, so that the network sees
    inputs on the scale it learnt (timm's weights expect ImageNet's mean and std; a model
    pre-trained on raw pixels expects raw pixels). In order: the file's recorded statistics
    (a ``dpvision pretrain`` file, a ``dpvision train --save`` model), the published
    statistics of the dataset it records with ``normalization = "dataset"``, timm's
    ``pretrained_cfg`` for a ``timm:`` model, else none. Three-channel statistics for a
    one-channel run (an RGB stem summed to one channel) are averaged.

    Privacy: public constants (the config, the weight file, timm's registry); nothing is
    read off the private data.
    """
    mode = options.normalization
    if mode == "auto":
        mode = "init" if options.init is not None else "none"
    if mode == "none":
        return None
    if mode == "dataset":
        return dataset_statistics(dataset)
    assert options.init is not None  # refused by DPSGDOptions.validated
    record = weights_record(options.init)
    statistics = record.get("input_statistics")
    if statistics is None and record.get("normalization") == "dataset" and record.get("dataset"):
        statistics = dataset_statistics(str(record["dataset"]))
    if statistics is None and options.spec.kind == "timm":
        statistics = timm_models.default_statistics(options.spec.name)
    if statistics is None:
        return None
    mean, std = (tuple(float(v) for v in values) for values in statistics)
    if len(mean) != channels and channels == 1:
        mean, std = (sum(mean) / len(mean),), (sum(std) / len(std),)
    if len(mean) != channels:
        return None
    if all(m == 0.0 for m in mean) and all(s == 1.0 for s in std):
        return None  # the identity: pixels in [0, 1], as without statistics
    return mean, std
