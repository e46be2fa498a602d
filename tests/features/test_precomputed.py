"""``precomputed:path=DIR``: feature vectors made elsewhere, read from four ``.npy`` files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from features_testing import isolate_cache

from dpvision.config import TrainConfig, validate
from dpvision.errors import DPVisionError
from dpvision.features import FeatureSpec, format_feature_spec, parse_feature_spec
from dpvision.features.precomputed import load_feature_files
from dpvision.learners import DPLeastSquares
from dpvision.runs.train import run_training


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return isolate_cache(tmp_path, monkeypatch)


def _write(folder: Path, n: int = 300, m: int = 120, d: int = 12, classes: int = 4) -> Path:
    """Separable class clusters, as an extractor's embeddings would be."""
    rng = np.random.default_rng(0)
    centres = 3 * rng.normal(size=(classes, d))
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", n), ("test", m)):
        labels = rng.integers(0, classes, rows)
        features = (centres[labels] + rng.normal(size=(rows, d))).astype(np.float32)
        np.save(folder / f"x_{split}.npy", features)
        np.save(folder / f"y_{split}.npy", labels)
    return folder


def test_spec_takes_a_path_and_nothing_else():
    spec = parse_feature_spec("precomputed:path=/data/vit")
    assert spec == FeatureSpec("precomputed", path="/data/vit")
    assert format_feature_spec(spec) == "precomputed:path=/data/vit"
    with pytest.raises(DPVisionError, match="need their folder"):
        parse_feature_spec("precomputed")
    for option in ("pool=2", "projection_dim=8", "grid=2", "norm=1", "layers=blocks"):
        with pytest.raises(DPVisionError, match="does not apply to precomputed"):
            parse_feature_spec(f"precomputed:path=/x,{option}")
    with pytest.raises(DPVisionError, match="scatternet features only"):
        parse_feature_spec("precomputed:path=/x,scales=3")


def test_files_are_memory_mapped_and_labelled(tmp_path: Path):
    folder = _write(tmp_path / "feats")
    files = load_feature_files(folder, "CIFAR-10")
    assert files.name == "cifar10"  # a dataset dpvision knows: its canonical name ...
    assert files.num_classes == 10  # ... and its classes, though the labels only reach 3
    assert isinstance(files.train, np.memmap)
    assert not files.train.flags.writeable
    assert (files.num_train, files.num_test, files.train.shape[1]) == (300, 120, 12)
    assert files.train_labels.dtype == np.int64
    other = load_feature_files(folder, "imagenet", num_classes=1000)  # no images of it here
    assert (other.name, other.num_classes) == ("imagenet", 1000)
    with pytest.raises(DPVisionError, match="need num_classes"):  # never max(label) + 1
        load_feature_files(folder, "imagenet")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: (f / "y_test.npy").unlink(), "y_test.npy: no such file"),
        (lambda f: (f / "x_train.npy").write_bytes(b"garbage"), "not a readable .npy"),
        (
            lambda f: np.save(f / "x_train.npy", np.array([{"a": 1}], dtype=object)),
            "not a readable .npy",
        ),
        (
            lambda f: np.save(f / "x_train.npy", np.zeros((300, 12), dtype=np.int32)),
            "2-d float16/32/64",
        ),
        (lambda f: np.save(f / "x_test.npy", np.zeros((120, 3, 4))), "2-d float16/32/64"),
        (lambda f: np.save(f / "x_test.npy", np.zeros((120, 11))), "both must come from one"),
        (lambda f: np.save(f / "y_train.npy", np.zeros(299, dtype=int)), "store one label"),
        (lambda f: np.save(f / "y_train.npy", np.full(300, 0.5)), "labels must be integers"),
        (lambda f: np.save(f / "y_test.npy", np.full(120, 10)), "has 10 classes"),
        (lambda f: np.save(f / "y_test.npy", np.full(120, -1)), "must be >= 0"),
        (
            lambda f: (f / "x_test.npy").write_bytes((f / "bundle.npz").read_bytes()),
            "an .npz archive",
        ),
    ],
)
def test_bad_folders_get_one_line_errors(tmp_path: Path, damage, message):
    folder = _write(tmp_path / "feats")
    np.savez(folder / "bundle.npz", a=np.zeros(3))
    damage(folder)
    with pytest.raises(DPVisionError, match=message) as error:
        load_feature_files(folder, "cifar10")
    assert "\n" not in str(error.value)


def test_missing_folder_and_path_datasets_are_refused(tmp_path: Path):
    with pytest.raises(DPVisionError, match="no such folder"):
        load_feature_files(tmp_path / "absent", "cifar10")
    folder = _write(tmp_path / "feats")
    for name in ("npy:/data", "imagefolder:x", "../up"):
        with pytest.raises(DPVisionError, match="not a path"):
            load_feature_files(folder, name)


def test_training_reads_the_files_and_matches_the_learner_on_the_same_arrays(tmp_path: Path):
    folder = _write(tmp_path / "feats")
    config = validate(
        TrainConfig(
            dataset="cifar10",
            method="dp-ls",
            features=f"precomputed:path={folder}",
            epsilon=1.0,
            seed=3,
            secret_seed=3,
            learner={"clip_norm": 5.0},
        )
    )
    result = run_training(config, quiet=True)
    assert (result["dataset"], result["n_train"], result["n_test"]) == ("cifar10", 300, 120)
    assert result["num_features"] == 12
    assert result["epsilon"] <= 1.0
    # The same learner on the same arrays, with the noise stream the pipeline gives it
    # (the run's secret randomness, replayed from its secret seed and keyed by the rows),
    # gives the same model.
    x, y = np.load(folder / "x_train.npy"), np.load(folder / "y_train.npy")
    secret = config.secret_randomness().bind_rows(x, y.astype(np.int64))
    direct = DPLeastSquares(
        target_epsilon=1.0, clip_norm=5.0, random_state=secret.seed("learner"), num_classes=10
    )
    direct.fit(x, y)
    accuracy = direct.score(np.load(folder / "x_test.npy"), np.load(folder / "y_test.npy"))
    assert result["test_accuracy"] == pytest.approx(accuracy)
    assert result["test_accuracy"] > 0.9  # separable clusters: the run learned something


def test_image_methods_and_the_audit_refuse_precomputed_features(tmp_path: Path):
    folder = _write(tmp_path / "feats")
    with pytest.raises(DPVisionError, match="precomputed feature vectors serve"):
        validate(TrainConfig(method="dp-sgd", features=f"precomputed:path={folder}", epsilon=1))
    done = subprocess.run(
        [sys.executable, "-m", "dpvision", "audit", "--method", "dp-ls", "--epsilon", "1",
         "--features", f"precomputed:path={folder}", "--runs", "10"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "canary image" in done.stderr
