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
from dpvision.data.synthetic import generate
from dpvision.features.progress import Progress
from dpvision.log import say
from dpvision.models.encoder import EncoderInfo, build_body, save_encoder
from dpvision.seeds import public_seeds
from dpvision.training.contrastive import align_uniform_loss, contrastive_views
from dpvision.training.pretrain_options import PretrainOptions
from dpvision.training.session import Session

PRETRAIN_CHECKPOINT_FORMAT = "dpvision-pretrain-checkpoint-v1"
# When the learning rate drops by 10 (Baradad et al.: epochs 155, 170, 185 of 200).
LR_MILESTONES = (0.775, 0.85, 0.925)


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
    return public_seeds(seed, "phase-i pretrain", ("images", "init", "order", "views"))


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
    images = _Images(options, seeds["images"], seeds["order"], quiet)
    mean, std = images.statistics()
    info = EncoderInfo(options.model, _image_shape(options), options.groups, mean, std, {})
    device = device or torch.device("cpu")
    body, projection = _networks(options, seeds["init"], device)
    optimizer = torch.optim.SGD(
        list(body.parameters()) + list(projection.parameters()),
        lr=options.learning_rate,
        momentum=options.momentum,
        weight_decay=options.weight_decay,
    )
    views = torch.Generator().manual_seed(seeds["views"])
    parts = dict(body=body, projection=projection, optimizer=optimizer, views=views, images=images)
    run = Session(PRETRAIN_CHECKPOINT_FORMAT, "Phase I", options.settings(), parts)
    run.resume_if_saved(checkpoint, quiet)
    say(
        f"Phase I: {options.model} body ({sum(p.numel() for p in body.parameters())} parameters)"
        f" on {options.synthetic} images {options.channels}×{options.size}×{options.size}, "
        f"{options.steps} steps of {options.batch_size}",
        quiet,
    )

    def loss_at(step: int) -> torch.Tensor:
        batch = images_to_tensor(images.batch(step)).to(device, non_blocking=True)
        x = info.normalize(contrastive_views(batch, views))
        y = info.normalize(contrastive_views(batch, views))
        z = projection(body(torch.cat([x, y])))
        return align_uniform_loss(z[: len(batch)], z[len(batch) :])

    body.train()
    looped = time.perf_counter()
    run.train(
        optimizer,
        loss_at,
        lambda step: learning_rate_at(options, step),
        steps=options.steps,
        checkpoint=checkpoint,
        checkpoint_every=options.checkpoint_every,
        started=start,
        quiet=quiet,
        note=" (synthetic images: no privacy cost)",
    )
    train_seconds = time.perf_counter() - looped  # the steps alone, not the image generation
    body.eval()
    metadata = _metadata(options, run.losses, time.perf_counter() - start)
    save_encoder(out, body.cpu(), dataclasses.replace(info, metadata=metadata))
    return {"encoder": str(out), **metadata, "train_seconds": train_seconds}


def _metadata(
    options: PretrainOptions, losses: list[dict[str, float]], wall: float
) -> dict[str, Any]:
    """What the encoder file and the summary record of the run."""
    return {
        "trained_on": f"synthetic:{options.synthetic}",
        "private_data": False,
        "options": dataclasses.asdict(options),
        "final_loss": losses[-1]["loss"] if losses else None,
        "losses": losses,
        "wall_seconds": wall,  # of this process (after a resume: of the resumed part)
    }


def _image_shape(options: PretrainOptions) -> tuple[int, int, int]:
    return (options.channels, options.size, options.size)


def _networks(
    options: PretrainOptions, seed: int, device: torch.device
) -> tuple[nn.Module, ProjectionHead]:
    """The body to pre-train and its projection head, initialised from ``seed``, on
    ``device``."""
    shape = _image_shape(options)
    torch.manual_seed(seed)
    body = build_body(options.model, shape, options.groups)
    with torch.no_grad():
        width = int(body.eval()(torch.zeros(1, *shape)).shape[1])
    projection = ProjectionHead(width, options.projection_hidden, options.projection_dim)
    return body.to(device), projection.to(device)
