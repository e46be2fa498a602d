"""DP-RandP Phase I: the alignment + uniformity loss, the views, pre-training, encoder files."""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dpvision.cli import main
from dpvision.errors import DPVisionError
from dpvision.models.encoder import load_encoder, read_encoder
from dpvision.training.contrastive import (
    align_uniform_loss,
    alignment,
    contrastive_views,
    uniformity,
)
from dpvision.training.pretrain import learning_rate_at, pretrain
from dpvision.training.pretrain_options import PretrainOptions

SMALL = {
    "model": "mlp-16",
    "synthetic": "dead-leaves-squares",
    "size": 12,
    "channels": 1,
    "num_images": 256,
    "batch_size": 32,
    "steps": 12,
    "checkpoint_every": 1,
}


def test_loss_matches_its_definition() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(9, 5, generator=generator), dim=1)
    y = torch.nn.functional.normalize(torch.randn(9, 5, generator=generator), dim=1)
    align = sum(float((x[i] - y[i]).norm() ** 2) for i in range(9)) / 9
    pairs = [(i, j) for i in range(9) for j in range(i + 1, 9)]

    def unif(z: torch.Tensor) -> float:
        terms = [math.exp(-2 * float((z[i] - z[j]).norm() ** 2)) for i, j in pairs]
        return math.log(sum(terms) / len(terms))

    assert float(alignment(x, y)) == pytest.approx(align, rel=1e-5)
    assert float(uniformity(x)) == pytest.approx(unif(x), rel=1e-5)
    expected = align + (unif(x) + unif(y)) / 2
    assert float(align_uniform_loss(x, y)) == pytest.approx(expected, rel=1e-5)
    # Two antipodal points: ‖x − y‖² = 4, so uniformity = log e^{−8} = −8.
    antipodal = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert float(uniformity(antipodal)) == pytest.approx(-8.0)


@pytest.mark.parametrize("channels", [1, 3])
def test_views_are_random_in_range_and_reproducible(channels: int) -> None:
    images = torch.rand(16, channels, 20, 20, generator=torch.Generator().manual_seed(1))
    first = contrastive_views(images, torch.Generator().manual_seed(5))
    again = contrastive_views(images, torch.Generator().manual_seed(5))
    other = contrastive_views(images, torch.Generator().manual_seed(6))
    assert first.shape == images.shape
    assert float(first.min()) >= 0
    assert float(first.max()) <= 1
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    assert not torch.allclose(first, images)


def test_learning_rate_drops_tenfold_at_the_milestones() -> None:
    options = PretrainOptions.from_dict({"steps": 200, "learning_rate": 0.12})
    rates = [learning_rate_at(options, step) for step in (0, 154, 155, 170, 185, 199)]
    assert rates == pytest.approx([0.12, 0.12, 0.012, 0.0012, 0.00012, 0.00012])


def test_pretrain_writes_a_loadable_public_encoder(tmp_path: Path) -> None:
    options = PretrainOptions.from_dict(SMALL)
    summary = pretrain(options, tmp_path / "enc.pt", quiet=True)
    body, info = load_encoder(tmp_path / "enc.pt")
    assert info.model == "mlp-16"
    assert info.input_shape == (1, 12, 12)
    assert info.metadata["private_data"] is False
    assert info.metadata["trained_on"] == "synthetic:dead-leaves-squares"
    assert summary["losses"][-1]["step"] == SMALL["steps"]
    assert 0 < summary["train_seconds"] < summary["wall_seconds"]  # the steps, not the images
    # The normalisation is the statistics of the synthetic images themselves (public).
    from dpvision.data.synthetic import generate

    images = generate("dead-leaves-squares", 256, size=12, channels=1, seed=_image_seed(0))
    assert info.mean[0] == pytest.approx(images.mean() / 255, rel=1e-6)
    assert info.std[0] == pytest.approx(images.std() / 255, rel=1e-6)
    out = body(info.normalize(torch.rand(3, 1, 12, 12)))
    assert out.shape == (3, 16)


def _image_seed(seed: int) -> int:
    from dpvision.training.pretrain import _seeds

    return _seeds(seed)["images"]


def test_pretraining_lowers_the_loss(tmp_path: Path) -> None:
    options = PretrainOptions.from_dict(
        {**SMALL, "steps": 150, "num_images": 512, "batch_size": 64, "learning_rate": 0.2}
    )
    summary = pretrain(options, tmp_path / "enc.pt", quiet=True)
    losses = [entry["loss"] for entry in summary["losses"]]
    assert losses[-1] < losses[0] - 0.2, losses


