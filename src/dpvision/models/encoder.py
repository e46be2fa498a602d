"""Encoder files: the body of a model pre-trained without private data (DP-RandP Phase I).

An encoder file holds the parameters of a model *without its head* (see
:mod:`dpvision.models.heads`), the model's name and input shape, and the public input
normalisation it was trained with (per-channel mean and standard deviation of the
synthetic images, which are public). Phase II/III (:func:`load_into`) and backbone features
(:mod:`dpvision.features.backbone`) read it back.

Files are written atomically and read with one-line errors: a missing file, a file that is
not an encoder, or an encoder for another architecture or image shape.
"""

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.fileio import atomic_open, load_torch
from dpvision.models.heads import body_of, head_name
from dpvision.models.registry import build_network
from dpvision.models.spec import ModelSpec

ENCODER_FORMAT = "dpvision-encoder-v1"


@dataclasses.dataclass(frozen=True)
class EncoderInfo:
    """What an encoder file says about itself.

    Attributes:
      model: the model name (``wrn-16-4``, ``tanh-cnn``, …; see
        :data:`dpvision.models.spec.MODELS_HELP`).
      input_shape: (C, H, W) of the images it takes.
      groups: the GroupNorm groups of the model.
      mean, std: per-channel input normalisation, public constants (statistics of the
        synthetic pre-training images); applied to images in [0, 1].
      metadata: how it was trained (generator, steps, loss, …), for the record.
    """

    model: str
    input_shape: tuple[int, int, int]
    groups: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    metadata: dict[str, Any]

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """Images (N, C, H, W) in [0, 1] → the encoder's input scale (public constants)."""
        mean = torch.tensor(self.mean, dtype=images.dtype, device=images.device).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=images.dtype, device=images.device).view(-1, 1, 1)
        return (images - mean) / std


def build_body(model: str | ModelSpec, input_shape: tuple[int, int, int], groups: int) -> nn.Module:
    """The named model for ``input_shape`` with its head replaced by the identity (as its
    source builds it: a timm model keeps its BatchNorm, used in eval mode for features)."""
    return body_of(build_network(model, input_shape, 2, groups=groups))


def without_head(state: dict[str, torch.Tensor], head: str) -> dict[str, torch.Tensor]:
    """``state`` less the parameters of the module ``head``: a supervised pre-training file
    (``dpvision pretrain --objective supervised``) keeps its classifier; a body has none."""
    return {key: value for key, value in state.items() if not key.startswith(head + ".")}


def save_encoder(path: str | Path, body: nn.Module, info: EncoderInfo) -> Path:
    """Writes ``body`` (a model whose head is the identity) and ``info`` to ``path`` atomically.

    Privacy: an encoder trained on synthetic images only holds no private information.
    """
    payload = {
        "format": ENCODER_FORMAT,
        "info": dataclasses.asdict(info),
        "state_dict": {k: v.detach().clone() for k, v in body.state_dict().items()},
    }
    path = Path(path)
    with atomic_open(path, "wb") as out:
        torch.save(payload, out)
    return path


def read_encoder(path: str | Path) -> tuple[EncoderInfo, dict[str, torch.Tensor]]:
    """The info and parameters stored in an encoder file (one-line errors)."""
    path = Path(path)
    if not path.is_file():
        raise DPVisionError(
            f"encoder file {path} not found; make one with `dpvision pretrain --out {path}`"
        )
    try:
        payload = load_torch(path)
    except Exception as error:
        raise DPVisionError(f"cannot read encoder {path} ({type(error).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != ENCODER_FORMAT:
        raise DPVisionError(f"{path} is not a dpvision encoder file ({ENCODER_FORMAT})")
    raw = dict(payload["info"])
    raw["input_shape"] = tuple(raw["input_shape"])
    raw["mean"], raw["std"] = tuple(raw["mean"]), tuple(raw["std"])
    return EncoderInfo(**raw), payload["state_dict"]


def load_encoder(path: str | Path) -> tuple[nn.Module, EncoderInfo]:
    """The pre-trained body (images → embeddings, in eval mode) and its info."""
    info, state = read_encoder(path)
    full = build_network(info.model, info.input_shape, 2, groups=info.groups)
    head = head_name(full)
    body = body_of(full)
    try:
        body.load_state_dict(without_head(state, head))
    except RuntimeError:
        raise DPVisionError(f"encoder {path} does not match the model {info.model}") from None
    return body.eval(), info


def load_into(
    model: nn.Module,
    path: str | Path,
    *,
    model_name: str,
    input_shape: tuple[int, ...],
) -> tuple[list[str], EncoderInfo]:
    """Loads an encoder's parameters into a full model (body + fresh head).

    Returns:
      The names of the parameters the encoder did not provide (the head's: Phase II of
      DP-RandP trains exactly these), and the encoder's info.

    The model should be built with the encoder's ``info.groups``.

    Raises:
      DPVisionError: the encoder is for another model or input shape, or it leaves
        parameters other than the head's unset.
    """
    info, state = read_encoder(path)
    if info.model != model_name:
        raise DPVisionError(
            f"encoder {path} is a {info.model}; the run trains a {model_name}: set "
            f"learner.model = {info.model!r}"
        )
    if tuple(info.input_shape) != tuple(input_shape):
        raise DPVisionError(
            f"encoder {path} takes images of shape {info.input_shape}, the dataset's are "
            f"{tuple(input_shape)}: pre-train with the same --size and --channels"
        )
    head = head_name(model)
    try:
        missing, unexpected = model.load_state_dict(without_head(state, head), strict=False)
    except RuntimeError:
        raise DPVisionError(f"encoder {path} does not match the model {model_name}") from None
    others = [name for name in missing if not name.startswith(head + ".")]
    if unexpected or others:
        raise DPVisionError(
            f"encoder {path} does not fit the model {model_name} for these images "
            f"(unexpected: {', '.join(unexpected[:3]) or '-'}; "
            f"missing: {', '.join(others[:3]) or '-'})"
        )
    return list(missing), info
