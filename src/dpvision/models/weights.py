"""``learner.init``: weights from a file into a model, with the classifier head refitted.

Files read (all without running code: ``torch.load(weights_only=True)`` or safetensors):

* ``.safetensors`` — a state dict (timm's and Hugging Face's format); a dpvision model file
  (``dpvision train --save``) gives its network;
* ``.pt``/``.pth``/``.bin``/``.ckpt`` — a state dict, or a dict holding one under
  ``state_dict``, ``model``, ``model_state_dict`` or ``module`` (Lightning, DeiT, …), a
  dpvision encoder (``dpvision pretrain``) or a dpvision DP-SGD checkpoint.

A ``module.`` prefix (DataParallel/DDP) is dropped. The head (the last ``nn.Linear``)
starts fresh when the file's has another shape (another number of classes) or is absent (an
encoder body), or when the caller asks for it (``head = "zero"`` or ``"random"``: a file
trained on other classes). A fresh head is zero — zero logits, every class equally likely
at the start, as Mehta et al. (2022) and seed 000 ("we initialize the last layer weights to
zero") fine-tune privately — unless ``"random"`` (the model's own initialisation).
:class:`LoadReport` says so. A single-channel model takes an RGB
stem by summing its input channels (as timm's ``adapt_input_conv``). Any other mismatch —
a missing or unexpected weight, another shape — is a one-line error naming it.

Privacy: the weights are public inputs when they were trained without the private data;
:attr:`LoadReport.record` says what the file knows of its training data so that the run can
refuse weights trained on the very dataset it protects (their privacy cost would be outside
its ledger). Which head is replaced depends only on shapes and the caller's choice, never on data.
"""

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.fileio import load_torch
from dpvision.models.encoder import ENCODER_FORMAT
from dpvision.models.heads import head_name

__all__ = [
    "HEAD_INITS",
    "LoadReport",
    "check_trained_on",
    "load_weights",
    "read_weights",
    "weights_record",
]

HEAD_INITS = ("auto", "keep", "zero", "random")
"""``learner.head_init``: ``keep`` the file's head when it fits (else zero), ``zero`` or
``random`` (the model's own initialisation) in every case; ``auto`` is decided by the run
(:func:`dpvision.runs.network.head_init_for`)."""

_NESTED = ("state_dict", "model_state_dict", "model", "module", "network")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What :func:`load_weights` did.

    Attributes:
      path: the file.
      loaded: how many tensors of the file went into the model.
      head: the dotted name of the model's head.
      head_replaced: whether the head starts fresh (absent from the file, another shape,
        or not kept by ``head``).
      head_init: how the head starts: ``file``, ``zero`` or ``random``.
      adapted: weights reshaped to fit (an RGB stem summed to one channel).
      record: what the file says of its training (``trained_on``, ``dataset``,
        ``public_fraction``, the digests of its public rows, …; a dpvision encoder's
        ``input_statistics``, its per-channel mean and std); empty for a plain state dict.
    """

    path: str
    loaded: int
    head: str
    head_replaced: bool
    adapted: tuple[str, ...]
    record: dict[str, Any]
    head_init: str = "file"

    def message(self) -> str:
        """One line for the run's log."""
        parts = [f"loaded {self.loaded} tensors from {self.path}"]
        if self.head_replaced:
            parts.append(f"the classifier head '{self.head}' starts at {self.head_init}")
        if self.adapted:
            parts.append(f"summed RGB weights to one channel: {', '.join(self.adapted)}")
        return "; ".join(parts)


