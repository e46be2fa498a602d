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
    # Another number of classes: the head starts at zero (issue 40), the body as the file.
    assert "classifier head 'fc' starts at zero" in report.message()
    head = dict(model.named_parameters())
    assert not any(head[f"fc.{k}"].any() for k in ("weight", "bias"))
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


def _vit_run(tmp_path: Path, *sets: str) -> list[str]:
    data = _write_npz(tmp_path / "small.npz")
    argv = ["train", "--dataset", f"npz:{data}", "--method", "dp-sgd", "--epsilon", "1"]
    argv += ["--set", "num_classes=10", "--set", "learner.model=timm:vit_tiny_patch16_224"]
    for item in ("learner.steps=2", "learner.batch_size=16", *sets):
        argv += ["--set", item]
    return argv


def test_a_timm_vit_is_refused_on_32px_images_naming_both_fixes(tmp_path, capsys):
    """Without ``image_size`` the images are brought to timm's 224×224; kept at 32×32, the
    ViT cannot take them, and one line says so before any training step (was: timm's
    traceback from inside the first step)."""
    from dpvision.cli import main

    code = main([*_vit_run(tmp_path, "image_size=32"), "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "timm:vit_tiny_patch16_224 takes 224×224 images, these are 32×32" in line
    assert "set image_size = 224, or give learner.model_args = {img_size = 32}" in line
    assert not (tmp_path / "r.json").exists()


def test_dpvision_train_fine_tunes_a_timm_vit_at_img_size_32(tmp_path, capsys):
    """Issue 39's acceptance: a timm ViT fine-tuned from the CLI at ``img_size = 32``, from
    a random-weight checkpoint of the same architecture, saved and loaded again."""
    from dpvision.cli import main
    from dpvision.runs.saved import load_model

    torch.manual_seed(5)
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32)
    weights = _save(source.eval(), tmp_path / "vit32.safetensors")
    argv = _vit_run(tmp_path, "learner.model_args={img_size=32}", f"learner.init={weights}")
    argv += ["--json", str(tmp_path / "r.json"), "--save", str(tmp_path / "m.safetensors")]
    code = main(argv)
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["learner"]["model_args"] == {"img_size": 32}
    assert result["init"]["head_replaced"] is True  # 1000 ImageNet classes → 10
    assert result["epsilon"] <= 1
    model = load_model(tmp_path / "m.safetensors")
    assert model.model_args == {"img_size": 32}  # the same architecture is rebuilt
    images = np.load(tmp_path / "small.npz")["x_test"][:4]
    proba = model.predict_proba(images)
    assert proba.shape == (4, 10)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, atol=1e-12)
    assert model.score(images, np.arange(100, 104) % 10) == pytest.approx(
        float((proba.argmax(1) == np.arange(100, 104) % 10).mean())
    )


# --- image geometry (issue 39, item 3: helper A's additions) -------------------------------


@pytest.mark.parametrize("crop_mode", ["center", "squash", "border"])
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size", [(64, 64), (48, 64)])
def test_the_image_geometry_gives_timms_eval_transform(crop_mode, interpolation, size):
    """``image_size``/``crop_mode``/``crop_pct``/``interpolation`` mean what timm's
    ``create_transform`` (evaluation) does with them, pixel for pixel (border: timm pads with
    the model's mean pixel, dpvision with black: the mean is 0 here)."""
    from PIL import Image
    from timm.data import create_transform

    from dpvision.data.resize import ImageGeometry

    geometry = ImageGeometry(size, crop_mode=crop_mode, crop_pct=0.875, interpolation=interpolation)
    transform = create_transform(
        size if size[0] != size[1] else size[0],
        is_training=False,
        crop_pct=0.875,
        crop_mode=crop_mode,
        interpolation=interpolation,
        mean=(0.0, 0.0, 0.0),
        std=(1.0, 1.0, 1.0),
        normalize=False,
    )
    rng = np.random.default_rng(0)
    for shape in ((90, 130, 3), (131, 77, 3), (40, 40, 3)):
        image = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
        expected = transform(image).permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(np.asarray(geometry.apply(image)), expected)


