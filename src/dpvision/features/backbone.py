"""Backbone features: what a pre-trained encoder makes of each image (DP-RandP's linear probe).

The ``encoder`` extractor runs the body of an encoder file (:mod:`dpvision.models.encoder`,
written by ``dpvision pretrain``) over the images and returns, per image, one vector:

* ``layers=embedding`` (default): the input of the head, what :func:`load_encoder` maps to;
* ``layers=blocks``: the output of every block of the body (:func:`block_names`), the
  multi-block features of DP-RandP App. G, the last block being the embedding;
* ``layers=NAME+NAME+...``: the outputs of the named modules, in the order given
  (``embedding`` names the body's output).

Each 4-d output ``(N, K, h, w)`` is average-pooled to ``grid × grid``
(``adaptive_avg_pool2d``; ``grid=1`` is global average pooling) and flattened; other outputs
are flattened as they are; the pieces are concatenated. With ``norm=C`` every vector is then
rescaled to L2 norm ``C`` (after the projection, if ``projection_dim`` is set).

Images go through :func:`~dpvision.data.core.images_to_tensor`, the encoder's public
normalisation (:meth:`EncoderInfo.normalize`) and the body in eval mode under
``torch.no_grad()``. The feature cache keys these features by the SHA-256 of the encoder
file (:func:`encoder_digest`), so a re-trained encoder never reads stale features.

>>> from dpvision.models.encoder import build_body
>>> block_names(build_body("tanh-cnn", (1, 28, 28), 16))
['features.1', 'features.4', 'embedding']
>>> block_names(build_body("wrn-10-1", (3, 32, 32), 16))
['stem', 'stages.0.0', 'stages.1.0', 'stages.2.0', 'embedding']

Privacy:
    Features of a *fixed* encoder are a per-example map: each vector is a function of its
    image and of the encoder's parameters alone, so extraction releases nothing and costs no
    privacy budget -- provided the encoder was trained without the private data (on
    synthetic or public images, as in DP-RandP's Phase I; its file's ``metadata`` records
    how it was trained). An encoder fitted on the private data is itself a release and must
    be accounted where it was trained. ``norm`` is a per-example rescaling, also free.

Importing this module does not import torch; extraction does.
"""

from __future__ import annotations

# local imports: start-up time (heavy modules are imported in the functions using them)
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpvision.errors import DPVisionError
from dpvision.features.spec import FeatureSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dpvision.models.encoder import EncoderInfo

__all__ = [
    "BLOCKS",
    "EMBEDDING",
    "EncoderFeatures",
    "block_names",
    "encoder_digest",
    "encoder_dim",
    "feature_source",
    "load_backbone",
]

EMBEDDING = "embedding"
"""The layer name of the body's output: the embedding that feeds the head."""

BLOCKS = "blocks"
"""The ``layers`` value that takes every block of :func:`block_names`."""

_ACTIVATIONS = ("Tanh", "ReLU", "GELU", "SiLU", "ELU", "LeakyReLU", "Sigmoid")
"""Class names of the ``torch.nn`` activation modules that end a block."""

_PASS_THROUGH = ("Identity", "Flatten", "Dropout")
"""Class names of ``torch.nn`` modules that keep their input's values (up to its shape)."""


def block_names(body: nn.Module) -> list[str]:
    """The blocks of an encoder body, in the order of its forward pass; the last is the
    embedding.

    * :class:`~dpvision.models.WideResNet`: the ``stem``, every residual block
      ``stages.{s}.{b}``, then ``embedding`` (the globally pooled, normalised output).
    * Other models (TanhCNN, MLP, ScatterCNN): every activation module (``nn.Tanh``,
      ``nn.ReLU``, …) in module order, then ``embedding``. When only identities and
      flattening follow the last activation, its output *is* the embedding, so it is
      listed once, as ``embedding``.

    Args:
        body: A model whose head is the identity (as
            :func:`dpvision.models.encoder.load_encoder` returns).

    Returns:
        Dotted module names, ending with :data:`EMBEDDING`.
    """
    from dpvision.models.wide_resnet import WideResNet

    if isinstance(body, WideResNet):
        blocks = [
            f"stages.{stage}.{block}"
            for stage, blocks_of_stage in body.stages.named_children()
            for block, _ in blocks_of_stage.named_children()
        ]
        return ["stem", *blocks, EMBEDDING]
    leaves = [
        (name, type(module).__name__)
        for name, module in body.named_modules()
        if name and not any(True for _ in module.children())
    ]
    activations = [index for index, (_, kind) in enumerate(leaves) if kind in _ACTIVATIONS]
    names = [leaves[index][0] for index in activations]
    if activations and all(kind in _PASS_THROUGH for _, kind in leaves[activations[-1] + 1 :]):
        names.pop()  # the last activation's output is the embedding itself
    return [*names, EMBEDDING]


