"""DP-SGD checkpoints: the whole training state, written atomically, resumed bit for bit.

A checkpoint holds the model, the optimizer, the EMA, the sampler's RNG, the noise and
augmentation generators, the evaluation history and the ledger. The noise generator lives
on the run's device; its state is resumed on a device of the same kind (a CUDA generator's
stream does not continue on the CPU), and the tensors on any device. A run killed at any point
and resumed from its checkpoint ends with the same parameters and the same ledger as an
uninterrupted run. A checkpoint written by another configuration (another ``fingerprint``
of the settings that change the run) is refused, naming the settings that differ.

Privacy: a checkpoint holds parameters and optimizer moments, which are post-processing of
the noisy releases recorded in its ledger, plus the states of the noise and sampling
generators and the run's secret randomness (:mod:`dpvision.mechanisms.secret`): with them
and the data, the noise could be replayed. A checkpoint is therefore *as private as the
data*: it is written readable by its owner only (mode 0600) and never published.
"""

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dpvision.accounting import PrivacyLedger
from dpvision.averaging import ParameterEMA
from dpvision.distributed import Workers
from dpvision.errors import DPVisionError
from dpvision.fileio import atomic_open, differing_keys, load_torch
from dpvision.mechanisms import PoissonSampler
from dpvision.mechanisms.clip_policy import ClipPolicy
from dpvision.mechanisms.noise import NoiseGenerator
from dpvision.mechanisms.secret import SecretRandomness

CHECKPOINT_FORMAT = "dpvision-dpsgd-checkpoint-v1"


@dataclasses.dataclass
class TrainingState:
    """Everything a DP-SGD run needs to continue, and nothing else.

    ``history`` holds the evaluations so far; ``ledger`` every release so far.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ema: ParameterEMA | None
    sampler: PoissonSampler
    noise: NoiseGenerator  # a torch generator (a secure run has no checkpoint)
    augment: torch.Generator
    ledger: PrivacyLedger
    policy: ClipPolicy  # its state: adaptive clipping's current clip norm
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    secret: SecretRandomness | None = None  # the run's secret randomness (kept, never shown)


def fingerprint(settings: dict[str, Any]) -> str:
    """A short hash of the settings that change a run (sorted JSON)."""
    text = json.dumps(settings, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def save_checkpoint(path: Path, state: TrainingState, settings: dict[str, Any]) -> None:
    """Writes ``state`` and the run's ``settings`` to ``path`` atomically.

    Privacy: see the module docstring; post-processing of the releases in ``state.ledger``.
    """
    payload = {
        "format": CHECKPOINT_FORMAT,
        "fingerprint": fingerprint(settings),
        "config": settings,
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "ema": None if state.ema is None else state.ema.state_dict(),
        "sampler": state.sampler.state_dict(),
        "noise": state.noise.get_state(),
        "noise_device": state.noise.device.type,
        "augment": state.augment.get_state(),
        "history": list(state.history),
        "ledger": state.ledger.to_json(),
        "clip_policy": state.policy.state_dict(),
        "secret": None if state.secret is None else state.secret.state(),
    }
    with atomic_open(path, "wb", private=True) as out:
        torch.save(payload, out)
    _saved[:] = [(Path(path), int(state.sampler.step))]


_saved: list[tuple[Path, int]] = []
"""The checkpoint this process wrote last and its step (what an interrupted run says)."""


def last_saved() -> tuple[Path, int] | None:
    """(path, step) of the checkpoint this process wrote last, or None (the command line
    says it when a run is interrupted; the step count is public: the schedule's)."""
    return _saved[0] if _saved else None


def forget_saved() -> None:
    """Forgets :func:`last_saved` (a new run starts)."""
    _saved.clear()


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The payload of a DP-SGD checkpoint (read without running code; one-line errors)."""
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


def checkpoint_secret(path: Path, workers: Workers | None = None) -> SecretRandomness | None:
    """The secret randomness of the checkpoint at ``path`` (None: no file yet), so that a
    resumed run keeps its validation split and its streams."""
    workers = workers or Workers()
    if not workers.from_main(path.exists):
        return None
    state = workers.from_main(lambda: read_checkpoint(path).get("secret"))
    if state is None:
        raise DPVisionError(
            f"checkpoint {path} was written before dpvision kept a run's secret randomness; "
            "move it away to start afresh"
        )
    return SecretRandomness.from_state(state)


def resume(
    path: Path,
    state: TrainingState,
    settings: dict[str, Any],
    workers: Workers | None = None,
    *,
    enter_step: Callable[[int], torch.optim.Optimizer] | None = None,
) -> None:
    """Restores ``state`` from the checkpoint at ``path``; refuses one of other settings.

    ``enter_step`` (DP-RandP) gives the optimizer of the phase the run stopped in, before
    its state is loaded. Rank 0 reads the file and sends its contents to the other ranks,
    so only rank 0 needs to see it.
    """
    payload = (workers or Workers()).from_main(lambda: read_checkpoint(path))
    if payload["fingerprint"] != fingerprint(settings):
        differ = differing_keys(settings, payload["config"])
        fix = "resume with the same config"
        if "device" in differ:  # name the device it was written on: the usual slip
            fix = f"resume it with --device {payload['config'].get('device')}"
            fix += " and the same config" if len(differ) > 1 else ""
        raise DPVisionError(
            f"checkpoint {path} was written by a different configuration (differs in: "
            f"{', '.join(differ) or 'unknown'}); {fix}, or give another --checkpoint path "
            "(the existing file is left untouched)"
        )
    written_on = payload.get("noise_device", "cpu")
    if written_on != state.noise.device.type:
        raise DPVisionError(
            f"checkpoint {path} was written with the noise generator on {written_on}; resume "
            f"it with --device {written_on} (a {written_on} generator's stream cannot go on "
            f"on {state.noise.device.type}; the file is left untouched)"
        )
    state.model.load_state_dict(payload["model"])
    state.sampler.load_state_dict(payload["sampler"])
    if enter_step is not None:
        state.optimizer = enter_step(state.sampler.step)
    state.optimizer.load_state_dict(payload["optimizer"])
    if state.ema is not None:
        state.ema.load_state_dict(payload["ema"])
    state.noise.set_state(payload["noise"])
    state.augment.set_state(payload["augment"])
    state.history[:] = payload["history"]
    # (Written as "adaptive", None for flat clipping, before the clip policies.)
    state.policy.load_state_dict(payload.get("clip_policy", payload.get("adaptive")) or {})
    state.ledger = PrivacyLedger.from_json(payload["ledger"])


def state_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters and buffers, to check that all ranks hold the same model."""
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
