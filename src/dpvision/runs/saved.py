"""A trained private classifier in one file, used again: ``dpvision train --save MODEL``,
``dpvision predict``, ``dpvision evaluate`` and :func:`load_model`.

::

    from dpvision import load_model
    model = load_model("model.safetensors")
    model.predict(images)          # uint8 (N, H, W, C), as the dataset's images
    model.predict_proba(images)    # (N, m) class probabilities, rows summing to 1
    model.epsilon, model.ledger    # what training spent

The file is `safetensors <https://github.com/huggingface/safetensors>`_: the tensors (the
weights and the released preprocessing statistics), and one JSON document in its metadata
(key ``dpvision``): the format, the method, how an image becomes the classifier's input (the
feature spec, the preprocessing, the pixel normalisation), the classifier (a linear map, or
a named network of :mod:`dpvision.models`), the resolved config, ε, δ and the privacy ledger.
Loading it runs no code (no pickle). It is written atomically: never half-written.

Privacy: the file holds only what training released — the noisy model (the EMA of the noisy
iterates where the run kept one), the noisy preprocessing statistics, all post-processing of
the releases in its ledger — and public facts (config, shapes, public normalisation
constants). Predictions on new images use nothing else, so they cost no privacy.
"""

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_safetensors
from torch import nn

from dpvision.data.pictures import as_images
from dpvision.data.resize import ImageGeometry
from dpvision.devices import resolve_device
from dpvision.errors import DPVisionError
from dpvision.features import encoder_digest, extract_features, parse_feature_spec
from dpvision.features.backbone import feature_source
from dpvision.features.preprocessing import FittedPreprocessing, PreprocessingConfig
from dpvision.fileio import atomic_open
from dpvision.learners.base import softmax
from dpvision.models.registry import build_model
from dpvision.models.sources import INSTALL, missing_package
from dpvision.models.spec import ModelSpec

__all__ = ["MODEL_FORMAT", "TrainedModel", "load_model"]

MODEL_FORMAT = "dpvision-model-v1"
#: Rows pushed through the classifier at once when predicting.
BATCH = 512


