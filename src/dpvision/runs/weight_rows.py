"""The rows a run leaves out because weight files were trained on copies of them: its own
weights (``learner.init``, a ``backbone:``/``encoder:`` feature source) and the files of
``leave_out_rows_of`` (what ``dpvision tune`` gives every candidate: the weight files of all
of them, so that every candidate trains and validates on the same rows).

Privacy: which rows are left out is decided for each row alone, by its digest against the
digests a file records (:func:`dpvision.training.supervised.rows_trained_on`), silently:
nothing is refused, warned or logged because of what the rows hold (a file is refused only
by its record's dataset name, before any row is read). A search whose candidates left out
different rows would train them on different data and score them on different validation
sets: the union closes that.
"""

from functools import reduce

import numpy as np

from dpvision.config import TrainConfig
from dpvision.config.schema import DEEP_METHODS
from dpvision.data.core import ImageDataset
from dpvision.features import parse_feature_spec
from dpvision.features.backbone import feature_source
from dpvision.features.spec import NETWORK_FEATURES
from dpvision.models.weights import weights_record
from dpvision.recipes import AUTO
from dpvision.training.supervised import rows_trained_on


def weight_rows(
    config: TrainConfig,
    dataset: ImageDataset,
    own: str | None,
    *,
    what: str = "learner.init",
    allow: bool = False,
    override: str | None = None,
) -> np.ndarray | None:
    """The dataset rows (indices into its training set) to leave out as public: those that
    ``own`` and every file of ``config.leave_out_rows_of`` were trained on; ``None`` when
    there is no file. ``allow`` (``learner.init_allow_same_dataset``) lets any file pass."""
    files = list(dict.fromkeys(f for f in (own, *config.leave_out_rows_of) if f))
    if not files:
        return None
    labels = np.asarray(dataset.train_labels)
    rows = [
        rows_trained_on(
            weights_record(path),
            dataset.name,
            dataset.row_images,
            labels,
            config.public_fraction,
            what=f"{what} {path}" if path == own else f"the weights {path} (another candidate's)",
            allow=allow,
            override=override,
            resized=not dataset.row_identity_kept,
        )
        for path in files
    ]
    return reduce(np.union1d, rows)


def run_weight_rows(config: TrainConfig, dataset: ImageDataset) -> np.ndarray | None:
    """:func:`weight_rows` for ``config``'s run: its own file is ``learner.init`` for the
    deep methods (with ``learner.init_allow_same_dataset``), the ``backbone:``/``encoder:``
    weights of its features otherwise."""
    if config.method in DEEP_METHODS:
        options = config.dpsgd
        return weight_rows(
            config,
            dataset,
            options.init,
            allow=options.init_allow_same_dataset,
            override="learner.init_allow_same_dataset = true",
        )
    if config.features == AUTO:  # the recipe's features: ScatterNet or pixels, no weights
        return weight_rows(config, dataset, None)
    spec = parse_feature_spec(config.features)
    source = feature_source(spec) if spec.name in NETWORK_FEATURES else None
    return weight_rows(config, dataset, source, what=f"the {spec.name} weights")
