"""Non-private supervised pre-training on a public dataset (De et al. 2022, §4 and App. C).

``dpvision pretrain --objective supervised`` trains a whole model — body and classifier —
with cross-entropy (optionally label-smoothed) on the training images of a *public*
dataset: SGD with momentum, weight decay, random crops and flips (augmentation multiplicity
1), a constant, step or cosine learning-rate schedule; the seed-003 recipes are configs
under ``configs/seed003/``. BatchNorm trains as usual here (no privacy is at stake); a
private run later freezes it or replaces it (``learner.batchnorm``).

The result is an encoder file (:mod:`dpvision.models.encoder`) that keeps the head, with a
record of what it was trained on (``dataset``, ``public_fraction``, ``n_images``, and the
rows themselves: :func:`public_rows_record`), read by ``learner.init`` and by
``--features encoder:path=FILE``; :func:`check_private_rows` is how a private run refuses
weights trained on any of its private rows. Checkpoints (atomic) hold the model, the
optimizer, the step and every random state: a resumed run ends with the same weights as an
uninterrupted one.

Privacy: the whole point is that these images are public. With ``public_fraction = f``
only the public slice of the dataset's training set is read
(:func:`dpvision.data.splits.public_split`: each example's side is its own keyed hash, so
the slice does not move when rows are added or removed); the private run then leaves those
rows out. Nothing is recorded in any privacy ledger: this run has no privacy cost only if
its data are public, which the output file states — with the digests of the rows it read —
so that a private run can refuse it when they include any of its private rows.
"""

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional

from dpvision.data.augment import PADDING_MODES, augment_views
from dpvision.data.datasets import load_dataset, same_dataset
from dpvision.data.inputs import DATASET_STATISTICS, lazy_pixel_inputs
from dpvision.data.splits import PUBLIC_SPLIT, public_digests, public_split
from dpvision.errors import DPVisionError
from dpvision.fileio import load_session, save_session
from dpvision.log import progress, say
from dpvision.models.encoder import EncoderInfo, save_encoder
from dpvision.models.registry import build_network, check_model
from dpvision.models.weights import check_trained_on
from dpvision.training.options import coerce_option

SUPERVISED_CHECKPOINT_FORMAT = "dpvision-supervised-checkpoint-v1"
SCHEDULES = ("constant", "step", "cosine")