@dataclasses.dataclass
class TrainedModel:
    """A trained classifier and everything needed to apply it to new images.

    Attributes:
      method: how it was trained (``dp-ls``, …, ``dp-sgd``, ``dp-randp``).
      dataset: the dataset it was trained on (its classes are this model's outputs).
      num_classes: m, the number of outputs.
      image_shape: (H, W, C) of the uint8 images it takes; ``None`` when it takes feature
        vectors (``precomputed`` features).
      features: the feature spec (``pixels``, ``scatternet``, …) images go through.
      preprocessing: the fitted preprocessing of the features, or ``None`` (networks on
        pixels).
      pixel_mean, pixel_std: per-channel normalisation of pixels in [0, 1] before a network
        (public constants), or ``None``.
      input_shape: (C, H, W) the network takes (``None`` for a linear model).
      coef, intercept: the linear model (m × d, m), or ``None``.
      network: the network (evaluation mode), or ``None``.
      model_name, model_args, groups, batchnorm: how
        :func:`dpvision.models.registry.build_model` rebuilds it (``model_args``: the
        constructor arguments of an external model, ``learner.model_args``; ``batchnorm``:
        what became of a timm/torchvision model's BatchNorm). A ``python:FILE.py:CALLABLE``
        model is recorded with the file's absolute path, so the file loads from any
        directory.
      privacy: ``epsilon``, ``delta``, ``accountant``, ``noise_multiplier`` and
        ``privacy_ledger`` (every release) of the run.
      config: the resolved config of the run.
      encoder_sha256: for ``encoder:`` features, the digest of the encoder file (checked
        when the model is loaded).
      class_names: the name of each class, when the dataset has them (public).
    """

    method: str
    dataset: str
    num_classes: int
    image_shape: tuple[int, ...] | None
    features: str
    preprocessing: FittedPreprocessing | None
    privacy: dict[str, Any]
    config: dict[str, Any]
    pixel_mean: tuple[float, ...] | None = None
    pixel_std: tuple[float, ...] | None = None
    input_shape: tuple[int, ...] | None = None
    coef: np.ndarray | None = None
    intercept: np.ndarray | None = None
    network: nn.Module | None = None
    model_name: str | None = None
    model_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    groups: int | None = None
    batchnorm: str | None = None
    encoder_sha256: str | None = None
    class_names: tuple[str, ...] | None = None
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    def to(self, device: str | torch.device) -> "TrainedModel":
        """Computes scores (and features) on ``device`` (``auto``, ``cpu``, ``cuda``,
        ``cuda:N``) from now on; returns the model itself."""
        self.device = resolve_device(device)
        if self.network is not None:
            self.network.to(self.device)
        return self

    @property
    def epsilon(self) -> float:
        """ε the run spent (at :attr:`delta`)."""
        return float(self.privacy["epsilon"])

    @property
    def delta(self) -> float:
        return float(self.privacy["delta"])

    @property
    def ledger(self) -> list[dict[str, Any]]:
        """Every noisy release of the run (the privacy ledger's entries)."""
        return list(self.privacy["privacy_ledger"])

    # --- inference -------------------------------------------------------------------------

    def images(self, inputs: Any) -> np.ndarray:
        """``inputs`` as the uint8 images ``(N, H, W, C)`` this model was trained on: arrays
        of any size (one image or a batch; grey, RGB or RGBA), Pillow images, image files
        or folders, ``.npy`` files, or a list of them, each brought to the recorded
        geometry (``image_size``, crop and interpolation; without one, the training
        images' own size) as ``dpvision predict`` does (:mod:`dpvision.data.pictures`).

        Privacy: reads the given images only; releases nothing.
        """
        if self.image_shape is None:
            raise DPVisionError(
                f"this model takes feature vectors ({self.features}), not images: give an "
                "array (N, d)"
            )
        geometry = ImageGeometry.from_config(self.config) or ImageGeometry(
            (int(self.image_shape[0]), int(self.image_shape[1]))
        )
        return as_images(inputs, int(self.image_shape[-1]), geometry)

    def decision_function(self, inputs: Any) -> np.ndarray:
        """Scores (N, m) of images (anything :meth:`images` takes), or of feature vectors
        (N, d) for a model trained on precomputed features."""
        if self.image_shape is not None:
            inputs = self.images(inputs)
        self._check(inputs)
        scores = [
            self._scores(inputs[start : start + BATCH]) for start in range(0, len(inputs), BATCH)
        ]
        return np.concatenate(scores) if scores else np.zeros((0, self.num_classes))

    def predict(self, inputs: Any) -> np.ndarray:
        """The predicted class of each input (int64, 0 … m−1); images as :meth:`images`
        takes them (any size, Pillow, files), brought to the model's geometry."""
        return self.decision_function(inputs).argmax(axis=1).astype(np.int64)

    def predict_proba(self, inputs: Any) -> np.ndarray:
        """Class probabilities (N, m), float64, each row summing to 1: the softmax of
        :meth:`decision_function` (the most probable class is :meth:`predict`'s). A network
        or DP-Newton / DP-SGD-linear head trained with cross-entropy gives its own
        probabilities; for DP-LS and DP-FC the softmax only orders the classes like their
        least-squares scores (not calibrated).

        Privacy:
          Post-processing of the released model: no privacy cost.
        """
        return softmax(self.decision_function(inputs))

    def score(self, inputs: Any, labels: np.ndarray) -> float:
        """Accuracy on (inputs, labels)."""
        if self.image_shape is not None:
            inputs = self.images(inputs)
        labels = np.asarray(labels)
        if len(labels) != len(inputs):
            raise DPVisionError(f"{len(inputs)} inputs but {len(labels)} labels")
        return float((self.predict(inputs) == labels).mean()) if len(labels) else math.nan

    def _check(self, inputs: np.ndarray) -> None:
        if not isinstance(inputs, np.ndarray):
            raise DPVisionError(f"expected a NumPy array, got {type(inputs).__name__}")
        if self.image_shape is None:
            d = None if self.coef is None else self.coef.shape[1]
            if inputs.ndim != 2 or (d is not None and inputs.shape[1] != d):
                raise DPVisionError(
                    f"this model takes feature vectors of shape (N, {d}), got {inputs.shape}"
                )
            return
        expected = (len(inputs), *self.image_shape)
        if inputs.dtype != np.uint8 or inputs.shape != expected:
            shape = ", ".join(map(str, self.image_shape))
            raise DPVisionError(
                f"this model takes uint8 images of shape (N, {shape}) (H, W, C), as "
                f"{self.dataset}'s; got {inputs.dtype} {inputs.shape}"
            )

    @torch.no_grad()
    def _scores(self, batch: np.ndarray) -> np.ndarray:
        if self.features == "pixels" and self.network is not None:
            x = torch.from_numpy(np.ascontiguousarray(batch)).to(self.device)
            x = x.permute(0, 3, 1, 2).float() / 255
            if self.pixel_mean is not None and self.pixel_std is not None:
                mean = torch.tensor(self.pixel_mean, device=self.device).view(-1, 1, 1)
                x = (x - mean) / torch.tensor(self.pixel_std, device=self.device).view(-1, 1, 1)
        else:
            if self.image_shape is None:
                features = np.asarray(batch, dtype=np.float32)
            else:
                spec = parse_feature_spec(self.features)
                features = extract_features(batch, spec, progress=False, device=str(self.device))
            if self.preprocessing is not None:
                features = self.preprocessing.transform(np.asarray(features))
            if self.network is None:
                assert self.coef is not None
                assert self.intercept is not None
                scores = np.asarray(features, dtype=np.float64) @ self.coef.T + self.intercept
                return np.asarray(scores)
            assert self.input_shape is not None
            x = torch.from_numpy(np.asarray(features, dtype=np.float32)).view(-1, *self.input_shape)
        assert self.network is not None
        return self.network(x.to(self.device)).double().cpu().numpy()

    # --- the file ------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Writes the model file atomically (see the module docstring)."""
        tensors: dict[str, torch.Tensor] = {}
        if self.coef is not None and self.intercept is not None:
            tensors["coef"] = torch.from_numpy(np.ascontiguousarray(self.coef))
            tensors["intercept"] = torch.from_numpy(np.ascontiguousarray(self.intercept))
        if self.network is not None:
            for name, value in self.network.state_dict().items():
                tensors[f"network.{name}"] = value.detach().cpu().contiguous()
        preprocessing = None
        if self.preprocessing is not None:
            for name, value in self.preprocessing.statistics.items():
                tensors[f"preprocessing.{name}"] = torch.from_numpy(np.ascontiguousarray(value))
            preprocessing = {
                "config": dataclasses.asdict(self.preprocessing.config),
                "channels": self.preprocessing.channels,
            }
        document = {
            "format": MODEL_FORMAT,
            "method": self.method,
            "dataset": self.dataset,
            "num_classes": self.num_classes,
            "image_shape": self.image_shape,
            "features": self.features,
            "encoder_sha256": self.encoder_sha256,
            "preprocessing": preprocessing,
            "pixel_mean": self.pixel_mean,
            "pixel_std": self.pixel_std,
            "input_shape": self.input_shape,
            "model_name": self.model_name,
            "model_args": self.model_args,
            "groups": self.groups,
            "batchnorm": self.batchnorm,
            "privacy": self.privacy,
            "config": self.config,
            "class_names": self.class_names,
        }
        data = save_safetensors(tensors, metadata={"dpvision": json.dumps(document)})
        with atomic_open(path, "wb") as out:
            out.write(data)


