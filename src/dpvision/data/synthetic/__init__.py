"""Synthetic images for DP-RandP Phase I: dead leaves, random oriented filters, spectral noise.

DP-RandP (Tang et al. 2023) learns a feature extractor on images that owe nothing to the
private data, then trains privately on top of it. The images come from the random processes
of Baradad et al. (2021), "Learning to see by looking at noise", re-implemented here:

* ``dead-leaves-squares``, ``dead-leaves-oriented``, ``dead-leaves-mixed``: occluding random
  shapes (:func:`sample_radii` draws their sizes, density ∝ r^-3), as in Baradad et al.'s
  ``generate_datasets/dead_leaves``;
* ``oriented-filters``: an untrained convolutional generator whose 3×3 filters come from a bank
  of oriented edges and lines (:func:`oriented_filter_bank`), a simplified form of their
  "StyleGAN-oriented";
* ``spectral``: colour noise with a 1/f^α amplitude spectrum (:func:`spectral_noise`).

Images are ``uint8`` ``(N, H, W, C)`` like :class:`dpvision.data.ImageDataset`. Image ``i``
of a kind depends only on ``(kind, size, channels, seed, start + i)``: it has its own
``numpy`` generator seeded by ``SeedSequence([seed, start + i, kind id, size, channels])``, so
a stream can be cut into batches any way and resumed at any index. No global random state
is read or changed.

>>> images = generate("dead-leaves-squares", 4, size=16)
>>> images.shape, images.dtype
((4, 16, 16, 3), dtype('uint8'))
>>> resumed = generate("spectral", 3, start=2, channels=1)
>>> bool((resumed[1] == generate("spectral", 4, channels=1)[3]).all())
True

Privacy: data-independent; nothing here reads private data, so the images cost no privacy.
Importing this module does not import torch (only ``oriented-filters`` uses it).
"""

from dpvision.data.synthetic.common import MAX_SIZE, MIN_SIZE
from dpvision.data.synthetic.dead_leaves import MAX_SHAPES, sample_radii
from dpvision.data.synthetic.filters import FILTER_BANK_NAMES, oriented_filter_bank
from dpvision.data.synthetic.generator import SYNTHETIC_KINDS, generate, stream
from dpvision.data.synthetic.preview import preview_grid, write_preview
from dpvision.data.synthetic.spectral import spectral_noise

__all__ = [
    "FILTER_BANK_NAMES",
    "MAX_SHAPES",
    "MAX_SIZE",
    "MIN_SIZE",
    "SYNTHETIC_KINDS",
    "generate",
    "oriented_filter_bank",
    "preview_grid",
    "sample_radii",
    "spectral_noise",
    "stream",
    "write_preview",
]
