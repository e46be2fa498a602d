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
``--features encoder:path=FILE``; :func:`check_private_rows` is how a private run leaves
out, silently, its rows that the weights were trained on. Checkpoints (atomic) hold the model, the
optimizer, the step and every random state: a resumed run ends with the same weights as an
uninterrupted one.

Privacy: the whole point is that these images are public. With ``public_fraction = f``
only the public slice of the dataset's training set is read
(:func:`dpvision.data.splits.public_split`: each example's side is its own keyed hash, so
the slice does not move when rows are added or removed); the private run then leaves those
rows out. Nothing is recorded in any privacy ledger: this run has no privacy cost only if
its data are public, which the output file states — with the digests of the rows it read —
so that a private run leaves copies of those rows out (and refuses, by name, a file trained
on its own whole dataset).
"""

import dataclasses
import hashlib
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional

from dpvision.data.augment import augment_views
from dpvision.data.core import ImageDataset
from dpvision.data.datasets import load_dataset, same_dataset
from dpvision.data.inputs import DATASET_STATISTICS, lazy_pixel_inputs
from dpvision.data.splits import PUBLIC_SPLIT, public_digests, public_split
from dpvision.errors import DPVisionError
from dpvision.log import say
from dpvision.models.encoder import EncoderInfo, save_encoder
from dpvision.models.registry import build_network
from dpvision.models.weights import check_trained_on
from dpvision.seeds import public_seeds
from dpvision.training.pretrain_options import SupervisedOptions
from dpvision.training.session import EpochOrder, Session

SUPERVISED_CHECKPOINT_FORMAT = "dpvision-supervised-checkpoint-v1"


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
    return public_seeds(seed, "supervised pretrain", ("init", "order", "augment"))


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
    device = device or torch.device("cpu")
    data = _public_data(options, device)
    n = len(data.rows)
    steps = options.steps or math.ceil((options.epochs or 0) * math.ceil(n / options.batch_size))
    seeds = _seeds(options.seed)
    torch.manual_seed(seeds["init"])
    model = build_network(
        options.model, data.shape, data.dataset.num_classes, groups=options.groups
    )
    model = model.to(device)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=options.learning_rate,
        momentum=options.momentum,
        nesterov=options.nesterov,
        weight_decay=options.weight_decay,
    )
    order = EpochOrder(np.random.default_rng(seeds["order"]))
    augment = torch.Generator().manual_seed(seeds["augment"])
    parts = {"model": model, "optimizer": optimizer, "order": order, "augment": augment}
    session = Session(
        SUPERVISED_CHECKPOINT_FORMAT, "pre-training", options.settings(), parts, spread=("order",)
    )
    session.resume_if_saved(checkpoint, quiet)
    say(
        f"supervised pre-training of {options.model} "
        f"({sum(p.numel() for p in model.parameters())} parameters) on "
        f"{trained_on(options, data.dataset.name)}: {n} images, {steps} steps of "
        f"{options.batch_size} (public data: no privacy cost)",
        quiet,
    )

    def loss_at(step: int) -> torch.Tensor:
        index = torch.as_tensor(order.next_batch(n, options.batch_size))
        x = _augmented(data.inputs[index], options, augment)
        return functional.cross_entropy(
            model(x), data.targets[index], label_smoothing=options.label_smoothing
        )

    model.train()
    session.train(
        optimizer,
        loss_at,
        lambda step: learning_rate_at(options, step, steps),
        steps=steps,
        checkpoint=checkpoint,
        checkpoint_every=options.checkpoint_every,
        started=start,
        quiet=quiet,
    )
    model.eval()
    test_accuracy = _accuracy(model, data.dataset, options.normalization, device)
    metadata = _metadata(options, data, steps, session.losses, test_accuracy, start)
    public_rows = public_rows_record(data.images[data.rows], data.labels[data.rows])
    save_encoder(out, model.cpu(), _encoder_info(options, data, {**metadata, **public_rows}))
    # The summary is JSON: the digests stay in the file, their sha256 is in both.
    public_rows.pop("public_row_digests")
    return {"encoder": str(out), **metadata, **public_rows}


@dataclasses.dataclass(frozen=True)
class _PublicData:
    """The public dataset of a run: its training set, the rows read (the public ones), and
    those rows as model inputs and targets on the run's device."""

    dataset: ImageDataset
    images: np.ndarray
    labels: np.ndarray
    rows: np.ndarray
    inputs: Any
    targets: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """One input's shape (channels, height, width)."""
        channels, height, width = (int(v) for v in self.inputs.shape[1:])
        return channels, height, width