def load_model(path: str | Path) -> TrainedModel:
    """The model saved at ``path`` by ``dpvision train --save`` (no code is run).

    Raises:
      DPVisionError: one line: the file is missing, not a dpvision model, or damaged; or
        intact but what it needs is not here (timm or torchvision, a ``python:`` factory's
        file, an ``encoder:`` file), named with the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise DPVisionError(f"{path}: no such model file")
    try:
        with safe_open(path, framework="pt") as handle:
            document = json.loads((handle.metadata() or {})["dpvision"])
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, KeyError, TypeError):
        raise DPVisionError(
            f"{path} is not a dpvision model file (dpvision train --save)"
        ) from None
    if not isinstance(document, dict) or document.get("format") != MODEL_FORMAT:
        raise DPVisionError(f"{path}: unknown model format {document.get('format')!r}")
    _check_needs(path, document)
    try:
        return _from_document(document, tensors)
    except DPVisionError as error:  # intact, but what it needs is not here: say what
        raise DPVisionError(f"{path}: {error}") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise DPVisionError(f"{path}: damaged model file ({type(error).__name__})") from None


def _check_needs(path: Path, document: dict[str, Any]) -> None:
    """One-line errors for an intact model file whose network cannot be built here: the
    ``models`` extra is not installed, or a ``python:`` factory's file is gone."""
    name = document.get("model_name")
    if not isinstance(name, str):
        return
    try:
        spec = ModelSpec.parse(name)
    except DPVisionError:
        return  # a damaged record: reported as such when it is read
    package = missing_package(spec.source)
    if package is not None:
        raise DPVisionError(
            f"{path}: this model file needs {package} ({name}), which is not installed; "
            f"install the models extra: {INSTALL}"
        )
    module = spec.name.rpartition(":")[0]
    if spec.kind == "python" and module.endswith(".py") and not Path(module).is_file():
        raise DPVisionError(
            f"{path}: this model's network is built by {name}, and the file {module} is "
            "missing (the model file holds the weights, not the code): put it back there"
        )


