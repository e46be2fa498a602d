"""Run configuration: one frozen dataclass, filled from TOML, flags and ``--set`` overrides.

A TOML file looks like::

    dataset = "fashion-mnist"
    method = "dp-sgd-linear"
    features = "scatternet"
    epsilon = 3.0
    delta = 1e-5
    seed = 0

    [preprocessing]
    kind = "group-norm"        # none | group-norm | private-norm | center
    groups = 27

    [learner]                  # keyword arguments of the learner's estimator
    clip_norm = 0.1
    batch_size = 8192
    epochs = 40
    learning_rate = 16.0

A config that reproduces a published result also carries a ``[reference]`` table: where the
number comes from, the published accuracy and its ε, the band a faithful rerun should land
in, and what the run needs that may be missing (data, hardware)::

    [reference]
    source = "Tramèr & Boneh 2021, Table 1"
    accuracy = 0.897           # the published test accuracy, as a fraction
    epsilon = 3.0              # the ε it was published at
    band = [0.875, 0.915]      # our runs at that ε are flagged outside this band
    needs = "Fashion-MNIST"    # said when the run cannot start
    points = [[2.7, 0.895]]    # more published (ε, accuracy) of the same setup, plotted

It changes nothing in the run; ``dpvision report`` reads it from the result JSONs.

``--set key=value`` overrides any field, dotted for tables (``--set learner.epochs=20``,
``--set preprocessing.kind=none``); values are parsed as TOML (``--set epsilon=inf``).
Unknown keys, wrong types and out-of-range values are one-line errors naming the field.

The package: :mod:`~dpvision.config.schema` (the dataclass and its fields' ranges),
:mod:`~dpvision.config.loading` (TOML, flags and ``--set``) and
:mod:`~dpvision.config.validation` (the checks across fields, the learner's options,
``[reference]``).
"""

from dpvision.config.loading import load_toml, override, parse_override, resolve
from dpvision.config.schema import DEEP_METHODS, METHODS, TrainConfig
from dpvision.config.validation import REFERENCE_KEYS, check_reference, validate
from dpvision.features.preprocessing import PREPROCESSING, PreprocessingConfig

__all__ = [
    "DEEP_METHODS",
    "METHODS",
    "PREPROCESSING",
    "REFERENCE_KEYS",
    "PreprocessingConfig",
    "TrainConfig",
    "check_reference",
    "load_toml",
    "override",
    "parse_override",
    "resolve",
    "validate",
]
