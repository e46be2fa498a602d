"""Data-independent image features: raw pixels, ScatterNet and the embeddings of a
pre-trained encoder, with an on-disk cache.

>>> import numpy as np
>>> from dpvision.features import extract_features, parse_feature_spec
>>> images = np.random.default_rng(0).integers(0, 256, (4, 28, 28, 1), dtype=np.uint8)
>>> extract_features(images, parse_feature_spec("scatternet"), progress=False).shape
(4, 3969)
>>> extract_features(images, parse_feature_spec("pixels:pool=2"), progress=False).shape
(4, 196)

A :class:`FeatureSpec` (text form ``name:key=value,...``, :func:`parse_feature_spec`) names an
extractor (``pixels``, ``scatternet`` or ``encoder``, the embeddings of a pre-trained encoder
file: :mod:`dpvision.features.backbone`) and the reductions after it: spatial average
pooling, flattening and a seeded Gaussian random projection. :func:`extract_features` runs it
in batches; :func:`load_or_extract` returns a dataset's train and test features from the
feature cache (``$DPVISION_CACHE``, else ``~/.cache/dpvision/features``), extracting them on
a miss.

Privacy: every extractor and reduction here is a fixed per-example function that uses no
statistic of the data, so extraction costs no privacy budget (for ``encoder`` features, as
long as the encoder was trained without the private data, e.g. on synthetic images).
Data-dependent steps (feature clipping, private normalisation) live elsewhere and are
accounted there.

Importing this package does not import torch or kymatio; extraction does.
"""

from dpvision.features.backbone import block_names, encoder_digest
from dpvision.features.cache import (
    ENV_CACHE,
    cache_key,
    dataset_fingerprint,
    default_cache_dir,
    load_or_extract,
)
from dpvision.features.extractors import (
    FEATURE_VERSION,
    encoder_features,
    extract_features,
    extract_into,
    feature_shape,
)
from dpvision.features.progress import Progress
from dpvision.features.reductions import average_pool, projection_matrix
from dpvision.features.scatternet import IMAGENET_MEAN, IMAGENET_STD, scatter, scattering_channels
from dpvision.features.spec import (
    FEATURE_NAMES,
    FeatureSpec,
    format_feature_spec,
    parse_feature_spec,
)

__all__ = [
    "ENV_CACHE",
    "FEATURE_NAMES",
    "FEATURE_VERSION",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "FeatureSpec",
    "Progress",
    "average_pool",
    "block_names",
    "cache_key",
    "dataset_fingerprint",
    "default_cache_dir",
    "encoder_digest",
    "encoder_features",
    "extract_features",
    "extract_into",
    "feature_shape",
    "format_feature_spec",
    "load_or_extract",
    "parse_feature_spec",
    "projection_matrix",
    "scatter",
    "scattering_channels",
]
