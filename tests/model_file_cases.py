"""Model files that need something outside themselves (issue 39, item 5), made without
training: a ``python:FILE.py:CALLABLE`` network with a fixed input size (as a ViT has), and
the same file recorded as a timm model. Shared by ``test_saved_models.py`` and
``test_cli_fuzz.py``."""

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from dpvision.models.registry import build_model
from dpvision.models.spec import ModelSpec
from dpvision.runs.saved import TrainedModel

FACTORY = '''
from torch import nn


class Net(nn.Module):
    """A network for square images of one size (``img_size``), as a ViT is."""

    def __init__(self, num_classes=10, in_chans=1, img_size=16):
        super().__init__()
        self.img_size = img_size
        self.fc = nn.Linear(in_chans * img_size * img_size, num_classes)

    def forward(self, x):
        if x.shape[-1] != self.img_size:
            raise AssertionError(
                f"Input height ({x.shape[-1]}) doesn't match model ({self.img_size})"
            )
        return self.fc(x.flatten(1))
'''
"""A factory (``python:net.py:Net``) whose network takes ``img_size``² images only."""


def write_factory(folder: Path) -> Path:
    """``folder/net.py`` holding :data:`FACTORY`."""
    path = folder / "net.py"
    path.write_text(FACTORY)
    return path


def factory_model(spec: str, path: Path) -> TrainedModel:
    """A digits model (8×8×1 images) whose network is ``spec`` built with ``img_size = 8``,
    saved to ``path`` as ``dpvision train --save`` would (the spec's file made absolute)."""
    parsed = ModelSpec.parse(spec).with_args({"img_size": 8})
    model = TrainedModel(
        method="dp-sgd",
        dataset="digits",
        num_classes=10,
        image_shape=(8, 8, 1),
        features="pixels",
        preprocessing=None,
        privacy={
            "epsilon": 1.0,
            "delta": 1e-5,
            "accountant": "pld",
            "noise_multiplier": 1.0,
            "privacy_ledger": [],
        },
        config={},
        input_shape=(1, 8, 8),
        network=build_model(parsed, (1, 8, 8), 10).eval(),
        model_name=parsed.absolute().text,
        model_args=parsed.kwargs,
        groups=27,
        batchnorm="group-norm",
    )
    model.save(path)
    return model


def recorded_as(source: Path, target: Path, model_name: str) -> None:
    """``source``'s model file copied to ``target`` with its network recorded as
    ``model_name`` (an intact file of another source)."""
    with safe_open(source, framework="pt") as handle:
        document = json.loads((handle.metadata() or {})["dpvision"])
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    document["model_name"] = model_name
    target.write_bytes(save_safetensors(tensors, metadata={"dpvision": json.dumps(document)}))