def encoder_digest(path: str | Path) -> str:
    """SHA-256 of the encoder file's bytes (part of the feature cache key), by
    :func:`dpvision.fileio.sha256_file` with the encoder's one-line errors.

    Raises:
        DPVisionError: The file does not exist or cannot be read.
    """
    path = Path(path)
    if not path.is_file():
        raise DPVisionError(
            f"encoder file {path} not found; make one with `dpvision pretrain --out {path}`"
        )
    from dpvision.fileio import sha256_file

    try:
        return sha256_file(path)
    except OSError as error:
        raise DPVisionError(f"cannot read encoder {path} ({type(error).__name__})") from None


class EncoderFeatures:
    """An encoder file's body with hooks on the requested layers: ``[0, 1]`` image batches
    ``(N, C, H, W)`` -> feature vectors ``(N, D)`` (before any projection or ``norm``).

    Args:
        spec: An ``encoder`` feature spec (its ``path``, ``layers`` and ``grid`` are used).
        device: torch device for the body (default CPU).

    Raises:
        DPVisionError: The file is missing or not an encoder, or ``layers`` names a module
            the body does not have (the message lists :func:`block_names`).

    Privacy:
        See :mod:`dpvision.features.backbone`: free for an encoder trained without the
        private data.
    """

    def __init__(
        self,
        spec: FeatureSpec,
        *,
        device: str | torch.device | None = None,
        image_shape: tuple[int, ...] | None = None,
    ) -> None:
        from dpvision.models.encoder import load_encoder

        if spec.name == "backbone":
            if image_shape is None:
                raise DPVisionError("backbone features need the images' shape (H, W, C)")
            body, info = load_backbone(spec, image_shape)
            self.path = str(spec.weights or spec.model)
        elif spec.name == "encoder" and spec.path is not None:
            body, info = load_encoder(spec.path)
            self.path = spec.path
        else:
            raise DPVisionError(f"EncoderFeatures needs an encoder spec, got {spec.name!r}")
        self.info: EncoderInfo = info
        self.grid = spec.grid
        self.tokens = spec.tokens
        self.layers = self._resolve(body, spec.layers)
        self.body = body.to(device or "cpu").eval()
        self._outputs: dict[str, list[torch.Tensor]] = {}
        for name in self.layers:
            if name != EMBEDDING:
                self.body.get_submodule(name).register_forward_hook(self._hook(name))

    def _resolve(self, body: nn.Module, layers: str) -> list[str]:
        """The module names that ``layers`` stands for (one-line error for unknown names)."""
        blocks = block_names(body)
        if layers == BLOCKS:
            return blocks
        known = {name for name, _ in body.named_modules() if name}
        for name in layers.split("+"):
            if name != EMBEDDING and name not in known:
                raise DPVisionError(
                    f"encoder {self.path} ({self.info.model}) has no layer {name!r}; its blocks "
                    f"are {', '.join(blocks)} (or give layers=blocks or any module name)"
                )
        return layers.split("+")

    def _pool(self, output: torch.Tensor) -> torch.Tensor:
        """``(N, K, h, w)`` -> ``(N, K·grid·grid)`` by adaptive average pooling; else flatten."""
        import torch.nn.functional as functional

        if output.ndim == 4:
            output = functional.adaptive_avg_pool2d(output, self.grid)
        elif output.ndim == 3:  # (N, T, D) tokens of a transformer
            output = output[:, 0] if self.tokens == "first" else output.mean(dim=1)
        return output.reshape(len(output), -1)

    def _hook(self, name: str) -> Any:
        """A forward hook that stores the pooled output of module ``name``."""

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            import torch

            if not isinstance(output, torch.Tensor):
                raise DPVisionError(
                    f"layer {name!r} of encoder {self.path} returns {type(output).__name__}, "
                    "not a tensor; pick another layer"
                )
            self._outputs.setdefault(name, []).append(self._pool(output))

        return hook

    def check_image_shape(self, image_shape: tuple[int, ...]) -> None:
        """Raises a one-line error unless ``(H, W, C)`` matches the encoder's ``(C, H, W)``."""
        height, width, channels = (int(size) for size in image_shape)
        if (channels, height, width) != tuple(self.info.input_shape):
            raise DPVisionError(
                f"encoder {self.path} takes images of shape {tuple(self.info.input_shape)} "
                f"(C, H, W), these are {(channels, height, width)}: pre-train it with the "
                "same --size and --channels as the dataset"
            )

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """Features ``(N, D)`` of a ``[0, 1]`` batch ``(N, C, H, W)`` (on the body's device)."""
        import torch

        self._outputs = {}
        with torch.no_grad():
            embedding = self.body(self.info.normalize(batch))
            pieces = []
            for name in self.layers:
                if name == EMBEDDING:
                    pieces.append(self._pool(embedding))
                    continue
                outputs = self._outputs.get(name, [])
                if len(outputs) != 1:
                    raise DPVisionError(
                        f"layer {name!r} of encoder {self.path} runs {len(outputs)} times in "
                        "one forward pass, not once; pick another (see block_names)"
                    )
                pieces.append(outputs[0])
        self._outputs = {}
        return torch.cat(pieces, dim=1)


