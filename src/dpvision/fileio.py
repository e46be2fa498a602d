"""Reading the files dpvision writes, without running code from them.

A checkpoint or encoder may come from someone else or sit in a shared folder. ``torch.load``
without ``weights_only`` unpickles arbitrary objects, so opening such a file would run
whatever code it names. Every torch file dpvision reads goes through :func:`load_torch`:
only tensors, the plain containers (dict, list, tuple), numbers, strings and None are
accepted, and anything else (a pickled function, class or ``os.system`` call) is an error.
"""

from pathlib import Path
from typing import Any

import torch


def load_torch(path: str | Path) -> Any:
    """The object saved at ``path`` by ``torch.save``, read with ``weights_only=True``.

    Raises:
      Whatever ``torch.load`` raises (a file that is missing, damaged, or that asks to run
      code: ``pickle.UnpicklingError``); callers turn it into a one-line error.
    """
    return torch.load(path, map_location="cpu", weights_only=True)
