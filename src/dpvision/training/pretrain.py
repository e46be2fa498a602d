"""DP-RandP Phase I: contrastive pre-training of an encoder on synthetic images.

Tang et al. (2023) pre-train the body of the network they later train privately on images
from random processes, with the alignment + uniformity loss of Wang & Isola (2020), as in
the ``align_uniform`` code of Baradad et al. (2021): two random views of every image
(:func:`dpvision.training.contrastive.contrastive_views`), the body's embedding, a
projection MLP (Linear → GroupNorm → ReLU → Linear → GroupNorm → ReLU → Linear →
L2-normalise; dropped afterwards), SGD with momentum 0.9, weight decay 1e-4, learning rate
0.12·B/256 divided by 10 at 77.5 %, 85 % and 92.5 % of the steps (155/170/185 of 200
epochs in the paper).

The images come from :mod:`dpvision.data.synthetic`: ``num_images`` of them are generated
once (the paper's 105 000) and reshuffled every epoch, or, with ``num_images = 0``, every
step draws fresh ones. Their per-channel mean and standard deviation are computed from the
images themselves — public statistics of public data — and stored in the encoder file, so
that private images are later normalised with the same constants.

Checkpoints (written atomically) hold the model, the projection, the optimizer, the step,
and the random states; a resumed run ends with the same encoder as an uninterrupted one.

Privacy: Phase I reads no private data at all, so it costs no privacy budget; the encoder it
writes is public.
"""

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dpvision.data.core import images_to_tensor
from dpvision.data.synthetic import SYNTHETIC_KINDS, generate
from dpvision.errors import DPVisionError
from dpvision.features.progress import Progress
from dpvision.fileio import load_session, save_session, settings_fingerprint
from dpvision.log import progress, say
from dpvision.models.encoder import EncoderInfo, build_body, save_encoder
from dpvision.models.registry import parse_model
from dpvision.training.contrastive import align_uniform_loss, contrastive_views

PRETRAIN_CHECKPOINT_FORMAT = "dpvision-pretrain-checkpoint-v1"
# When the learning rate drops by 10 (Baradad et al.: epochs 155, 170, 185 of 200).
LR_MILESTONES = (0.775, 0.85, 0.925)