@dataclasses.dataclass(frozen=True)
class SupervisedOptions:
    """Hyper-parameters of supervised pre-training (``dpvision pretrain --objective
    supervised``; the ``[pretrain]`` table of such a config).

    Attributes:
      dataset: the public dataset (a dpvision dataset name or path spec).
      data_dir: where its files are (``None``: the standard lookup).
      num_classes, image_channels: for path datasets (``npz:``, ``imagefolder:``, …), as
        in ``dpvision train``.
      public_fraction: 0: the whole training set is public; f in (0, 1): only its public
        slice (:func:`dpvision.data.splits.public_split`), the rest left to a private run.
      model: a model spec (:mod:`dpvision.models.sources`).
      groups: GroupNorm groups of dpvision's WRNs.
      steps: optimisation steps; if unset, ``epochs`` over the public images.
      epochs: used when ``steps`` is unset.
      batch_size, learning_rate, momentum, nesterov, weight_decay: SGD's.
      schedule: ``constant``, ``step`` (÷10 at each of ``milestones``, fractions of the
        steps) or ``cosine`` (to 0), after ``warmup_steps`` of linear warm-up.
      label_smoothing: of the cross-entropy.
      crop_padding, flip, padding_mode: the random crop and flip (0 and false: none).
      normalization: ``none`` (pixels in [0, 1]) or ``dataset`` (published statistics);
        recorded in the file — fine-tune with the same ``learner.normalization``.
      seed: seeds the initialisation, the order and the augmentation.
      checkpoint_every: steps between checkpoints (with a checkpoint path).
    """

    dataset: str = ""
    data_dir: str | None = None
    num_classes: int | None = None
    image_channels: int | None = None
    public_fraction: float = 0.0
    model: str = "tanh-cnn"
    groups: int = 16
    steps: int | None = None
    epochs: float | None = 10.0
    batch_size: int = 128
    learning_rate: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    schedule: str = "constant"
    milestones: tuple[float, ...] = (0.5, 0.75)
    warmup_steps: int = 0
    label_smoothing: float = 0.0
    crop_padding: int = 4
    flip: bool = True
    padding_mode: str = "reflect"
    normalization: str = "none"
    seed: int = 0
    checkpoint_every: int = 500

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SupervisedOptions":
        """Builds and validates the options; unknown keys and bad values are one-line errors."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in fields:
                raise DPVisionError(
                    f"unknown pretrain option {key!r} for --objective supervised; valid: "
                    f"{', '.join(sorted(fields))}"
                )
            kind = fields[key].type
            name = kind.__name__ if isinstance(kind, type) else str(kind)
            values[key] = _coerce(key, value, name)
        if values.get("steps") is not None and "epochs" not in values:
            values["epochs"] = None
        return cls(**values).validated()

    def validated(self) -> "SupervisedOptions":
        if not self.dataset:
            raise DPVisionError("supervised pre-training needs --dataset (the public dataset)")
        check_model(self.model)
        if (self.steps is None) == (self.epochs is None):
            raise DPVisionError("give exactly one of pretrain steps and epochs")
        if self.steps is not None and self.steps < 1:
            raise DPVisionError(f"pretrain.steps must be >= 1, got {self.steps}")
        if self.epochs is not None and not self.epochs > 0:
            raise DPVisionError(f"pretrain.epochs must be > 0, got {self.epochs}")
        if not 0 <= self.public_fraction < 1:
            raise DPVisionError(
                f"pretrain.public_fraction must be in [0, 1), got {self.public_fraction}"
            )
        for name in ("batch_size", "learning_rate"):
            if not getattr(self, name) > 0:
                raise DPVisionError(f"pretrain.{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "momentum",
            "weight_decay",
            "warmup_steps",
            "crop_padding",
            "groups",
            "checkpoint_every",
        ):
            if getattr(self, name) < 0:
                raise DPVisionError(f"pretrain.{name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise DPVisionError(
                f"pretrain.checkpoint_every must be >= 0, got {self.checkpoint_every}"
            )
        if not 0 <= self.label_smoothing < 1:
            raise DPVisionError(
                f"pretrain.label_smoothing must be in [0, 1), got {self.label_smoothing}"
            )
        if any(not 0 < m < 1 for m in self.milestones):
            raise DPVisionError("pretrain.milestones must be fractions of the steps in (0, 1)")
        if not 0 <= self.seed < 2**63:
            raise DPVisionError(f"pretrain.seed must be in [0, 2**63), got {self.seed}")
        choices = {
            "schedule": (self.schedule, SCHEDULES),
            "padding_mode": (self.padding_mode, PADDING_MODES),
            "normalization": (self.normalization, ("none", "dataset")),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise DPVisionError(
                    f"unknown pretrain.{name} {value!r}; choose one of {', '.join(allowed)}"
                )
        return self

    def settings(self) -> dict[str, Any]:
        """Every option that changes the weights (all but where the data are and how often
        to checkpoint)."""
        data = dataclasses.asdict(self)
        data.pop("checkpoint_every")
        data.pop("data_dir")
        return data


def _coerce(name: str, value: Any, kind: str) -> Any:
    if kind.startswith("tuple"):
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value
        ):
            raise DPVisionError(f"pretrain.{name} must be a list of numbers, got {value!r}")
        return tuple(float(v) for v in value)
    return coerce_option(name, value, kind, table="pretrain")


def learning_rate_at(options: SupervisedOptions, step: int, steps: int) -> float:
    """The schedule's learning rate at ``step`` of ``steps``.

    >>> o = SupervisedOptions(dataset="x", schedule="step", learning_rate=1.0, steps=100)
    >>> tuple(round(learning_rate_at(o, s, 100), 6) for s in (0, 50, 75))
    (1.0, 0.1, 0.01)
    """
    rate = options.learning_rate
    if step < options.warmup_steps:
        return rate * (step + 1) / options.warmup_steps
    if options.schedule == "step":
        return rate * 0.1 ** sum(step >= math.ceil(m * steps) for m in options.milestones)
    if options.schedule == "cosine":
        span = max(steps - options.warmup_steps, 1)
        return rate * 0.5 * (1 + math.cos(math.pi * (step - options.warmup_steps) / span))
    return rate


def _seeds(seed: int) -> dict[str, int]:
    names = ("init", "order", "augment")
    states = np.random.SeedSequence([seed, 5]).generate_state(len(names), dtype=np.uint64)
    return {name: int(value) % 2**63 for name, value in zip(names, states, strict=True)}


def trained_on(options: SupervisedOptions, name: str) -> str:
    """How the output file names its training data, e.g. ``fashion-mnist (public slice,
    10 % of the training set)``."""
    if not options.public_fraction:
        return f"{name} (training set)"
    return f"{name} (public slice, {100 * options.public_fraction:g} % of the training set)"


def pretrain_supervised(
    options: SupervisedOptions,
    out: str | Path,
    *,
    checkpoint: str | Path | None = None,
    quiet: bool = False,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Trains ``options.model`` on the public images and writes the file ``out``, on
    ``device`` (default: the CPU; the crops' random draws stay on a CPU generator, so a
    checkpoint resumes on any device).

    Returns a summary: the data trained on, steps, the final loss (mean of the last
    steps), the accuracy on the dataset's test set, wall time.

    Privacy: reads the public rows only (see the module docstring); records no privacy
    cost, and the file says which data it was trained on.
    """
    start = time.perf_counter()
    dataset = load_dataset(
        options.dataset,
        options.data_dir,
        num_classes=options.num_classes,
        channels=options.image_channels,
    )
    images, labels = dataset.train_images, np.asarray(dataset.train_labels)
    rows = np.arange(len(labels))
    if options.public_fraction:
        rows = public_split(images, labels, options.public_fraction)[1]
    if options.batch_size > len(rows):
        raise DPVisionError(
            f"pretrain.batch_size {options.batch_size} exceeds the {len(rows)} public images"
        )
    device = device or torch.device("cpu")
    inputs = lazy_pixel_inputs(images[rows], dataset.name, options.normalization).to(device)
    targets = torch.as_tensor(labels[rows], dtype=torch.long).to(device)
    per_epoch = math.ceil(len(rows) / options.batch_size)
    steps = options.steps or math.ceil((options.epochs or 0) * per_epoch)
    shape = tuple(int(v) for v in inputs.shape[1:])
    seeds = _seeds(options.seed)
    torch.manual_seed(seeds["init"])
    model = build_network(options.model, shape, dataset.num_classes, groups=options.groups)
    model = model.to(device)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=options.learning_rate,
        momentum=options.momentum,
        nesterov=options.nesterov,
        weight_decay=options.weight_decay,
    )
    session = _Session(
        options.settings(),
        model,
        optimizer,
        order=np.random.default_rng(seeds["order"]),
        augment=torch.Generator().manual_seed(seeds["augment"]),
    )
    if checkpoint is not None and Path(checkpoint).exists():
        session.resume(Path(checkpoint))
        say(f"resumed pre-training from {checkpoint} at step {session.step}", quiet)
    say(
        f"supervised pre-training of {options.model} "
        f"({sum(p.numel() for p in model.parameters())} parameters) on "
        f"{trained_on(options, dataset.name)}: {len(rows)} images, {steps} steps of "
        f"{options.batch_size} (public data: no privacy cost)",
        quiet,
    )
    model.train()
    last_report, window = time.perf_counter(), []
    while session.step < steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(options, session.step, steps)
        index = torch.as_tensor(session.next_batch(len(rows), options.batch_size))
        x = inputs[index]
        if options.crop_padding or options.flip:
            x = augment_views(
                x,
                1,
                session.augment,
                padding=options.crop_padding,
                flip=options.flip,
                mode=options.padding_mode,
            )[:, 0]
        loss = functional.cross_entropy(
            model(x), targets[index], label_smoothing=options.label_smoothing
        )
        if not torch.isfinite(loss):
            raise DPVisionError(
                f"pre-training diverged at step {session.step} (loss {float(loss)}); lower "
                "pretrain.learning_rate"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        session.step += 1
        window.append(float(loss.detach()))
        if session.step % 50 == 0 or session.step == steps:
            session.losses.append({"step": session.step, "loss": float(np.mean(window))})
            window = []
        if time.perf_counter() - last_report > 30 and session.losses:
            say(
                f"pre-training {progress(session.step, steps, time.perf_counter() - start)}: "
                f"loss {session.losses[-1]['loss']:.4f}",
                quiet,
            )
            last_report = time.perf_counter()
        every = options.checkpoint_every
        if (
            checkpoint is not None
            and every
            and (session.step % every == 0 or session.step == steps)
        ):
            session.save(Path(checkpoint))
    model.eval()
    test_accuracy = _accuracy(model, dataset, options.normalization, device)
    mean, std = (
        DATASET_STATISTICS[dataset.name]
        if options.normalization == "dataset"
        else ((0.0,) * shape[0], (1.0,) * shape[0])
    )
    metadata = {
        "objective": "supervised",
        "trained_on": trained_on(options, dataset.name),
        "dataset": dataset.name,
        "public_fraction": options.public_fraction,
        "n_images": len(rows),
        "num_classes": int(dataset.num_classes),
        "normalization": options.normalization,
        "private_data": False,
        "options": dataclasses.asdict(options),
        "steps": steps,
        "final_loss": session.losses[-1]["loss"] if session.losses else None,
        "test_accuracy": test_accuracy,
        "wall_seconds": time.perf_counter() - start,
    }
    public_rows = public_rows_record(images[rows], labels[rows])
    info = EncoderInfo(
        options.model,
        shape,
        options.groups,
        tuple(mean),
        tuple(std),
        {**metadata, **public_rows},
    )
    save_encoder(out, model.cpu(), info)
    # The summary is JSON: the digests stay in the file, their sha256 is in both.
    public_rows.pop("public_row_digests")
    return {"encoder": str(out), **metadata, **public_rows}


def public_rows_record(rows: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """What a weight file records of the examples it was trained on (its public rows):
    the public split's definition (:data:`~dpvision.data.splits.PUBLIC_SPLIT`), their
    digests under its key — sorted uint64, stored as an int64 tensor, 8 bytes a row — and
    the sha256 of those digests (little-endian), the rows' digest.

    >>> images, labels = np.arange(12, dtype=np.uint8).reshape(3, 2, 2, 1), np.arange(3)
    >>> record = public_rows_record(images, labels)
    >>> record["public_split"] == PUBLIC_SPLIT, tuple(record["public_row_digests"].shape)
    (True, (3,))
    >>> len(record["public_rows_sha256"])
    64

    Privacy: the rows are public (pre-training reads no other), so are their digests.
    """
    digests = np.sort(public_digests(rows, labels))
    return {
        "public_split": PUBLIC_SPLIT,
        "public_rows_sha256": _sha256(digests),
        "public_row_digests": torch.from_numpy(digests.view(np.int64)),
    }


def check_private_rows(
    record: dict[str, Any],
    dataset: str,
    *,
    private_rows: np.ndarray,
    private_labels: np.ndarray,
    what: str,
    allow: bool = False,
    override: str | None = None,
) -> np.ndarray:
    """Which of a private run's rows (its public slice left out) the weights were trained
    on: a boolean mask, True for rows to leave out as public.

    A file of supervised pre-training records the digests of its rows
    (:func:`public_rows_record`); the private rows are hashed the same way, whatever the
    dataset is called and however many rows it has (a digest reads its example alone).

    * Weights from a *declared public slice* (``public_fraction`` > 0 in the record): a
      private row with the digest of one of those rows is a copy of a public example, and
      the run leaves it out as public (the mask). No error: a refusal would say whether the
      private data holds such a copy, and leaving it out makes the dataset with the copy
      and the dataset without it run alike.
    * Weights trained on a whole training set (``public_fraction`` 0: not declared public):
      one private row in common refuses them — that training's privacy cost would be
      outside the run's ledger.
    * A file that records no rows under this version's split — an older one, another
      tool's — is judged by the dataset it names
      (:func:`dpvision.models.weights.check_trained_on`).

    ``allow`` (the user's explicit ``override``, when the caller offers one) lets any pass
    and leaves nothing out.

    Privacy: the mask leaves out rows that are copies of declared-public examples; which
    rows they are depends on each row alone. The refusal of whole-dataset weights is a
    function of the private rows, given before anything is released.

    Raises:
      DPVisionError: one line saying why and how to proceed.
    """
    none = np.zeros(len(private_labels), dtype=bool)
    if allow:
        return none
    recorded = _recorded_digests(record, what)
    if recorded is None:
        check_trained_on(record, dataset, what=what, same=same_dataset, override=override)
        return none
    common = np.isin(public_digests(private_rows, private_labels), recorded)
    if record.get("public_fraction") or not common.any():
        return common
    raise DPVisionError(
        f"{what} was trained on {int(common.sum())} of this run's {len(common)} private rows "
        f"({record.get('trained_on') or record.get('dataset')}, not declared public), outside "
        "this run's ledger: pre-train on other data or on a declared public slice "
        "(--public-fraction)" + (f", or set {override}" if override else "")
    )


def rows_trained_on(
    record: dict[str, Any],
    dataset: str,
    images: np.ndarray,
    labels: np.ndarray,
    public_fraction: float,
    *,
    what: str,
    allow: bool = False,
    override: str | None = None,
) -> np.ndarray:
    """The rows of a private run's dataset to leave out as public because a weight file
    was trained on copies of them: :func:`check_private_rows` on the rows outside the run's
    own public slice (``public_fraction``), as dataset row indices.

    Privacy: as :func:`check_private_rows`.
    """
    labels = np.asarray(labels)
    private = np.arange(len(labels))
    if public_fraction:
        private = public_split(images, labels, public_fraction)[0]
    mask = check_private_rows(
        record,
        dataset,
        private_rows=images[private],
        private_labels=labels[private],
        what=what,
        allow=allow,
        override=override,
    )
    return private[mask]


def _recorded_digests(record: dict[str, Any], what: str) -> np.ndarray | None:
    """The digests of the rows the file was trained on (uint64), or None when it records
    none under this version's public split; a record that does not match its sha256 or its
    count of rows is refused."""
    if record.get("public_split") != PUBLIC_SPLIT or "public_row_digests" not in record:
        return None
    digests = np.asarray(record["public_row_digests"])
    if digests.dtype == np.int64:
        digests = digests.view(np.uint64)
    if (
        digests.dtype != np.uint64
        or len(digests) != record.get("n_images")
        or _sha256(digests) != record.get("public_rows_sha256")
    ):
        raise DPVisionError(
            f"{what} records the rows it was trained on, but their digests do not match "
            "their count or sha256 (a damaged or edited file): pre-train it again"
        )
    return digests


def _sha256(digests: np.ndarray) -> str:
    """The rows' digest: the sha256 of the digests as little-endian uint64."""
    return hashlib.sha256(np.ascontiguousarray(digests, dtype="<u8").tobytes()).hexdigest()


@torch.no_grad()
def _accuracy(
    model: torch.nn.Module, dataset: Any, normalization: str, device: torch.device
) -> float:
    """Accuracy on the dataset's test set (a held-out statistic, as any test accuracy)."""
    inputs = lazy_pixel_inputs(dataset.test_images, dataset.name, normalization).to(device)
    labels = torch.as_tensor(np.asarray(dataset.test_labels), dtype=torch.long).to(device)
    correct = 0
    for begin in range(0, len(labels), 1024):
        index = torch.arange(begin, min(begin + 1024, len(labels)))
        correct += int((model(inputs[index]).argmax(1) == labels[index]).sum())
    return correct / max(len(labels), 1)


@dataclasses.dataclass
class _Session:
    """The state a checkpoint of supervised pre-training holds."""

    settings: dict[str, Any]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    order: np.random.Generator
    augment: torch.Generator
    step: int = 0
    position: int = 0
    permutation: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    losses: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def next_batch(self, n: int, size: int) -> np.ndarray:
        """The next ``size`` rows of a fresh permutation per epoch (the last partial batch
        of an epoch is dropped)."""
        if self.position + size > len(self.permutation):
            self.permutation = self.order.permutation(n)
            self.position = 0
        rows = self.permutation[self.position : self.position + size]
        self.position += size
        return np.sort(rows)

    def save(self, path: Path) -> None:
        """Writes the checkpoint atomically."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "order": json.dumps(self.order.bit_generator.state),
            "augment": self.augment.get_state(),
            "permutation": torch.from_numpy(self.permutation.copy()),
            "position": self.position,
            "step": self.step,
            "losses": list(self.losses),
        }
        save_session(path, SUPERVISED_CHECKPOINT_FORMAT, self.settings, state)

    def resume(self, path: Path) -> None:
        """Restores a checkpoint; refuses one of other options (and leaves it alone)."""
        payload = load_session(path, SUPERVISED_CHECKPOINT_FORMAT, self.settings, "pre-training")
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.order.bit_generator.state = json.loads(payload["order"])
        self.augment.set_state(payload["augment"])
        self.permutation = payload["permutation"].numpy()
        self.position = int(payload["position"])
        self.step = int(payload["step"])
        self.losses = list(payload["losses"])