def read_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state dict in ``path`` and what the file records of its training (one-line
    errors for a missing or unreadable file)."""
    path = Path(path)
    if not path.is_file():
        raise DPVisionError(
            f"learner.init: {path} not found (weights are never downloaded at run time; "
            "save them to this file first)"
        )
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    if path.suffix not in _TORCH_SUFFIXES:
        raise DPVisionError(
            f"learner.init: {path} is neither .safetensors nor a torch file "
            f"({', '.join(_TORCH_SUFFIXES)})"
        )
    try:
        payload = load_torch(path)
    except Exception as error:
        raise DPVisionError(
            f"learner.init: cannot read {path} ({type(error).__name__}: a torch.save file of "
            "tensors is needed; pickled code is not run)"
        ) from None
    return _unwrap(payload, path)


def weights_record(path: str | Path) -> dict[str, Any]:
    """What the file at ``path`` records of its training (:func:`read_weights`'s second
    part), read once per version of the file: a run asks for it to split its rows, to
    choose its head and its input statistics, and a timm file may be hundreds of MB."""
    path = Path(path)
    if not path.is_file():
        return read_weights(path)[1]  # its one-line error
    stat = path.stat()
    return dict(_cached_record(str(path.resolve()), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _cached_record(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    return read_weights(path)[1]


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as error:
        raise DPVisionError(f"learner.init: cannot read {path} ({error})") from None
    record: dict[str, Any] = {}
    if "dpvision" in metadata:  # a model file of `dpvision train --save`
        document = json.loads(metadata["dpvision"])
        prefix = "network."
        tensors = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not tensors:
            raise DPVisionError(f"learner.init: the model file {path} holds no network")
        record = {"dataset": document.get("dataset"), "privacy": document.get("privacy")}
        if document.get("pixel_mean") is not None and document.get("pixel_std") is not None:
            record["input_statistics"] = (document["pixel_mean"], document["pixel_std"])
    elif "trained_on" in metadata:
        record = {"trained_on": metadata["trained_on"]}
    return _strip_prefix(tensors), record


def _unwrap(payload: Any, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    record: dict[str, Any] = {}
    if isinstance(payload, dict) and payload.get("format") == ENCODER_FORMAT:
        info = payload.get("info", {})
        record = dict(info.get("metadata", {}))
        record.setdefault("model", info.get("model"))
        record["input_statistics"] = (tuple(info["mean"]), tuple(info["std"]))
        payload = payload["state_dict"]
    elif isinstance(payload, dict) and str(payload.get("format", "")).startswith("dpvision-"):
        config = payload.get("config", {})
        record = {"dataset": config.get("dataset"), "checkpoint": True}
    for _ in range(3):  # {"model": {"state_dict": …}} and the like
        if isinstance(payload, dict) and not _is_state_dict(payload):
            nested = next((payload[k] for k in _NESTED if isinstance(payload.get(k), dict)), None)
            if nested is None:
                break
            payload = nested
    if not isinstance(payload, dict) or not _is_state_dict(payload) or not payload:
        raise DPVisionError(
            f"learner.init: {path} holds no state dict (a dict of tensors, or one under "
            f"{', '.join(_NESTED)})"
        )
    return _strip_prefix(payload), record


def _is_state_dict(payload: dict[Any, Any]) -> bool:
    return all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in payload.items())


def _strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module.") :]: v for k, v in state.items()}
    return dict(state)


def load_weights(model: nn.Module, path: str | Path, head: str = "keep") -> LoadReport:
    """Loads the weights in ``path`` into ``model`` in place. The head: the file's when it
    fits and ``head`` is ``keep`` (or ``auto``); else zero, or the model's own random
    initialisation with ``head = "random"``.

    Raises:
      DPVisionError: the file cannot be read, or it does not fit the model outside the
        head (one line naming the first weights that do not fit).
    """
    state, record = read_weights(path)
    target = model.state_dict()
    name = head_name(model)
    in_head = [k for k in target if k.startswith(name + ".")]
    adapted: list[str] = []
    replaced = False
    kept: dict[str, torch.Tensor] = {}
    unexpected, wrong = [], []
    for key, value in state.items():
        if key not in target:
            unexpected.append(key)
        elif value.shape == target[key].shape:
            kept[key] = value
        elif key in in_head:
            replaced = True
        elif _is_rgb_stem(value, target[key]):
            kept[key] = value.sum(dim=1, keepdim=True)
            adapted.append(key)
        else:
            wrong.append(f"{key} {tuple(value.shape)} vs {tuple(target[key].shape)}")
    missing = [k for k in target if k not in state and not k.endswith("num_batches_tracked")]
    replaced = replaced or any(k in in_head for k in missing)
    missing = [k for k in missing if k not in in_head]
    # A head under another name (an encoder body has none; a file's own classifier may be
    # called differently) is dropped when the model's head is missing from the file.
    unexpected = [k for k in unexpected if not (replaced and _looks_like_head(k, state))]
    if unexpected or missing or wrong:
        detail = "; ".join(
            f"{label}: {', '.join(names[:3])}{' …' if len(names) > 3 else ''}"
            for label, names in (
                ("not in the model", unexpected),
                ("missing from the file", missing),
                ("other shape", wrong),
            )
            if names
        )
        raise DPVisionError(f"learner.init: {path} does not fit the model ({detail})")
    if head not in HEAD_INITS:
        raise DPVisionError(f"learner.head_init must be one of {', '.join(HEAD_INITS)}")
    if head in ("zero", "random"):
        kept = {k: v for k, v in kept.items() if k not in in_head}
        replaced = True
    with torch.no_grad():
        model.load_state_dict(kept, strict=False)
        if replaced and head != "random":
            for parameter in model.get_submodule(name).parameters():
                parameter.zero_()
    start = "file" if not replaced else ("random" if head == "random" else "zero")
    return LoadReport(str(path), len(kept), name, replaced, tuple(adapted), record, start)


def _is_rgb_stem(value: torch.Tensor, target: torch.Tensor) -> bool:
    """A convolution weight for 3 input channels where the model takes 1."""
    return (
        value.dim() == target.dim() >= 3
        and value.shape[1] == 3
        and target.shape[1] == 1
        and value.shape[0] == target.shape[0]
        and value.shape[2:] == target.shape[2:]
    )


def _looks_like_head(key: str, state: dict[str, torch.Tensor]) -> bool:
    """Whether ``key`` belongs to the file's last 2-d weight's module (its classifier)."""
    matrices = [k for k, v in state.items() if k.endswith(".weight") and v.dim() == 2]
    if not matrices:
        return False
    owner = matrices[-1].rpartition(".")[0]
    return key.rpartition(".")[0] == owner


def check_trained_on(
    record: dict[str, Any],
    dataset: str,
    *,
    what: str,
    same: Callable[[str | None, str], bool],
    allow: bool = False,
    override: str | None = None,
) -> None:
    """Refuses weights whose file says they were trained on ``dataset``, the dataset a run
    protects: that training's privacy cost would be outside the run's ledger.

    ``same`` says whether two dataset names denote one dataset (aliases, paths:
    :func:`dpvision.data.datasets.same_dataset`). This judges a file by the name it records
    alone: a file that records the digests of the rows it was trained on is judged by those
    rows instead (:func:`dpvision.training.supervised.check_private_rows`, which calls this
    for the others). A file that names a public slice of ``dataset`` (``public_fraction``)
    without its rows comes from an older split, whose rows moved with the dataset's size:
    it is refused too. ``allow`` (the user's explicit ``override``, when the caller offers
    one) lets any pass.

    Raises:
      DPVisionError: one line saying why and how to proceed.
    """
    if not same(record.get("dataset"), dataset) or allow:
        return
    fraction = record.get("public_fraction")
    if fraction:
        raise DPVisionError(
            f"{what} was trained on a public slice of {dataset} (public_fraction = "
            f"{fraction:g}) chosen by an older split that records none of its rows, so this "
            "run cannot tell them from its private rows: pre-train it again with this "
            "version of dpvision" + (f" (or set {override})" if override else "")
        )
    raise DPVisionError(
        f"{what} was trained on {dataset}, the dataset this run protects; that training's "
        "privacy cost is not in this run's ledger ("
        + (f"set {override} to use it anyway)" if override else "pre-train on public data)")
    )
