"""Image classification datasets for dpvision: loading, lookup on disk and verified download.

>>> from dpvision.data import load_dataset, images_to_tensor
>>> ds = load_dataset("digits")
>>> ds.train_images.shape, ds.num_classes
((1438, 8, 8, 1), 10)
>>> images_to_tensor(ds.train_images[:2]).shape
torch.Size([2, 1, 8, 8])

Names: ``digits``, ``mnist``, ``fashion-mnist``, ``cifar10``, ``cifar100``, ``dermamnist``,
``npz:PATH`` and ``imagefolder:PATH`` (:mod:`dpvision.data.datasets`). Named datasets are looked
for in ``data_dir``, ``$DPVISION_DATA/<name>``, ``~/.cache/dpvision/<name>`` and
``/usr/share/datasets/<name>``, then downloaded and checksum-verified
(:mod:`dpvision.data.sources`).

Images are kept as ``uint8`` ``(N, H, W, C)``; convert a split with :func:`images_to_float` or
:func:`images_to_tensor` when feeding a model.

The data is the private input of training. Loaders only read it into memory: they release,
log or print nothing computed from it (privacy is spent only by the mechanisms that train on it).
Importing this package does not import torch.
"""

from dpvision.data.core import ImageDataset, images_to_float, images_to_tensor
from dpvision.data.datasets import DATASETS, DatasetInfo, available_datasets, load_dataset

__all__ = [
    "DATASETS",
    "DatasetInfo",
    "ImageDataset",
    "available_datasets",
    "images_to_float",
    "images_to_tensor",
    "load_dataset",
]
