"""DP-RandP's start: find (or make, with Phase I) the encoder, normalise the private images
with its public statistics, and split the DP-SGD steps into Phases II and III.

Privacy: Phase I reads no private data; the split is a choice of the public schedule
(:func:`dpvision.training.transfer.phase2_steps_for`).
"""

import dataclasses
from pathlib import Path
from typing import Any

from dpvision.accounting import PrivacyLedger
from dpvision.config import TrainConfig
from dpvision.data.inputs import LazyInputs, TrainingData
from dpvision.distributed import current
from dpvision.errors import DPVisionError
from dpvision.features.cache import default_cache_dir
from dpvision.log import say
from dpvision.models.encoder import read_encoder
from dpvision.models.registry import wrn_groups
from dpvision.training.options import DPSGDOptions
from dpvision.training.pretrain import pretrain
from dpvision.training.pretrain_options import PretrainOptions
from dpvision.training.transfer import TransferPlan, phase2_steps_for


def transfer_plan(
    config: TrainConfig,
    options: DPSGDOptions,
    data: TrainingData,
    sigma: float,
    sample_rate: float,
    steps: int,
    quiet: bool,
) -> TransferPlan:
    """Finds (or makes, with Phase I) the encoder, normalises the images with its public
    statistics, and splits the steps into Phase II and Phase III."""
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
    if data.validation_x is not None:
        assert isinstance(data.validation_x, LazyInputs)
        data.validation_x = data.validation_x.map(info.normalize)
    phase2 = phase2_steps_for(
        options,
        sigma,
        sample_rate,
        steps,
        data.ledger,
        delta=config.delta,
        accountant=config.accountant,
    )
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
    return TransferPlan(encoder, info, phase2, steps, phase2_epsilon, pretrain_summary)


def _phase_one(
    config: TrainConfig, options: DPSGDOptions, shape: tuple[int, ...], quiet: bool
) -> tuple[Path, dict[str, Any]]:
    """Runs Phase I with the ``[pretrain]`` options, or reuses the encoder it made before
    (cached in the ``encoders`` folder of the feature cache, keyed by the options)."""
    if len(shape) != 3 or shape[1] != shape[2]:
        raise DPVisionError(f"Phase I makes square images; the dataset's are {shape}")
    kind = options.spec.kind
    groups = wrn_groups(options.groups) if kind == "wrn" else options.groups
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
        say(f"Phase I: reusing the encoder {path}", quiet)
        return path, {"cached": True, "options": dataclasses.asdict(pretrain_options)}
    if workers.distributed:
        raise DPVisionError(
            "Phase I (pre-training on synthetic images) runs in one process: run `dpvision "
            "pretrain` first (or this run without torchrun once), then set learner.encoder "
            f"to the encoder file, on every machine (this run's would be {path})"
        )
    summary = pretrain(
        pretrain_options,
        path,
        checkpoint=path.with_suffix(".ckpt"),
        quiet=quiet,
        device=config.placement.device,
    )
    path.with_suffix(".ckpt").unlink(missing_ok=True)
    return path, {"cached": False, **summary}
