"""What a DP-SGD run trains on: the training rows of a secret split, as normalised images or
ScatterNet feature maps (N, C, H, W), with the validation rows held out and the test set
(:func:`load_inputs`).

Privacy: the split is a keyed hash of each example under the run's secret split key; pixel
inputs are a per-example transform of public statistics (no release); feature maps may be
preprocessed privately (``private-norm``), whose releases go into the data's ledger.
"""

import dataclasses
from typing import Any

import numpy as np
import torch

from dpvision.accounting import PrivacyLedger
from dpvision.config import TrainConfig
from dpvision.data.core import ImageDataset
from dpvision.data.inputs import LazyInputs, TrainingData, lazy_pixel_inputs
from dpvision.data.rows import Rows
from dpvision.data.splits import public_digests, training_rows
from dpvision.distributed import current
from dpvision.errors import DPVisionError
from dpvision.features import FeatureSpec, feature_shape, load_or_extract, parse_feature_spec
from dpvision.features.preprocessing import FittedPreprocessing, preprocess
from dpvision.log import say
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.runs.network import pixel_statistics
from dpvision.runs.weight_rows import run_weight_rows
from dpvision.training.options import DPSGDOptions


def load_inputs(
    config: TrainConfig, options: DPSGDOptions, secret: SecretRandomness, quiet: bool
) -> tuple[TrainingData, FittedPreprocessing | None]:
    """Images (normalised) or ScatterNet feature maps, as float tensors (N, C, H, W), with
    the validation split of ``config.validation_fraction`` held out of the training rows
    (each example's side its own keyed hash under ``secret``'s split key).

    Privacy: nothing is released but what private preprocessing records in the returned
    data's ledger; rows that ``learner.init``'s weights were trained on are left out as
    public (refused unless ``learner.init_allow_same_dataset``).
    """
    say(f"loading dataset {config.dataset}", quiet)
    split = _Split.of(config, options, config.load_dataset(), secret)
    spec = parse_feature_spec(config.features)
    if config.features == "pixels":
        return _pixel_inputs(config, options, split), None
    return _feature_inputs(config, options, split, spec, secret, quiet)


@dataclasses.dataclass(frozen=True)
class _Split:
    """The dataset, its training ``rows`` and ``held`` validation rows, and the ledger of
    the run's preprocessing; :meth:`data` wraps inputs made from them."""

    dataset: ImageDataset
    labels: np.ndarray
    rows: np.ndarray
    held: np.ndarray
    ledger: PrivacyLedger
    keyed: bool  # each training row's digest keys its augmentations (augmult)

    @classmethod
    def of(
        cls,
        config: TrainConfig,
        options: DPSGDOptions,
        dataset: ImageDataset,
        secret: SecretRandomness,
    ) -> "_Split":
        """The rows of ``dataset`` this run trains and validates on.

        Privacy: each example's side is its own keyed hash under ``secret``'s split key; the
        public slice and the copies of ``learner.init``'s public rows are left out.
        """
        ledger = PrivacyLedger()
        labels = np.asarray(dataset.train_labels)
        # copies of the weights' public rows are public too
        also_public = run_weight_rows(config, dataset)
        # A replayable run on other rows draws other noise; the split keys stay the same.
        secret.bind_rows(lambda: (dataset.row_images, labels))
        split = training_rows(
            dataset.row_images,
            labels,
            public_fraction=config.public_fraction,
            validation_fraction=config.validation_fraction,
            key=secret.split_key(),
            also_public=also_public,
        )
        return cls(dataset, labels, split.train, split.validation, ledger, bool(options.augmult))

    @property
    def subset(self) -> bool:
        """Whether some training images are left out (public or validation rows)."""
        return len(self.rows) < len(self.labels)

    def data(self, train: Any, test: Any, validation: Any) -> TrainingData:
        """The run's :class:`TrainingData` with these inputs and the split's labels."""
        dataset, labels, rows, held = self.dataset, self.labels, self.rows, self.held
        return TrainingData(
            dataset.name,
            train,
            torch.as_tensor(labels[rows], dtype=torch.long),
            test,
            torch.as_tensor(np.asarray(dataset.test_labels), dtype=torch.long),
            dataset.num_classes,
            self.ledger,
            validation_x=validation if len(held) else None,
            validation_y=torch.as_tensor(labels[held], dtype=torch.long) if len(held) else None,
            image_shape=tuple(int(v) for v in dataset.train_images.shape[1:]),
            class_names=dataset.class_names,
            # Each row's own digest keys its augmentations (neighbour-stable views).
            train_keys=public_digests(dataset.train_images, labels)[rows] if self.keyed else None,
        )