def _from_document(document: dict[str, Any], tensors: dict[str, torch.Tensor]) -> TrainedModel:
    preprocessing = None
    if document["preprocessing"] is not None:
        statistics = {
            key.split(".", 1)[1]: value.numpy()
            for key, value in tensors.items()
            if key.startswith("preprocessing.")
        }
        preprocessing = FittedPreprocessing(
            PreprocessingConfig(**document["preprocessing"]["config"]),
            int(document["preprocessing"]["channels"]),
            statistics,
        )
    network = None
    if document["model_name"] is not None:
        input_shape = tuple(document["input_shape"])
        spec = ModelSpec.parse(document["model_name"]).with_args(document.get("model_args"))
        network = build_model(
            spec,
            input_shape,
            document["num_classes"],
            groups=document["groups"],
            batchnorm=document.get("batchnorm") or "group-norm",
        )
        weights = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("network.")}
        network.load_state_dict(weights)
        network.eval()
    spec = document["features"]
    if document["encoder_sha256"] is not None:
        path = feature_source(parse_feature_spec(spec))
        if (
            path is None
            or not Path(path).is_file()
            or encoder_digest(str(path)) != document["encoder_sha256"]
        ):
            raise DPVisionError(
                f"this model's features come from the encoder {path}, which is missing or has "
                "changed since training"
            )

    def shape(value: Any) -> tuple[int, ...] | None:
        return None if value is None else tuple(int(v) for v in value)

    def numbers(value: Any) -> tuple[float, ...] | None:
        return None if value is None else tuple(float(v) for v in value)

    return TrainedModel(
        method=document["method"],
        dataset=document["dataset"],
        num_classes=int(document["num_classes"]),
        image_shape=shape(document["image_shape"]),
        features=spec,
        preprocessing=preprocessing,
        privacy=document["privacy"],
        config=document["config"],
        pixel_mean=numbers(document["pixel_mean"]),
        pixel_std=numbers(document["pixel_std"]),
        input_shape=shape(document["input_shape"]),
        coef=tensors["coef"].numpy() if "coef" in tensors else None,
        intercept=tensors["intercept"].numpy() if "intercept" in tensors else None,
        network=network,
        model_name=document["model_name"],
        model_args=dict(document.get("model_args") or {}),
        groups=document["groups"],
        batchnorm=document.get("batchnorm"),
        encoder_sha256=document["encoder_sha256"],
        class_names=None if document["class_names"] is None else tuple(document["class_names"]),
    )


def privacy_of(result: dict[str, Any]) -> dict[str, Any]:
    """The privacy part of a result dict, as a model file keeps it."""
    keys = ("epsilon", "delta", "accountant", "noise_multiplier", "privacy_ledger")
    return {key: result.get(key) for key in keys}