def load_backbone(spec: FeatureSpec, image_shape: tuple[int, ...]) -> tuple[nn.Module, EncoderInfo]:
    """The body of ``spec.model`` (head replaced by the identity, evaluation mode) for images
    of ``image_shape`` (H, W, C), with ``spec.weights`` loaded, and its info.

    Inputs are normalised with the weights file's statistics when it is a dpvision
    encoder, else with the model's own (timm's ``pretrained_cfg`` mean and std), else not
    at all; all are public constants. ``info.metadata`` is what the weights file records of
    its training data (checked by the run: see
    :func:`dpvision.models.weights.check_trained_on`).
    """
    from dpvision.models.encoder import EncoderInfo
    from dpvision.models.heads import body_of
    from dpvision.models.registry import build_network
    from dpvision.models.spec import ModelSpec
    from dpvision.models.weights import load_weights

    height, width, channels = (int(size) for size in image_shape)
    shape = (channels, height, width)
    model_spec = ModelSpec.parse(str(spec.model))
    model = build_network(model_spec, shape, 2, groups=16)
    record: dict[str, Any] = {}
    mean, std = _model_statistics(model, channels)
    if spec.weights is not None:
        record = dict(load_weights(model, spec.weights).record)
        mean, std = record.pop("input_statistics", (mean, std))
    body = body_of(model).eval()
    return body, EncoderInfo(model_spec.text, shape, 16, mean, std, record)


def _model_statistics(model: nn.Module, channels: int) -> tuple[tuple[float, ...], ...]:
    """timm's per-channel input mean and std for ``model`` when it has them (and they fit
    the channels), else the identity."""
    config = getattr(model, "pretrained_cfg", None) or {}
    mean, std = config.get("mean"), config.get("std")
    if mean is not None and std is not None and len(mean) == len(std) == channels:
        return tuple(float(v) for v in mean), tuple(float(v) for v in std)
    return (0.0,) * channels, (1.0,) * channels


def feature_source(spec: FeatureSpec) -> str | None:
    """The file an ``encoder`` or ``backbone`` spec reads (its bytes key the cache)."""
    return spec.path if spec.name == "encoder" else spec.weights


def encoder_dim(image_shape: tuple[int, ...], spec: FeatureSpec) -> int:
    """The length of one image's encoder feature vector (before any projection).

    Found with a forward pass of one all-zero image, remembered while the file is unchanged.

    Args:
        image_shape: ``(H, W, C)`` of one image.
        spec: An ``encoder`` spec.

    Raises:
        DPVisionError: As :class:`EncoderFeatures`, or the image shape is not the encoder's.
    """
    path = Path(str(feature_source(spec)))
    try:
        stat = path.stat()
        stamp = (str(path.resolve()), stat.st_ino, stat.st_mtime_ns, stat.st_size)
    except OSError:
        stamp = (str(path), 0, 0, 0)  # EncoderFeatures says what is wrong with the file
    shape = tuple(int(size) for size in image_shape)
    return _encoder_dim(stamp, spec.layers, spec.grid, shape, spec)


@functools.lru_cache(maxsize=32)
def _encoder_dim(
    stamp: tuple[str, int, int, int],
    layers: str,
    grid: int,
    image_shape: tuple[int, ...],
    spec: FeatureSpec,
) -> int:
    """:func:`encoder_dim` for one state of the file (``stamp``); errors are not cached."""
    import torch

    encoder = EncoderFeatures(spec, image_shape=image_shape)
    encoder.check_image_shape(image_shape)
    return int(encoder(torch.zeros(1, *encoder.info.input_shape)).shape[1])
