"""The configs of Mehta et al. (seed 000): one per cell of Tables 2-4, on precomputed features.

The features (ViT-G/14 on JFT-3B, ViT-B/16 on ImageNet-21k/1k) are not here, so each method
and training length runs on a small stand-in folder in the same format instead (``--set
features=...``), with the config's own ε, δ, clipping, optimizer and length.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpvision.config import resolve
from dpvision.runs.train import run_training

ROOT = Path(__file__).parent.parent / "configs" / "seed000"
CONFIGS = sorted(ROOT.rglob("*.toml"))
EPSILONS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 4.0, 8.0)
# (dataset, features, paper method, epochs) of every row of Tables 2-4.
ROWS = [
    (dataset, features, method, epochs)
    for dataset, pretrainings in (
        ("imagenet", ("vit-b16-i21k", "vit-g14-jft3b")),
        ("cifar10", ("vit-b16-i1k", "vit-b16-i21k", "vit-g14-jft3b")),
        ("cifar100", ("vit-b16-i1k", "vit-b16-i21k", "vit-g14-jft3b")),
    )
    for features in pretrainings
    for method, epochs in (
        ("dp_ls", 1),
        ("dp_newton", 1),
        ("dp_newton", 10),
        ("dp_fc", 1),
        ("dp_fc", 10),
        ("dp_sgd_linear", 1),  # DP-Adam
        ("dp_sgd_linear", 10),
        ("dp_sgd_linear", 100),
    )
]


def _name(dataset: str, features: str, method: str, epochs: int, epsilon: float) -> Path:
    eps = f"{epsilon:g}".replace(".", "p")
    return ROOT / dataset / f"{features.replace('-', '_')}_{method}_e{epochs}_eps{eps}.toml"


def test_there_is_one_config_per_published_cell():
    expected = {_name(*row, epsilon) for row in ROWS for epsilon in EPSILONS}
    assert len(expected) == 512
    assert set(CONFIGS) == expected


def test_the_committed_configs_are_the_generators_output(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("make_configs", ROOT / "make_configs.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.write_all(tmp_path)
    assert len(written) == 512
    for path in written:
        committed = ROOT / path.relative_to(tmp_path)
        assert path.read_text() == committed.read_text(), committed


# Cells typed from the paper by hand (Tables 1-4), independently of the generator's rows.
PUBLISHED = [
    ("imagenet", "vit-g14-jft3b", "dp_fc", 10, 8.0, 0.880),
    ("imagenet", "vit-g14-jft3b", "dp_ls", 1, 0.01, 0.824),
    ("imagenet", "vit-b16-i21k", "dp_newton", 10, 0.01, 0.665),
    ("imagenet", "vit-b16-i21k", "dp_sgd_linear", 1, 0.5, None),  # printed '-'
    ("cifar10", "vit-g14-jft3b", "dp_ls", 1, 0.01, 0.974),
    ("cifar10", "vit-b16-i1k", "dp_newton", 10, 4.0, 0.886),
    ("cifar10", "vit-b16-i21k", "dp_ls", 1, 2.0, 0.955),
    ("cifar100", "vit-b16-i1k", "dp_sgd_linear", 100, 0.1, None),
    ("cifar100", "vit-b16-i1k", "dp_sgd_linear", 10, 0.05, 0.200),
    ("cifar100", "vit-g14-jft3b", "dp_fc", 10, 8.0, 0.901),
    ("cifar100", "vit-b16-i21k", "dp_fc", 10, 1.0, 0.827),
]


@pytest.mark.parametrize(
    ("dataset", "features", "method", "epochs", "epsilon", "accuracy"), PUBLISHED
)
def test_published_numbers(dataset, features, method, epochs, epsilon, accuracy):
    reference = resolve(_name(dataset, features, method, epochs, epsilon)).reference
    assert reference["epsilon"] == epsilon
    if accuracy is None:
        assert "accuracy" not in reference
        assert "band" not in reference
    else:
        assert reference["accuracy"] == pytest.approx(accuracy)
        assert reference["band"] == pytest.approx([accuracy - 0.02, accuracy + 0.02])


def test_every_config_states_the_papers_setup():
    methods = {
        "dp_ls": "dp-ls",
        "dp_newton": "dp-newton",
        "dp_fc": "dp-fc",
        "dp_sgd_linear": "dp-sgd-linear",
    }
    for dataset, features, method, epochs in ROWS:
        for epsilon in EPSILONS:
            path = _name(dataset, features, method, epochs, epsilon)
            config = resolve(path)
            assert (config.dataset, config.method) == (dataset, methods[method]), path
            assert config.features == f"precomputed:path=features/{dataset}/{features}"
            assert config.epsilon == epsilon
            assert config.delta == (8e-7 if dataset == "imagenet" else 1e-5)  # App. D.1
            # Tables 6-9: C = 1 for JFT features of ImageNet, 0.005 everywhere else.
            clip = 1.0 if (dataset, features) == ("imagenet", "vit-g14-jft3b") else 0.005
            assert config.learner["clip_norm"] == clip, path
            length = {"dp_ls": None, "dp_newton": "iterations"}.get(method, "epochs")
            if length is not None:
                assert config.learner[length] == epochs, path
            if method == "dp_sgd_linear":  # DP-Adam: sigmoid loss, bias from -10
                assert config.learner["optimizer"] == "adam"
                assert (config.learner["loss"], config.learner["bias_init"]) == ("sigmoid", -10)
                assert "batch_size" not in config.learner  # full batch
            if method == "dp_fc":
                assert config.learner["covariance_clip_norm"] == clip
                assert config.learner["bias"] == -10
            reference = config.reference
            assert reference["source"].startswith("Mehta et al. 2022, Table ")
            assert f"features/{dataset}/{features}" in reference["needs"]
            if "accuracy" in reference:
                low, high = reference["band"]
                assert low <= reference["accuracy"] <= high


def _stand_in(folder: Path, classes: int) -> Path:
    rng = np.random.default_rng(classes)
    centres = rng.normal(size=(classes, 16))
    folder.mkdir()
    for split, n in (("train", 400), ("test", 100)):
        labels = rng.integers(0, classes, n)
        np.save(folder / f"x_{split}.npy", (centres[labels] + rng.normal(size=(n, 16))) * 20)
        np.save(folder / f"y_{split}.npy", labels)
    return folder


# One config per method and length (8 rows), spread over the three datasets and ε.
SMOKE = [
    ("imagenet", "vit-g14-jft3b", "dp_ls", 1, 0.01, 3),
    ("cifar100", "vit-b16-i21k", "dp_newton", 1, 8.0, 2),
    ("cifar10", "vit-b16-i1k", "dp_newton", 10, 0.5, 20),
    ("imagenet", "vit-b16-i21k", "dp_fc", 1, 1.0, 2),
    ("cifar10", "vit-g14-jft3b", "dp_fc", 10, 0.05, 11),
    ("cifar100", "vit-b16-i1k", "dp_sgd_linear", 1, 2.0, 1),
    ("imagenet", "vit-g14-jft3b", "dp_sgd_linear", 10, 4.0, 10),
    ("cifar10", "vit-b16-i21k", "dp_sgd_linear", 100, 0.1, 100),
]


@pytest.mark.parametrize(("dataset", "features", "method", "epochs", "epsilon", "releases"), SMOKE)
def test_each_method_runs_on_stand_in_features(
    dataset, features, method, epochs, epsilon, releases, tmp_path: Path
):
    classes = {"imagenet": 1000, "cifar10": 10, "cifar100": 100}[dataset]
    folder = _stand_in(tmp_path / "features", classes)
    path = _name(dataset, features, method, epochs, epsilon)
    config = resolve(path, None, [f"features=precomputed:path={folder}"])
    result = run_training(config, quiet=True)
    assert result["dataset"] == dataset
    assert result["steps"] == releases  # the noisy releases the method makes in E epochs
    assert result["delta"] == resolve(path).delta
    assert 0 < result["epsilon"] <= epsilon


def test_without_the_features_a_config_says_what_it_needs(tmp_path: Path):
    path = _name("cifar10", "vit-b16-i21k", "dp_fc", 10, 1.0)
    done = subprocess.run(
        [sys.executable, "-m", "dpvision", "train", "--config", str(path)],
        capture_output=True, text=True, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    message = done.stderr.strip().splitlines()[-1]
    assert "features/cifar10/vit-b16-i21k: no such folder" in message
    assert "this config needs 768-d features of CIFAR-10" in message
    assert f"dpvision train --config {path}" in message
    assert "Traceback" not in done.stderr