@dataclasses.dataclass(frozen=True)
class PretrainOptions:
    """Hyper-parameters of Phase I (the ``[pretrain]`` table, or ``dpvision pretrain`` flags).

    Attributes:
      model: the model whose body is pre-trained (``DPSGDOptions.model`` names).
      groups: GroupNorm groups of the model (WRNs).
      synthetic: the generator (:data:`dpvision.data.synthetic.SYNTHETIC_KINDS`).
      size, channels: the images' side and channels (those of the private data).
      num_images: images generated once and reused each epoch (0: fresh images every step).
      batch_size: images per step (two views each).
      steps: optimisation steps.
      learning_rate: SGD learning rate (0.12·B/256 in the paper), ÷10 at the milestones.
      momentum, weight_decay: SGD's.
      projection_hidden, projection_dim: widths of the projection MLP.
      seed: seeds the generator stream, the initialisation and the views.
      checkpoint_every: steps between checkpoints (with a checkpoint path).
    """

    model: str = "tanh-cnn"
    groups: int = 16
    synthetic: str = "dead-leaves-mixed"
    size: int = 28
    channels: int = 1
    num_images: int = 100_000
    batch_size: int = 256
    steps: int = 2000
    learning_rate: float = 0.12
    momentum: float = 0.9
    weight_decay: float = 1e-4
    projection_hidden: int = 512
    projection_dim: int = 128
    seed: int = 0
    checkpoint_every: int = 500

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "PretrainOptions":
        """Builds and validates the options; unknown keys and bad values are one-line errors."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in fields:
                raise DPVisionError(
                    f"unknown pretrain option {key!r}; valid: {', '.join(sorted(fields))}"
                )
            kind = fields[key].type
            name = kind.__name__ if isinstance(kind, type) else str(kind)
            if isinstance(value, bool) or (name == "int" and not isinstance(value, int)):
                raise DPVisionError(f"pretrain.{key} must be a whole number, got {value!r}")
            if name == "float":
                if not isinstance(value, int | float):
                    raise DPVisionError(f"pretrain.{key} must be a number, got {value!r}")
                value = float(value)
            if name == "str" and not isinstance(value, str):
                raise DPVisionError(f"pretrain.{key} must be a string, got {value!r}")
            values[key] = value
        return cls(**values).validated()

    def validated(self) -> "PretrainOptions":
        parse_model(self.model)
        if self.synthetic not in SYNTHETIC_KINDS:
            raise DPVisionError(
                f"unknown synthetic generator {self.synthetic!r}; choose one of "
                f"{', '.join(SYNTHETIC_KINDS)}"
            )
        if self.channels not in (1, 3):
            raise DPVisionError(f"pretrain.channels must be 1 or 3, got {self.channels}")
        for name in ("size", "batch_size", "steps", "projection_hidden", "projection_dim"):
            if getattr(self, name) < 1:
                raise DPVisionError(f"pretrain.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size < 2:
            raise DPVisionError("pretrain.batch_size must be >= 2 (the loss compares images)")
        if not 0 <= self.seed < 2**63:
            raise DPVisionError(
                f"pretrain.seed must be a whole number in [0, 2**63), got {self.seed}"
            )
        for name in ("num_images", "momentum", "weight_decay", "checkpoint_every", "groups"):
            if getattr(self, name) < 0:
                raise DPVisionError(f"pretrain.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_images and self.num_images < self.batch_size:
            raise DPVisionError(
                f"pretrain.num_images ({self.num_images}) must be >= batch_size "
                f"({self.batch_size}), or 0 for fresh images every step"
            )
        if not self.learning_rate > 0:
            raise DPVisionError(f"pretrain.learning_rate must be > 0, got {self.learning_rate}")
        return self

    def settings(self) -> dict[str, Any]:
        """Every option that changes the encoder (all but ``checkpoint_every``)."""
        data = dataclasses.asdict(self)
        data.pop("checkpoint_every")
        return data

    def fingerprint(self) -> str:
        """A hash of :meth:`settings`."""
        return settings_fingerprint(self.settings())


class ProjectionHead(nn.Module):
    """Linear → GroupNorm → ReLU → Linear → GroupNorm → ReLU → Linear → L2-normalise
    (the ``block4``–``block6`` of Baradad et al.'s encoder, used in Phase I only)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, groups: int = 16) -> None:
        super().__init__()
        groups = math.gcd(groups, hidden) or 1
        self.layers = nn.Sequential(
            nn.Linear(in_dim, hidden, bias=False),
            nn.GroupNorm(groups, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.GroupNorm(groups, hidden),
            nn.ReLU(),
            nn.Linear(hidden, out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.layers(x), dim=1)


def learning_rate_at(options: PretrainOptions, step: int) -> float:
    """The step schedule: ÷10 at each milestone fraction of ``options.steps``."""
    drops = sum(step >= math.ceil(m * options.steps) for m in LR_MILESTONES)
    return options.learning_rate * 0.1**drops


def _seeds(seed: int) -> dict[str, int]:
    names = ("images", "init", "order", "views")
    states = np.random.SeedSequence([seed, 2]).generate_state(len(names), dtype=np.uint64)
    return {name: int(value) % 2**63 for name, value in zip(names, states, strict=True)}


class _Images:
    """The synthetic images of Phase I: a fixed set reshuffled per epoch, or a fresh stream."""

    def __init__(self, options: PretrainOptions, seed: int, order_seed: int, quiet: bool) -> None:
        self.options, self.seed = options, seed
        self.order = np.random.default_rng(order_seed)
        self.stored: np.ndarray | None = None
        self.permutation = np.zeros(0, dtype=np.int64)
        self.position = 0
        if options.num_images:
            shape = (options.num_images, options.size, options.size, options.channels)
            self.stored = np.empty(shape, dtype=np.uint8)
            chunk = 1000
            with Progress(
                options.num_images, f"generating {options.synthetic}", enabled=not quiet
            ) as bar:
                for start in range(0, options.num_images, chunk):
                    count = min(chunk, options.num_images - start)
                    self.stored[start : start + count] = generate(
                        options.synthetic,
                        count,
                        size=options.size,
                        channels=options.channels,
                        seed=seed,
                        start=start,
                    )
                    bar.update(count)

    def statistics(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-channel mean and std of (up to 10 000 of) the synthetic images, in [0, 1]."""

        o = self.options
        sample = (
            self.stored[:10_000]
            if self.stored is not None
            else generate(o.synthetic, 4096, size=o.size, channels=o.channels, seed=self.seed)
        )
        values = sample.reshape(-1, o.channels).astype(np.float64) / 255.0
        std = np.maximum(values.std(axis=0), 1e-3)
        return tuple(float(v) for v in values.mean(axis=0)), tuple(float(v) for v in std)

    def batch(self, step: int) -> np.ndarray:
        o = self.options
        if self.stored is None:
            return generate(
                o.synthetic,
                o.batch_size,
                size=o.size,
                channels=o.channels,
                seed=self.seed,
                start=step * o.batch_size,
            )
        if self.position + o.batch_size > len(self.permutation):
            self.permutation = self.order.permutation(len(self.stored))
            self.position = 0
        index = self.permutation[self.position : self.position + o.batch_size]
        self.position += o.batch_size
        return self.stored[np.sort(index)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "order": self.order.bit_generator.state,
            # A tensor, not a NumPy array: checkpoints are read without unpickling objects.
            "permutation": torch.from_numpy(self.permutation.copy()),
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.bit_generator.state = state["order"]
        permutation = state["permutation"]
        if isinstance(permutation, torch.Tensor):
            permutation = permutation.numpy()
        self.permutation = np.asarray(permutation, dtype=np.int64)
        self.position = int(state["position"])


def pretrain(
    options: PretrainOptions,
    out: str | Path,
    *,
    checkpoint: str | Path | None = None,
    quiet: bool = False,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Runs Phase I and writes the encoder file ``out``; returns a summary dict.

    Args:
      options: validated :class:`PretrainOptions`.
      out: the encoder file to write (atomically).
      checkpoint: resumed from when it exists; written every ``checkpoint_every`` steps.
      quiet: no progress on stderr.
      device: where the networks train (default: the CPU). The views' random draws come
        from a CPU generator whatever the device, so a checkpoint resumes on any device.

    Privacy: reads synthetic images only; releases nothing about any private data.
    """

    start = time.perf_counter()
    seeds = _seeds(options.seed)
    shape = (options.channels, options.size, options.size)
    images = _Images(options, seeds["images"], seeds["order"], quiet)
    mean, std = images.statistics()
    torch.manual_seed(seeds["init"])
    body = build_body(options.model, shape, options.groups)
    with torch.no_grad():
        width = int(body.eval()(torch.zeros(1, *shape)).shape[1])
    projection = ProjectionHead(width, options.projection_hidden, options.projection_dim)
    device = device or torch.device("cpu")
    body, projection = body.to(device), projection.to(device)
    params = list(body.parameters()) + list(projection.parameters())
    optimizer = torch.optim.SGD(
        params,
        lr=options.learning_rate,
        momentum=options.momentum,
        weight_decay=options.weight_decay,
    )
    views = torch.Generator().manual_seed(seeds["views"])
    info = EncoderInfo(options.model, shape, options.groups, mean, std, {})
    run = _Session(options.settings(), body, projection, optimizer, views, images)
    if checkpoint is not None and Path(checkpoint).exists():
        run.resume(Path(checkpoint))
        say(f"resumed Phase I from {checkpoint} at step {run.step}", quiet)
    say(
        f"Phase I: {options.model} body ({sum(p.numel() for p in body.parameters())} parameters)"
        f" on {options.synthetic} images {options.channels}×{options.size}×{options.size}, "
        f"{options.steps} steps of {options.batch_size}",
        quiet,
    )
    body.train()
    last_report = time.perf_counter()
    window: list[float] = []
    while run.step < options.steps:
        step = run.step
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(options, step)
        batch = images_to_tensor(images.batch(step)).to(device, non_blocking=True)
        x = info.normalize(contrastive_views(batch, views))
        y = info.normalize(contrastive_views(batch, views))
        z = projection(body(torch.cat([x, y])))
        loss = align_uniform_loss(z[: len(batch)], z[len(batch) :])
        if not torch.isfinite(loss):
            raise DPVisionError(
                f"Phase I diverged at step {step} (loss {float(loss)}); lower "
                "pretrain.learning_rate"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        run.step = step + 1
        window.append(float(loss.detach()))
        if run.step % 50 == 0 or run.step == options.steps:  # mean loss of the last steps
            run.losses.append({"step": run.step, "loss": float(np.mean(window))})
            window = []
        if time.perf_counter() - last_report > 30 and run.losses:
            say(
                f"Phase I {progress(run.step, options.steps, time.perf_counter() - start)}: "
                f"loss {run.losses[-1]['loss']:.4f} (synthetic images: no privacy cost)",
                quiet,
            )
            last_report = time.perf_counter()
        if (
            checkpoint is not None
            and options.checkpoint_every
            and (run.step % options.checkpoint_every == 0 or run.step == options.steps)
        ):
            run.save(Path(checkpoint))
    body.eval()
    wall = time.perf_counter() - start
    metadata = {
        "trained_on": f"synthetic:{options.synthetic}",
        "private_data": False,
        "options": dataclasses.asdict(options),
        "final_loss": run.losses[-1]["loss"] if run.losses else None,
        "losses": run.losses,
        "wall_seconds": wall,  # of this process (after a resume: of the resumed part)
    }
    info = dataclasses.replace(info, metadata=metadata)
    save_encoder(out, body.cpu(), info)
    return {"encoder": str(out), **metadata}


@dataclasses.dataclass
class _Session:
    """The state of a Phase I run that a checkpoint holds."""

    settings: dict[str, Any]  # PretrainOptions.settings()
    body: nn.Module
    projection: nn.Module
    optimizer: torch.optim.Optimizer
    views: torch.Generator
    images: _Images
    step: int = 0
    losses: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def save(self, path: Path) -> None:
        """Writes the checkpoint atomically."""
        state = {
            "body": self.body.state_dict(),
            "projection": self.projection.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "views": self.views.get_state(),
            "images": self.images.state_dict(),
            "step": self.step,
            "losses": list(self.losses),
        }
        save_session(path, PRETRAIN_CHECKPOINT_FORMAT, self.settings, state)

    def resume(self, path: Path) -> None:
        """Restores a checkpoint; refuses one of other options (and leaves it alone)."""
        payload = load_session(path, PRETRAIN_CHECKPOINT_FORMAT, self.settings, "Phase I")
        self.body.load_state_dict(payload["body"])
        self.projection.load_state_dict(payload["projection"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.views.set_state(payload["views"])
        self.images.load_state_dict(payload["images"])
        self.step = int(payload["step"])
        self.losses = list(payload["losses"])