def test_a_timm_vit_without_image_size_takes_its_pretrained_cfg():
    from dpvision.config import resolve

    vit = {"method": "dp-sgd", "learner": {"model": "timm:vit_tiny_patch16_224"}}
    config = resolve(overrides=vit)
    assert (config.image_size, config.crop_pct, config.crop_mode, config.interpolation) == (
        224,
        0.9,
        "center",
        "bicubic",
    )
    assert config.geometry is not None
    assert config.geometry.size == (224, 224)
    given = resolve(overrides=vit, sets=["learner.model_args={img_size=32}"])
    assert given.image_size == 32
    assert given.crop_pct == 1.0
    mine = resolve(overrides=vit, sets=["image_size=[96, 128]", "interpolation=nearest"])
    assert (mine.image_size, mine.interpolation) == ((96, 128), "nearest")  # the user's
    convnet = resolve(overrides={"method": "dp-sgd", "learner": {"model": "timm:resnet18"}})
    assert convnet.image_size is None  # any input size: the images keep theirs


def test_dpvision_train_fine_tunes_a_timm_vit_resized_to_224(tmp_path, capsys):
    """Issue 39's acceptance: a timm ViT fine-tuned from the CLI on 32×32 images, resized to
    224 by its pretrained_cfg (no image_size given), saved, and applied by predict."""
    from dpvision.cli import main
    from dpvision.runs.saved import load_model

    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (10, 32, 32, 3), dtype=np.uint8), np.arange(10) % 2
    data = tmp_path / "tiny.npz"
    np.savez(data, x_train=images[:8], y_train=labels[:8], x_test=images[8:], y_test=labels[8:])
    argv = ["train", "--dataset", f"npz:{data}", "--method", "dp-sgd"]
    for item in ("noise_multiplier=1", "num_classes=2", "learner.model=timm:vit_tiny_patch16_224"):
        argv += ["--set", item]
    for item in ("learner.steps=1", "learner.batch_size=4", "learner.eval_every=0"):
        argv += ["--set", item]
    argv += ["--json", str(tmp_path / "r.json"), "--save", str(tmp_path / "m.safetensors")]
    code = main(argv)
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["image_size"] == 224
    assert result["config"]["interpolation"] == "bicubic"
    model = load_model(tmp_path / "m.safetensors")
    assert model.image_shape == (224, 224, 3)
    np.save(tmp_path / "new.npy", images[8:])  # 32×32
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "m.safetensors"), str(tmp_path / "new.npy")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3  # resized as in training


def test_timm_weights_without_a_record_are_standardised_as_their_pretrained_cfg(tmp_path):
    """``learner.normalization = auto`` with a timm file that records no statistics takes
    timm's ``pretrained_cfg`` mean and std (ImageNet's for resnet18), averaged for one
    channel; ``none`` keeps raw pixels."""
    from dpvision.runs.network import pixel_statistics
    from dpvision.training.options import DPSGDOptions

    path = _save(_source("timm:resnet18", classes=10), tmp_path / "w.safetensors")
    options = DPSGDOptions.from_dict({"model": "timm:resnet18", "init": str(path)})
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    colour = pixel_statistics(options, "npz:x", 3)
    assert colour is not None
    assert colour[0] == pytest.approx(mean)
    assert colour[1] == pytest.approx(std)
    gray = pixel_statistics(options, "npz:x", 1)
    assert gray is not None
    assert gray[0] == pytest.approx((sum(mean) / 3,))
    assert gray[1] == pytest.approx((sum(std) / 3,))
    raw = DPSGDOptions.from_dict(
        {"model": "timm:resnet18", "init": str(path), "normalization": "none"}
    )
    assert pixel_statistics(raw, "npz:x", 3) is None
