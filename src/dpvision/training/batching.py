"""A logical batch of DP-SGD as physical micro-batches, each example with its K views.

Privacy: cutting a logical batch into physical chunks is a memory knob; the clipped sums of
the chunks are added before the one noise draw (:mod:`dpvision.training.engine`).
"""

from collections.abc import Iterator

import numpy as np
import torch

from dpvision.data.augment import apply_views, draw_views, keyed_views
from dpvision.data.inputs import TrainingData
from dpvision.distributed import Workers
from dpvision.training.options import DPSGDOptions


def micro_batches(
    data: TrainingData,
    indices: np.ndarray,
    options: DPSGDOptions,
    generator: torch.Generator,
    workers: Workers | None = None,
    step: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the logical batch ``indices`` in physical chunks, with K views
    each when augmult ≥ 1.

    The views' random choices are drawn for the whole logical batch first (on every rank
    alike), so an example gets the same views whatever the physical batch size and the
    number of processes. With ``step`` and the data's per-row keys (``train_keys``), each
    example's views come from (the generator's seed, ``step``, its key) alone
    (:func:`~dpvision.data.augment.keyed_views`): another example added to the dataset or
    the batch changes no example's views, so the clipped sum keeps its sensitivity for the
    public augmentation seed.
    """
    workers = workers or Workers()
    draws = None
    if options.augmult and step is not None and data.train_keys is not None:
        draws = keyed_views(
            data.train_keys[indices],
            generator.initial_seed(),
            step,
            options.augmult,
            padding=options.crop_padding,
            flip=options.flip,
        )
    elif options.augmult:
        draws = draw_views(
            len(indices),
            options.augmult,
            generator,
            padding=options.crop_padding,
            flip=options.flip,
        )
    start, stop = workers.row_range(len(indices))
    for first in range(start, stop, options.performance.physical_batch_size):
        last = min(first + options.performance.physical_batch_size, stop)
        chunk = torch.as_tensor(indices[first:last], dtype=torch.long)
        inputs = data.train_x[chunk]
        if draws is not None:
            inputs = apply_views(
                inputs,
                draws[first:last],
                padding=options.crop_padding,
                mode=options.padding_mode,
            )
        yield inputs, data.train_y[chunk]
