"""Scale-out on ``torch.distributed``: many processes, one logical computation.

dpvision runs unchanged under ``torchrun``: every process (rank) loads the same data, holds
the same parameters and the same identically seeded generators, and works on its share of
each computation; the shares' exact sums are all-reduced, and **the noise is drawn once**,
after the reduction, from the generator every rank holds in the same state (De et al.
2022, App. A.1, Algorithm 1: "the same pseudo-random number generator key" on every
device). Every rank therefore adds the same noise to the same sum and takes the same
step, so

* the released value is Σ over *all* examples + N(0, (σΔ)²): the mechanism of the
  single-process run, whatever the number of processes (never one draw per worker, which
  would multiply the noise variance by the number of workers, or leave the ranks
  disagreeing);
* the model and the ledger are those of one process with the same seed, up to the order of
  floating-point additions.

Poisson sampling is global: the sampler, seeded identically everywhere, decides every
example's inclusion once, and the batch is then cut into one contiguous share per rank.
Only rank 0 writes files (checkpoints, results); collective errors are raised on every
rank, so a failure never leaves the others waiting.

Without ``torchrun`` (or with one process) :func:`current` returns the single-process
:class:`Workers`, whose reductions are no-ops.
"""

import datetime
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from dpvision.errors import DPVisionError

T = TypeVar("T")

#: How long a collective waits for the other ranks before giving up.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class Workers:
    """This process's place among the processes of a run: its rank and their number.

    >>> workers = Workers(rank=1, world_size=2)
    >>> workers.split(np.arange(5)).tolist()
    [2, 3, 4]
    >>> workers.row_range(10)
    (5, 10)
    """

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the one process that writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def row_range(self, num_rows: int) -> tuple[int, int]:
        """[start, stop) of this rank's contiguous share of ``num_rows`` rows."""
        return (
            num_rows * self.rank // self.world_size,
            num_rows * (self.rank + 1) // self.world_size,
        )

    def split(self, items: np.ndarray) -> np.ndarray:
        """This rank's contiguous share of ``items`` (e.g. the indices of a logical batch)."""
        start, stop = self.row_range(len(items))
        return items[start:stop]

    def all_reduce_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replaces each tensor by its sum over all ranks, in place (one collective per dtype).

        Privacy: moves exact (not yet noisy) partial sums between the processes of one run;
        it releases nothing outside the run.
        """
        if not self.distributed or not tensors:
            return
        if len(tensors) == 1 and tensors[0].is_contiguous():
            torch.distributed.all_reduce(tensors[0])  # no staging copy
            return
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in group])
            torch.distributed.all_reduce(flat)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def sum(self, value: int) -> int:
        """An integer summed over all ranks."""
        if not self.distributed:
            return value
        total = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(total)
        return int(total.item())

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def from_main(self, make: Callable[[], T]) -> T:
        """``make()`` run on rank 0 only, its result sent to every rank.

        An error raised by ``make`` (a :class:`DPVisionError`) is raised on every rank.
        """
        if not self.distributed:
            return make()
        box: list[Any] = [None]
        if self.is_main:
            try:
                box[0] = ("ok", make())
            except DPVisionError as error:
                box[0] = ("error", str(error))
        torch.distributed.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise DPVisionError(value)
        return value  # type: ignore[no-any-return]

    def main_first(self, make: Callable[[], T]) -> T:
        """``make()`` on rank 0, then on the other ranks (e.g. to build a cache once and
        then read it everywhere). An error on rank 0 is raised on every rank."""
        if not self.distributed:
            return make()
        if self.is_main:
            try:
                value = make()
                error = None
            except DPVisionError as exc:
                error = str(exc)
            self._share_error(error)
            return value
        self._share_error(None)
        return make()

    def _share_error(self, error: str | None) -> None:
        box: list[Any] = [error]
        torch.distributed.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise DPVisionError(box[0])

    def check_agree(self, value: Any, what: str) -> None:
        """Raises on every rank unless all ranks hold an equal ``value`` (a picklable)."""
        if not self.distributed:
            return
        values: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(values, pickle.dumps(value))
        differ = [rank for rank, other in enumerate(values) if other != values[0]]
        if differ:
            raise DPVisionError(
                f"the ranks disagree on {what} (ranks {differ} differ from rank 0): every "
                "process must run the same command on the same data"
            )


def current() -> Workers:
    """The workers of the running process group, or a single process when there is none."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return Workers(torch.distributed.get_rank(), torch.distributed.get_world_size())
    return Workers()


def launched_by_torchrun() -> bool:
    """Whether the environment asks for more than one process (``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_command(processes: int, *args: str) -> list[str]:
    """The command line that runs ``args`` (a script and its arguments, or ``-m module
    ...``) as ``processes`` processes on this machine under torchrun."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        *args,
    ]


def init_from_env(timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> Workers:
    """Joins the process group that ``torchrun`` describes in the environment.

    ``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; with
    ``WORLD_SIZE`` unset or 1 nothing is initialised. The backend is gloo for CPU tensors,
    and NCCL for CUDA tensors when CUDA is available (torch's ``cpu:gloo,cuda:nccl``);
    ``DPVISION_DIST_BACKEND`` overrides it. With CUDA, each process takes the GPU of its
    ``LOCAL_RANK`` as its current device (one process per GPU).
    """
    if not launched_by_torchrun() or torch.distributed.is_initialized():
        return current()
    if not torch.distributed.is_available():
        raise DPVisionError("this torch build has no torch.distributed; run one process")
    backend = os.environ.get("DPVISION_DIST_BACKEND") or (
        "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    )
    if torch.cuda.is_available():
        # One GPU per process: ``--device auto`` and ``cuda`` then mean the rank's own GPU.
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
    try:
        torch.distributed.init_process_group(backend=backend, timeout=timeout)
    except (RuntimeError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DPVisionError(
            f"cannot join the process group ({first}); launch with torchrun, which sets "
            "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        ) from None
    return current()


def shutdown() -> None:
    """Leaves the process group, if one was joined, once every rank has got here (no rank
    tears its group down while a peer may still be sending). ``python -m dpvision`` then
    ends a torchrun process with ``os._exit`` (see :mod:`dpvision.__main__`)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