def _public_data(options: SupervisedOptions, device: torch.device) -> _PublicData:
    """Loads the dataset and keeps its public rows (all of its training set when
    ``public_fraction`` is 0).

    Privacy: only the public slice's rows become inputs; which rows they are depends on
    each row alone (:func:`dpvision.data.splits.public_split`).
    """
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
    inputs = lazy_pixel_inputs(images[rows], dataset.name, options.normalization).to(device)
    targets = torch.as_tensor(labels[rows], dtype=torch.long).to(device)
    return _PublicData(dataset, images, labels, rows, inputs, targets)


def _augmented(
    x: torch.Tensor, options: SupervisedOptions, generator: torch.Generator
) -> torch.Tensor:
    """One random crop and flip of each image (none when both are off)."""
    if not (options.crop_padding or options.flip):
        return x
    return augment_views(
        x,
        1,
        generator,
        padding=options.crop_padding,
        flip=options.flip,
        mode=options.padding_mode,
    )[:, 0]


def _metadata(
    options: SupervisedOptions,
    data: _PublicData,
    steps: int,
    losses: list[dict[str, float]],
    test_accuracy: float,
    start: float,
) -> dict[str, Any]:
    """What the output file and the summary record of the run (wall time up to now)."""
    return {
        "objective": "supervised",
        "trained_on": trained_on(options, data.dataset.name),
        "dataset": data.dataset.name,
        "public_fraction": options.public_fraction,
        "n_images": len(data.rows),
        "num_classes": int(data.dataset.num_classes),
        "normalization": options.normalization,
        "private_data": False,
        "options": dataclasses.asdict(options),
        "steps": steps,
        "final_loss": losses[-1]["loss"] if losses else None,
        "test_accuracy": test_accuracy,
        "wall_seconds": time.perf_counter() - start,
    }


def _encoder_info(
    options: SupervisedOptions, data: _PublicData, metadata: dict[str, Any]
) -> EncoderInfo:
    """The encoder file's header: the model, and the input normalisation it was trained
    with (the dataset's published statistics, or none)."""
    shape = data.shape
    mean, std = (
        DATASET_STATISTICS[data.dataset.name]
        if options.normalization == "dataset"
        else ((0.0,) * shape[0], (1.0,) * shape[0])
    )
    return EncoderInfo(options.model, shape, options.groups, tuple(mean), tuple(std), metadata)


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

    * A private row with the digest of one of the file's rows is a copy of an example the
      weights were trained on, and the run leaves it out (the mask), silently: a refusal,
      a warning or a count would say whether the private data holds such a copy, and
      leaving it out makes the dataset with the copy and the dataset without it run alike.
      For weights from a *declared public slice* (``public_fraction`` > 0 in the record)
      the row is public; for weights trained on a whole training set (not declared
      public), the file itself already holds it without protection, and this run adds
      nothing to that.
    * Weights trained on a whole training set that the record names as this run's dataset
      (:func:`dpvision.models.weights.check_trained_on`) are refused by that name, from
      the record and the config alone, before any row is read.
    * A file that records no rows under this version's split — an older one, another
      tool's — is judged by the dataset it names, the same way.

    ``allow`` (the user's explicit ``override``, when the caller offers one) lets any pass
    and leaves nothing out.

    Privacy: the mask leaves out rows that are copies of the file's rows; which rows they
    are depends on each row alone, and nothing else depends on them: the refusals read the
    record and the dataset's name, never a private row (issue 48).

    Raises:
      DPVisionError: one line saying why and how to proceed.
    """
    none = np.zeros(len(private_labels), dtype=bool)
    if allow:
        return none
    recorded = _recorded_digests(record, what)
    if recorded is None or not record.get("public_fraction"):
        # By the name the record gives, never by the rows (issue 48).
        check_trained_on(record, dataset, what=what, same=same_dataset, override=override)
    if recorded is None:
        return none
    return np.isin(public_digests(private_rows, private_labels), recorded)


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
    resized: bool = False,
) -> np.ndarray:
    """The rows of a private run's dataset to leave out as public because a weight file
    was trained on copies of them: :func:`check_private_rows` on the rows outside the run's
    own public slice (``public_fraction``), as dataset row indices.

    ``resized``: the run brought the images to an ``image_size`` and ``images`` are not the
    rows at their own size (an image folder resized as each file is decoded; arrays keep
    them, :attr:`dpvision.data.core.ImageDataset.row_images`). Rows are matched by the
    digests of their pixels as pre-training read them (their own size), so a file that
    records digests is refused then: resized rows would match none of them, and the rows
    the weights were trained on would count as private ones unnoticed.

    Privacy: as :func:`check_private_rows`.
    """
    if resized and not allow and _recorded_digests(record, what) is not None:
        raise DPVisionError(
            f"{what} records the rows it was trained on, matched to this run's rows by "
            "their pixels at their own size, and this run resizes each image as it is decoded "
            "(image_size): convert the folder to an npz of one size first"
            + (f" (or set {override} if you accept it)" if override else "")
        )
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
