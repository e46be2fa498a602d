"""timm and torchvision models (the ``models`` extra): loading, head replacement, frozen
BatchNorm, fine-tuning modes and their sensitivity, and a whole run.

Marked ``models``: CI runs them in a second environment that has the extra
(``.ci/run``); elsewhere they are skipped when timm or torchvision is missing.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dpvision.errors import DPVisionError
from dpvision.models.finetune import FINETUNE_MODES, apply_finetune
from dpvision.models.registry import build_network, prepare_for_dp
from dpvision.models.validation import validate_model
from dpvision.models.weights import load_weights
from dpvision.testing import check_sensitivity

pytestmark = pytest.mark.models
timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")

SHAPE = (3, 32, 32)


def _source(spec: str, classes: int) -> torch.nn.Module:
    torch.manual_seed(3)
    library, name = spec.split(":")
    if library == "timm":
        model = timm.create_model(name, pretrained=False, num_classes=classes)
    else:
        model = torchvision.models.get_model(name, weights=None, num_classes=classes)
    model.train()
    with torch.no_grad():  # non-trivial BatchNorm statistics, as after pre-training
        for _ in range(2):
            model(torch.rand(8, *SHAPE))
    return model.eval()


def _save(model: torch.nn.Module, path: Path) -> Path:
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if path.suffix == ".safetensors":
        save_file(state, path)
    else:
        torch.save(state, path)
    return path


@pytest.mark.parametrize("spec", ["timm:test_resnet", "timm:resnet18", "torchvision:resnet18"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_loaded_weights_give_the_source_logits(tmp_path, spec, suffix):
    source = _source(spec, classes=10)
    path = _save(source, tmp_path / f"w{suffix}")
    torch.manual_seed(0)
    model = build_network(spec, SHAPE, 10)
    report = load_weights(model, path)
    assert not report.head_replaced
    x = torch.rand(4, *SHAPE)
    with torch.no_grad():
        expected = source(x)
        assert torch.equal(model.eval()(x), expected)
        # Frozen BatchNorm computes the evaluation-mode function in training mode too.
        frozen = prepare_for_dp(model, "freeze").train()
        assert torch.allclose(frozen(x), expected, atol=1e-5)


@pytest.mark.parametrize("spec", ["timm:resnet18", "torchvision:resnet18"])
def test_an_imagenet_head_is_replaced_for_ten_classes(tmp_path, spec):
    path = _save(_source(spec, classes=1000), tmp_path / "w.safetensors")
    model = build_network(spec, SHAPE, 10)
    report = load_weights(model, path)
    assert report.head_replaced
    assert "classifier head 'fc' starts fresh" in report.message()
    assert model(torch.rand(2, *SHAPE)).shape == (2, 10)


def test_batchnorm_in_training_mode_is_refused_and_both_fixes_work():
    raw = build_network("timm:test_resnet", SHAPE, 10)
    with pytest.raises(DPVisionError, match="freeze_batchnorm"):
        validate_model(raw)
    for mode in ("freeze", "group-norm"):
        validate_model(prepare_for_dp(raw, mode))


@pytest.mark.parametrize("batchnorm", ["freeze", "group-norm"])
@pytest.mark.parametrize("mode", FINETUNE_MODES)
def test_each_fine_tuning_mode_moves_the_release_by_at_most_c(mode, batchnorm):
    torch.manual_seed(0)
    model = prepare_for_dp(build_network("timm:test_resnet", SHAPE, 10), batchnorm).double()
    apply_finetune(model, mode)
    rng = np.random.default_rng(0)
    data = (
        torch.from_numpy(rng.standard_normal((5, *SHAPE))),
        torch.from_numpy(rng.integers(0, 10, 5)),
    )
    report = check_sensitivity(model, data, neighbours=2, scale=30.0, max_grad_norm=1.0)
    assert report.refusal is None
    assert report.ok, report.summary()
    assert report.max_ratio > 0.99  # the bound is reached: clipping is exercised


@pytest.mark.parametrize("spec", ["timm:test_vit", "timm:test_convnext", "timm:test_nfnet"])
def test_other_timm_families_move_the_release_by_at_most_c(spec):
    shape = (3, 160, 160) if "vit" in spec else SHAPE
    torch.manual_seed(0)
    model = prepare_for_dp(build_network(spec, shape, 10), "freeze").double()
    rng = np.random.default_rng(1)
    data = (
        torch.from_numpy(rng.standard_normal((3, *shape))),
        torch.from_numpy(rng.integers(0, 10, 3)),
    )
    report = check_sensitivity(model, data, neighbours=1, scale=30.0, max_grad_norm=1.0)
    assert report.refusal is None
    assert report.ok, report.summary()


def _write_npz(path: Path) -> Path:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (120, 32, 32, 3)).astype(np.uint8)
    labels = np.arange(120) % 10
    np.savez(
        path, x_train=images[:100], y_train=labels[:100], x_test=images[100:], y_test=labels[100:]
    )
    return path


def test_dpvision_train_fine_tunes_a_timm_resnet18_from_safetensors(tmp_path, capsys):
    from dpvision.cli import main
    from dpvision.runs.saved import load_model

    weights = _save(_source("timm:resnet18", classes=1000), tmp_path / "weights.safetensors")
    data = _write_npz(tmp_path / "small.npz")
    code = main(
        [
            "train",
            "--dataset",
            f"npz:{data}",
            "--method",
            "dp-sgd",
            "--set",
            "num_classes=10",
            "--set",
            "learner.model=timm:resnet18",
            "--set",
            f"learner.init={weights}",
            "--set",
            "learner.finetune=head",
            "--set",
            "learner.steps=2",
            "--set",
            "learner.batch_size=16",
            "--epsilon",
            "1",
            "--json",
            str(tmp_path / "r.json"),
            "--save",
            str(tmp_path / "m.safetensors"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["init"]["head_replaced"] is True
    assert result["batchnorm"] == "freeze"
    assert result["num_trained_parameters"] == 512 * 10 + 10
    assert result["epsilon"] <= 1
    network = load_model(tmp_path / "m.safetensors").network
    assert network is not None
    start = load_file(weights)
    for name, value in network.state_dict().items():
        if not name.startswith("fc."):
            assert torch.equal(value, start[name]), name  # frozen: bit-identical
