"""Opacus' ``PrivacyEngine.save_checkpoint`` / ``load_checkpoint``: the module, the optimizer
and the accountant's state in one file, so that a resumed run's ε continues from the steps
already taken.

The file holds what Opacus' does, under Opacus' keys (``module_state_dict``,
``optimizer_state_dict``, ``privacy_accountant_state_dict``), plus ``ema_state_dict`` when
the optimizer keeps a parameter EMA. It holds no secret randomness: no noise generator,
no sampler state, no key. A resumed run draws its noise and batches from the secret
randomness of its own ``make_private`` (fresh OS entropy by default), so nothing in the
file replays the noise of the steps it records. It is written atomically and read with
``weights_only=True`` (no pickled code runs).

Privacy: every tensor in the file is post-processing of the noisy releases (the parameters,
the optimizer's momentum of noisy gradients, their EMA) or public accounting (the ledger's
σ, q and counts): the file is as public as the model it holds.
"""

import os
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.fileio import atomic_open
from dpvision.privacy_engine.module import PrivateModule
from dpvision.privacy_engine.optimizer import DPOptimizer

__all__ = ["checkpoint_contents", "load_module_state", "read_checkpoint", "write_checkpoint"]

CheckpointPath = str | os.PathLike[str] | IO[bytes]
_PREFIX = "_module."  # PrivateModule's (as Opacus' GradSampleModule's) state_dict prefix


def refuse_schedulers(noise_scheduler: object, grad_clip_scheduler: object) -> None:
    """Opacus' noise and clip schedulers: dpvision has none to save or restore."""
    if noise_scheduler is not None or grad_clip_scheduler is not None:
        raise DPVisionError(
            "dpvision has no noise or grad-clip schedulers to checkpoint: σ is fixed per "
            "make_private (calibrated by make_private_with_epsilon), and C adapts with "
            "clipping='adaptive'; pass noise_scheduler=None, grad_clip_scheduler=None"
        )


def checkpoint_contents(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    accountant_state: dict[str, Any],
    checkpoint_dict: dict[str, Any] | None,
    module_state_dict_kwargs: dict[str, Any] | None,
) -> dict[str, Any]:
    """The checkpoint's dict, under Opacus' keys (see the module docstring).

    Privacy: releases the module's parameters and buffers, the wrapped optimizer's state and
    the EMA (post-processing of the noisy releases) and ``accountant_state`` (public
    accounting); no secret randomness.
    """
    contents = dict(checkpoint_dict or {})
    contents["module_state_dict"] = module.state_dict(**(module_state_dict_kwargs or {}))
    contents["privacy_accountant_state_dict"] = accountant_state
    if optimizer is not None:
        contents["optimizer_state_dict"] = optimizer.state_dict()
        ema = optimizer.ema if isinstance(optimizer, DPOptimizer) else None
        if ema is not None:
            contents["ema_state_dict"] = ema.state_dict()
    return contents


def write_checkpoint(
    path: CheckpointPath, contents: dict[str, Any], torch_save_kwargs: dict[str, Any] | None
) -> None:
    """``torch.save`` of ``contents``; a path is written atomically (never half-written)."""
    if not isinstance(path, str | os.PathLike):
        torch.save(contents, path, **(torch_save_kwargs or {}))
        return
    with atomic_open(Path(path), "wb") as out:
        torch.save(contents, out, **(torch_save_kwargs or {}))


def read_checkpoint(path: CheckpointPath, torch_load_kwargs: dict[str, Any] | None) -> Any:
    """The checkpoint's dict, read with ``weights_only=True`` (a file that asks to run code
    is refused); a missing or damaged file is a one-line error."""
    kwargs = {"map_location": "cpu", **(torch_load_kwargs or {}), "weights_only": True}
    if isinstance(path, str | os.PathLike) and not Path(path).is_file():
        raise DPVisionError(f"{os.fspath(path)}: no such checkpoint file")
    try:
        contents = torch.load(path, **kwargs)
    except Exception as error:  # torch raises many kinds for damaged or foreign files
        raise DPVisionError(
            f"{path}: not a checkpoint that loads without running code ({type(error).__name__})"
        ) from None
    needed = ("module_state_dict", "privacy_accountant_state_dict")
    if not isinstance(contents, dict) or any(key not in contents for key in needed):
        raise DPVisionError(
            f"{path}: not a PrivacyEngine checkpoint (needs {', '.join(needed)}; "
            "write one with engine.save_checkpoint)"
        )
    return contents


def load_module_state(
    module: nn.Module, state: dict[str, Any], kwargs: dict[str, Any] | None
) -> None:
    """Loads ``state`` into ``module``, with or without the private module's ``_module.``
    prefix on either side (a checkpoint of the private module loads into the plain one
    before ``make_private``, and the other way round)."""
    prefixed = bool(state) and all(key.startswith(_PREFIX) for key in state)
    if isinstance(module, PrivateModule) and not prefixed:
        module = module._module
    elif not isinstance(module, PrivateModule) and prefixed:
        state = OrderedDict((key[len(_PREFIX) :], value) for key, value in state.items())
    try:
        module.load_state_dict(state, **(kwargs or {}))
    except RuntimeError as error:
        first = str(error).strip().splitlines()[0]
        raise DPVisionError(f"the checkpoint's module does not fit this module: {first}") from None
