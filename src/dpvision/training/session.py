"""The resumable state of a ``dpvision pretrain`` run, and the loop that advances it.

Both objectives of pre-training (:mod:`dpvision.training.pretrain`,
:mod:`dpvision.training.supervised`) train with SGD on public or synthetic data and keep
the same bookkeeping: a :class:`Session` holds the step, the mean losses, and the named
parts that a checkpoint must restore (networks, the optimizer, random generators, the
order of the data); :meth:`Session.train` runs the steps, reports progress, refuses a
diverged loss and writes the checkpoints (atomically). A resumed run ends with the same
weights as an uninterrupted one, because every random state is a part.

Privacy: nothing here reads data; the loss functions it calls read public or synthetic
images only, and a pre-training run records no privacy cost.
"""

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpvision.errors import DPVisionError
from dpvision.fileio import load_session, save_session
from dpvision.log import progress, say

# Steps over which a mean loss is recorded.
LOSS_WINDOW = 50
# Seconds between progress lines.
REPORT_EVERY = 30


@dataclasses.dataclass
class Session:
    r"""The state of a pre-training run that a checkpoint holds.

    Attributes:
      kind: the checkpoint's format name.
      what: how messages name the run (``"Phase I"``, ``"pre-training"``).
      settings: the options the checkpoint is tied to (a resume with others is refused).
      parts: what the checkpoint restores, by key: modules, optimizers and other objects
        with ``state_dict``/``load_state_dict``, and ``torch.Generator``\ s.
      spread: keys of parts whose state's own keys sit at the top of the checkpoint.
      step, losses: steps done; the mean loss of every ``LOSS_WINDOW`` steps.
    """

    kind: str
    what: str
    settings: dict[str, Any]
    parts: dict[str, Any]
    spread: tuple[str, ...] = ()
    step: int = 0
    losses: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def save(self, path: Path) -> None:
        """Writes the checkpoint atomically."""
        state: dict[str, Any] = {}
        for key, part in self.parts.items():
            value = part.get_state() if isinstance(part, torch.Generator) else part.state_dict()
            state.update(value if key in self.spread else {key: value})
        state.update(step=self.step, losses=list(self.losses))
        save_session(path, self.kind, self.settings, state)

    def resume(self, path: Path) -> None:
        """Restores a checkpoint; refuses one of other options (and leaves it alone)."""
        payload = load_session(path, self.kind, self.settings, self.what)
        for key, part in self.parts.items():
            value = payload if key in self.spread else payload[key]
            if isinstance(part, torch.Generator):
                part.set_state(value)  # type: ignore[arg-type]  # a generator's part is a tensor
            else:
                part.load_state_dict(value)
        self.step = int(payload["step"])
        self.losses = list(payload["losses"])

    def resume_if_saved(self, checkpoint: str | Path | None, quiet: bool) -> None:
        """Resumes from ``checkpoint`` when it exists, and says so."""
        if checkpoint is not None and Path(checkpoint).exists():
            self.resume(Path(checkpoint))
            say(f"resumed {self.what} from {checkpoint} at step {self.step}", quiet)

    def train(
        self,
        optimizer: torch.optim.Optimizer,
        loss_at: Callable[[int], torch.Tensor],
        learning_rate_at: Callable[[int], float],
        *,
        steps: int,
        checkpoint: str | Path | None,
        checkpoint_every: int,
        started: float,
        quiet: bool,
        note: str = "",
    ) -> None:
        """Runs the steps from :attr:`step` to ``steps``: the learning rate of the step,
        ``loss_at(step)``, one SGD update; a mean loss every ``LOSS_WINDOW`` steps and at
        the end, a progress line every ``REPORT_EVERY`` seconds (since ``started``, ending
        with ``note``), a checkpoint every ``checkpoint_every`` steps and at the end.

        Raises:
          DPVisionError: the loss is not finite (lower the learning rate).

        Privacy: runs on whatever ``loss_at`` reads — public or synthetic images in
        pre-training; nothing is released here.
        """
        last_report, window = time.perf_counter(), []
        while self.step < steps:
            step = self.step
            for group in optimizer.param_groups:
                group["lr"] = learning_rate_at(step)
            loss = loss_at(step)
            if not torch.isfinite(loss):
                raise DPVisionError(
                    f"{self.what} diverged at step {step} (loss {float(loss)}); lower "
                    "pretrain.learning_rate"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            self.step = step + 1
            window.append(float(loss.detach()))
            if self.step % LOSS_WINDOW == 0 or self.step == steps:
                self.losses.append({"step": self.step, "loss": float(np.mean(window))})
                window = []
            if time.perf_counter() - last_report > REPORT_EVERY and self.losses:
                say(
                    f"{self.what} {progress(self.step, steps, time.perf_counter() - started)}: "
                    f"loss {self.losses[-1]['loss']:.4f}{note}",
                    quiet,
                )
                last_report = time.perf_counter()
            if (
                checkpoint is not None
                and checkpoint_every
                and (self.step % checkpoint_every == 0 or self.step == steps)
            ):
                self.save(Path(checkpoint))


class EpochOrder:
    """The order of a fixed set of rows: a fresh permutation per epoch, served ``size``
    rows at a time (sorted; the last partial batch of an epoch is dropped).

    Its checkpoint state is the generator's (as JSON), the permutation and the position.
    """

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.permutation = np.zeros(0, np.int64)
        self.position = 0

    def next_batch(self, n: int, size: int) -> np.ndarray:
        """The next ``size`` of ``n`` rows."""
        if self.position + size > len(self.permutation):
            self.permutation = self.rng.permutation(n)
            self.position = 0
        rows = self.permutation[self.position : self.position + size]
        self.position += size
        return np.sort(rows)

    def state_dict(self) -> dict[str, Any]:
        return {
            "order": json.dumps(self.rng.bit_generator.state),
            # A tensor, not a NumPy array: checkpoints are read without unpickling objects.
            "permutation": torch.from_numpy(self.permutation.copy()),
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = json.loads(state["order"])
        self.permutation = state["permutation"].numpy()
        self.position = int(state["position"])