def test_pretraining_is_deterministic_and_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = PretrainOptions.from_dict(SMALL)
    pretrain(options, tmp_path / "a.pt", quiet=True)
    pretrain(options, tmp_path / "b.pt", quiet=True)
    _, a = read_encoder(tmp_path / "a.pt")
    _, b = read_encoder(tmp_path / "b.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)

    import dpvision.training.pretrain as module

    calls = {"n": 0}
    original = module.align_uniform_loss

    def interrupted(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return original(x, y)

    monkeypatch.setattr(module, "align_uniform_loss", interrupted)
    checkpoint = tmp_path / "phase1.ckpt"
    with pytest.raises(KeyboardInterrupt):
        pretrain(options, tmp_path / "c.pt", checkpoint=checkpoint, quiet=True)
    assert not (tmp_path / "c.pt").exists()
    monkeypatch.setattr(module, "align_uniform_loss", original)
    pretrain(options, tmp_path / "c.pt", checkpoint=checkpoint, quiet=True)
    _, c = read_encoder(tmp_path / "c.pt")
    assert all(torch.equal(a[k], c[k]) for k in a)

    other = PretrainOptions.from_dict({**SMALL, "steps": 13})
    with pytest.raises(DPVisionError, match="other Phase I options"):
        pretrain(other, tmp_path / "d.pt", checkpoint=checkpoint, quiet=True)


def test_streaming_fresh_images(tmp_path: Path) -> None:
    options = PretrainOptions.from_dict({**SMALL, "num_images": 0, "steps": 3})
    summary = pretrain(options, tmp_path / "enc.pt", quiet=True)
    assert summary["options"]["num_images"] == 0
    assert np.isfinite(summary["final_loss"])


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"synthetic": "clouds"}, "unknown synthetic generator"),
        ({"model": "resnet"}, "unknown model"),
        ({"steps": 0}, "pretrain.steps must be >= 1"),
        ({"channels": 2}, "channels must be 1 or 3"),
        ({"batch_size": 64, "num_images": 10}, "num_images"),
        ({"learning_rate": "fast"}, "must be a number"),
        ({"stepz": 3}, "unknown pretrain option 'stepz'"),
    ],
)
def test_bad_options_are_one_line_errors(raw: dict[str, object], message: str) -> None:
    with pytest.raises(DPVisionError, match=message):
        PretrainOptions.from_dict(raw)


def test_encoder_files_are_checked(tmp_path: Path) -> None:
    with pytest.raises(DPVisionError, match="not found"):
        read_encoder(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(DPVisionError, match="cannot read encoder"):
        read_encoder(tmp_path / "junk.pt")
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(DPVisionError, match="not a dpvision encoder"):
        read_encoder(tmp_path / "other.pt")


def test_pretrain_and_synth_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = [f"--set={k}={v}" for k, v in SMALL.items() if k not in ("model", "synthetic")]
    out = tmp_path / "enc.pt"
    code = main(
        [
            "pretrain",
            "--model",
            "mlp-16",
            "--synthetic",
            "spectral",
            "--out",
            str(out),
            "--quiet",
            *sets,
        ]
    )
    assert code == 0
    assert out.exists()
    assert "no private data used" in capsys.readouterr().out
    png = tmp_path / "grid.png"
    assert main(["synth", "--kind", "dead-leaves-mixed", "--n", "12", "--out", str(png)]) == 0
    from PIL import Image

    with Image.open(png) as image:
        assert image.size[0] > 32 * 4
    assert main(["synth", "--kind", "clouds", "--out", str(png)]) == 2
    assert main(["pretrain", "--out", str(out), "--set", "steps=0"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 2
    assert all(line.startswith("dpvision: error:") for line in error)


def test_cli_lists_the_generators_of_the_library() -> None:
    from dpvision.cli import SYNTHETIC_KINDS as LISTED
    from dpvision.data.synthetic import SYNTHETIC_KINDS

    assert LISTED == SYNTHETIC_KINDS


def test_supervised_pretraining_prints_accuracy_as_train_does(tmp_path, capsys):
    """It prints "test accuracy 93.04 %", as ``train`` does, not a fraction."""
    argv = ["pretrain", "-q", "--objective", "supervised", "--model", "mlp-16", "--steps", "2"]
    argv += ["--dataset", "digits", "--batch-size", "32", "--out", str(tmp_path / "e.pt")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"test accuracy \d{1,3}\.\d\d %, wall time", out), out