def _pixel_inputs(config: TrainConfig, options: DPSGDOptions, split: _Split) -> TrainingData:
    """The split's images, normalised a batch at a time (``learner.normalization``:
    :func:`dpvision.runs.network.pixel_statistics`).

    Privacy: a per-example transform with public constants; nothing is released.
    """
    if config.preprocessing.kind != "none":
        raise DPVisionError(
            "dp-sgd on pixels takes no feature preprocessing; set preprocessing.kind = "
            "'none' (use learner.normalization for per-dataset pixel normalisation)"
        )
    # Converted a batch at a time: the images may be larger than memory (npy:DIR); a
    # validation split copies the training images it keeps into memory.
    dataset, rows, held = split.dataset, split.rows, split.held
    images = dataset.train_images

    statistics = pixel_statistics(options, dataset.name, dataset.image_shape[2])

    def lazy(pixels: np.ndarray) -> LazyInputs:
        return lazy_pixel_inputs(pixels, dataset.name, statistics)

    return split.data(
        lazy(images[rows] if split.subset else images),
        lazy(dataset.test_images),
        lazy(images[held]) if len(held) else None,
    )


def _feature_inputs(
    config: TrainConfig,
    options: DPSGDOptions,
    split: _Split,
    spec: FeatureSpec,
    secret: SecretRandomness,
    quiet: bool,
) -> tuple[TrainingData, FittedPreprocessing | None]:
    """The split's ScatterNet feature maps, extracted (or read from the cache) and
    preprocessed as ``config.preprocessing`` says.

    Privacy: the preprocessing is fitted on the training rows only (the held-out rows are
    only transformed); its releases, if any, are recorded in the split's ledger.
    """
    if options.augmult:
        raise DPVisionError(
            "augmult needs pixel inputs: ScatterNet features are extracted once, so set "
            "learner.augmult = 0 with features other than pixels"
        )
    if spec.projection_dim is not None or spec.pool != 1:
        raise DPVisionError("dp-sgd takes unpooled, unprojected feature maps (e.g. scatternet)")
    dataset, rows, held = split.dataset, split.rows, split.held
    shape = feature_shape(
        tuple(dataset.train_images.shape[1:]), dataclasses.replace(spec, flatten=False)
    )
    # Under torchrun rank 0 extracts and caches the features, then the others read them.
    train, test = current().main_first(lambda: load_or_extract(dataset, spec, progress=not quiet))
    if split.subset:  # the held-out rows (validation, then test) are only transformed
        # Views, read once by the preprocessing into the one array each becomes (no copies).
        train, test = Rows.of(train, rows), Rows.of(train, held) + Rows.of(test)
    train, test, fitted = preprocess(
        config.preprocessing,
        train,
        test,
        int(shape[0]),
        split.ledger,
        secret.noise("preprocessing"),
        noise_off=config.noise_off,
    )
    # The preprocessed arrays are new float32 ones, used as they are (a read-only cached
    # array, left as is by ``none``, is copied once).
    train_x = torch.from_numpy(np.require(train, np.float32, ["C", "W"])).view(-1, *shape)
    test_x = torch.from_numpy(np.require(test, np.float32, ["C", "W"])).view(-1, *shape)
    return split.data(train_x, test_x[len(held) :], test_x[: len(held)]), fitted
