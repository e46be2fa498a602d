"""Saved models (``train --save``, ``predict``, ``evaluate``, ``dpvision.load_model``), the
Python API, the validation split, the cache command and the logging flags."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

import dpvision
from dpvision.cli import main
from dpvision.config import resolve
from dpvision.data import load_dataset
from dpvision.data.inputs import DATASET_STATISTICS
from dpvision.data.splits import validation_split
from dpvision.errors import DPVisionError
from dpvision.runs.train import fit
from model_file_cases import factory_model, recorded_as, write_factory

DPSGD = [
    'method="dp-sgd"',
    'learner.model="mlp-8"',
    "learner.steps=6",
    "learner.batch_size=64",
    "learner.ema_decay=0.9",
]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit:
        code = int(exit.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "sets",
    [
        [],
        ['method="dp-fc"', "learner.epochs=2"],
        ['features="scatternet"', 'preprocessing.kind="private-norm"', "preprocessing.channels=81"],
        ['features="pixels:pool=2"', 'preprocessing.kind="center"'],
        DPSGD,
        [*DPSGD, 'learner.normalization="dataset"'],
    ],
    ids=["dp-ls", "dp-fc", "private-norm", "center", "dp-sgd-ema", "dp-sgd-normalized"],
)
def test_a_saved_model_scores_exactly_as_the_run_did(
    sets: list[str], tmp_path: Path, monkeypatch
) -> None:
    # digits has no published statistics; these stand in (public constants either way).
    monkeypatch.setitem(DATASET_STATISTICS, "digits", ((0.3,), (0.4,)))
    result, model = fit(resolve(None, {}, sets), quiet=True)
    path = tmp_path / "model.safetensors"
    model.save(path)
    loaded = dpvision.load_model(path)
    digits = load_dataset("digits")
    assert loaded.score(digits.test_images, digits.test_labels) == result["test_accuracy"]
    assert loaded.epsilon == result["epsilon"]
    assert loaded.ledger == result["privacy_ledger"]
    assert loaded.config == result["config"]
    assert loaded.predict(digits.test_images[:3]).dtype == np.int64


def test_the_model_file_holds_only_released_values(tmp_path: Path) -> None:
    sets = [
        'features="scatternet"',
        'preprocessing.kind="private-norm"',
        "preprocessing.channels=81",
    ]
    _result, model = fit(resolve(None, {}, sets), quiet=True)
    model.save(tmp_path / "m.safetensors")
    tensors = load_file(tmp_path / "m.safetensors")
    assert sorted(tensors) == ["coef", "intercept", "preprocessing.mean", "preprocessing.var"]
    # The statistics are the noisy released ones, not the exact means of the training data.
    features = np.asarray(
        dpvision.features.extract_features(
            load_dataset("digits").train_images, dpvision.features.parse_feature_spec("scatternet")
        )
    )
    exact_mean = features.reshape(len(features), 81, -1).mean(axis=(0, 2))
    assert not np.allclose(tensors["preprocessing.mean"].numpy(), exact_mean, atol=1e-3)


def test_loading_a_damaged_or_foreign_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}     ")
    with pytest.raises(DPVisionError, match="is not a dpvision model file"):
        dpvision.load_model(bad)
    with pytest.raises(DPVisionError, match="no such model file"):
        dpvision.load_model(tmp_path / "missing.safetensors")


def test_train_save_then_predict_and_evaluate(tmp_path: Path, capsys) -> None:
    model = tmp_path / "model.safetensors"
    code, out, err = _cli(capsys, "train", "--save", str(model), "--json", str(tmp_path / "r.json"))
    assert code == 0, err
    assert f"model written to {model}" in out
    result = json.loads((tmp_path / "r.json").read_text())
    code, out, err = _cli(capsys, "evaluate", str(model))
    assert code == 0, err
    assert f"test accuracy {100 * result['test_accuracy']:.2f} % on digits (359 images)" in out
    digits = load_dataset("digits")
    np.save(tmp_path / "images.npy", digits.test_images[:4])
    code, out, err = _cli(capsys, "predict", str(model), str(tmp_path / "images.npy"))
    assert code == 0, err
    rows = list(csv.reader(out.splitlines()))
    assert rows[0] == ["input", "label", "class"]
    expected = dpvision.load_model(model).predict(digits.test_images[:4])
    assert [int(r[1]) for r in rows[1:]] == expected.tolist()
    from PIL import Image

    folder = tmp_path / "pngs"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(digits.test_images[i, :, :, 0]).save(folder / f"{i}.png")
    out_csv = tmp_path / "p.csv"
    code, out, err = _cli(capsys, "predict", str(model), str(folder), "--out", str(out_csv))
    assert code == 0, err
    assert [int(r[1]) for r in list(csv.reader(out_csv.open()))[1:]] == expected[:3].tolist()
    code, _, err = _cli(capsys, "predict", str(model), str(tmp_path / "r.json"))
    assert code == 2
    assert "Traceback" not in err


def test_python_api_trains_with_tables_as_dicts(tmp_path: Path) -> None:
    run = dpvision.train(method="dp-fc", epsilon=1.0, learner={"epochs": 2}, save=tmp_path / "m")
    assert run.result["config"]["learner"] == {"epochs": 2}
    assert run.epsilon <= 1.0
    assert 0 < run.test_accuracy <= 1
    assert dpvision.load_model(tmp_path / "m").method == "dp-fc"
    assert "test accuracy" in str(run)
    with pytest.raises(DPVisionError, match=r"learner\.epochs must be"):
        dpvision.train(method="dp-fc", learner={"epochs": "many"})


# --- the validation split -------------------------------------------------------------------


def test_validation_split_is_keyed_and_leaves_both_sides() -> None:
    """Each example's side is its keyed hash (tests/data/test_splits.py has the rest)."""
    images = np.arange(200, dtype=np.uint8).reshape(100, 2, 1, 1)
    labels = np.arange(100) % 3
    train, held = validation_split(images, labels, 0.1, b"a" * 32)
    assert 0 < len(held) < 30
    assert sorted({*train, *held}) == list(range(100))
    assert np.array_equal(held, validation_split(images, labels, 0.1, b"a" * 32)[1])
    assert not np.array_equal(held, validation_split(images, labels, 0.1, b"b" * 32)[1])
    with pytest.raises(DPVisionError, match="at least one example"):
        validation_split(images[:3], labels[:3], 0.01, b"a" * 32)


def test_feature_run_holds_out_a_validation_split() -> None:
    result, _ = fit(resolve(None, {}, ["validation_fraction=0.2"]), quiet=True)
    # Binomial(1438, 0.2): each example's side is its own keyed coin.
    assert abs(result["n_validation"] - 0.2 * 1438) < 4 * (1438 * 0.2 * 0.8) ** 0.5
    assert result["n_train"] == 1438 - result["n_validation"]
    assert 0 < result["validation_accuracy"] <= 1
    assert result["config"]["validation_fraction"] == 0.2


def test_dpsgd_evaluates_on_validation_and_touches_test_once() -> None:
    sets = [*DPSGD, "validation_fraction=0.25", "learner.eval_every=2"]
    result, _ = fit(resolve(None, {}, sets), quiet=True)
    *during, final = result["history"]
    assert [entry["step"] for entry in during] == [2, 4]
    assert all("test_accuracy" not in entry and "validation_accuracy" in entry for entry in during)
    assert "test_accuracy" in final
    assert "validation_accuracy_ema" in final
    assert result["validation_accuracy"] == final["validation_accuracy_ema"]
    assert result["n_train"] + result["n_validation"] == 1438


@pytest.mark.parametrize("value", ["1", "-0.1", "1.5"])
def test_validation_fraction_out_of_range_is_refused(value: str) -> None:
    with pytest.raises(DPVisionError, match="validation_fraction must be in"):
        resolve(None, {}, [f"validation_fraction={value}"])


# --- cache and logging ----------------------------------------------------------------------


def test_cache_list_and_clear(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("DPVISION_CACHE", str(tmp_path / "cache"))
    assert _cli(capsys, "train", "--features", "pixels:pool=2", "-q")[0] == 0
    assert _cli(capsys, "train", "-q")[0] == 0
    (tmp_path / "cache" / ".digits-x-0.train.npy.abc.tmp").write_bytes(b"half")
    code, out, _ = _cli(capsys, "cache", "list")
    assert code == 0
    assert "3 entries" in out
    assert "pixels:pool=2" in out
    assert "incomplete" in out
    code, out, _ = _cli(capsys, "cache", "clear", "--dataset", "digits", "--dry-run")
    assert "would delete 3 feature-cache entries" in out
    assert len(list((tmp_path / "cache").iterdir())) == 7
    code, out, _ = _cli(capsys, "cache", "clear")
    assert code == 0
    assert "deleted 3 feature-cache entries" in out
    assert not list((tmp_path / "cache").iterdir())


def test_quiet_verbose_and_log_file(tmp_path: Path, capsys) -> None:
    log = tmp_path / "run.log"
    fast = ("--method", "dp-ls")  # the logging, not the recipe, is under test
    code, out, err = _cli(capsys, "train", *fast, "--log-file", str(log))
    assert code == 0
    assert "[dpvision] loading dataset digits" in err
    text = log.read_text()
    assert "INFO loading dataset digits" in text
    assert "DEBUG dpvision" in text
    code, out, err = _cli(capsys, "train", *fast, "-q")
    assert code == 0
    assert err == ""
    assert "test accuracy" in out
    code, out, err = _cli(capsys, "-v", "train", *fast)
    assert code == 0
    assert "[dpvision] dpvision " in err


# --- class probabilities, model arguments, model files that travel (issue 39, items 4–6) ---


@pytest.mark.parametrize(
    "sets", [[], ['method="dp-newton"'], DPSGD], ids=["dp-ls", "dp-newton", "dp-sgd"]
)
def test_predict_proba_rows_sum_to_one_and_rank_as_predict(sets: list[str], tmp_path: Path) -> None:
    _result, model = fit(resolve(None, {}, sets), quiet=True)
    model.save(tmp_path / "m.safetensors")
    loaded = dpvision.load_model(tmp_path / "m.safetensors")
    images = load_dataset("digits").test_images[:50]
    proba = loaded.predict_proba(images)
    assert proba.shape == (50, 10)
    assert proba.dtype == np.float64
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert (proba >= 0).all()
    np.testing.assert_array_equal(proba.argmax(axis=1), loaded.predict(images))
    np.testing.assert_array_equal(proba, model.predict_proba(images))
    # The softmax of the scores: the log-odds of two classes are their score difference.
    scores = loaded.decision_function(images)
    np.testing.assert_allclose(
        np.log(proba[:, 1] / proba[:, 0]), scores[:, 1] - scores[:, 0], rtol=1e-9, atol=1e-9
    )


def test_learners_predict_proba_is_the_softmax_of_their_scores() -> None:
    from dpvision.learners import DPLeastSquares

    digits = load_dataset("digits")
    x = digits.train_images.reshape(len(digits.train_images), -1) / 255.0
    learner = DPLeastSquares(target_epsilon=1.0, num_classes=10, random_state=0)
    learner.fit(x, digits.train_labels)
    proba = learner.predict_proba(x[:20])
    scores = learner.decision_function(x[:20])
    expected = np.exp(scores - scores.max(1, keepdims=True))
    np.testing.assert_allclose(proba, expected / expected.sum(1, keepdims=True), rtol=1e-12)
    np.testing.assert_array_equal(proba.argmax(1), learner.predict(x[:20]))
    # Large scores do not overflow.
    learner.coef_ = learner.coef_ * 1e6
    assert np.isfinite(learner.predict_proba(x[:20])).all()


def test_a_python_factory_model_file_loads_from_any_directory(tmp_path: Path, monkeypatch) -> None:
    work = tmp_path / "project"
    work.mkdir()
    write_factory(work)
    monkeypatch.chdir(work)
    saved = factory_model("python:net.py:Net", work / "m.safetensors")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = dpvision.load_model(work / "m.safetensors")
    assert loaded.model_name == f"python:{work.resolve() / 'net.py'}:Net"
    assert loaded.model_args == {"img_size": 8}  # the same architecture is rebuilt
    images = load_dataset("digits").test_images[:5]
    np.testing.assert_array_equal(loaded.decision_function(images), saved.decision_function(images))


def test_a_model_file_whose_factory_file_is_gone_names_the_file(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    factory = write_factory(tmp_path)
    factory_model("python:net.py:Net", tmp_path / "m.safetensors")
    factory.unlink()
    with pytest.raises(DPVisionError) as error:
        dpvision.load_model(tmp_path / "m.safetensors")
    message = str(error.value)
    assert "damaged" not in message
    assert f"the file {factory.resolve()} is missing" in message


def test_a_timm_model_file_without_the_models_extra_names_it(tmp_path: Path, monkeypatch) -> None:
    import dpvision.models.sources as sources

    monkeypatch.chdir(tmp_path)
    write_factory(tmp_path)
    factory_model("python:net.py:Net", tmp_path / "m.safetensors")
    recorded_as(tmp_path / "m.safetensors", tmp_path / "timm.safetensors", "timm:resnet18")
    monkeypatch.setattr(sources, "is_installed", lambda package: package != "timm")
    with pytest.raises(DPVisionError) as error:
        dpvision.load_model(tmp_path / "timm.safetensors")
    message = str(error.value)
    assert "damaged" not in message
    assert "needs timm (timm:resnet18)" in message
    assert "docs/install.md" in message  # its own environment, not a pip line that replaces torch
    assert "would replace torch" in message


def test_a_network_that_cannot_take_the_images_is_refused_naming_both_fixes(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_factory(tmp_path)
    sets = ['method="dp-sgd"', 'learner.model="python:net.py:Net"', "learner.steps=2"]
    with pytest.raises(DPVisionError) as error:
        fit(resolve(None, {}, sets), quiet=True)
    message = str(error.value)
    assert "python:net.py:Net cannot take images of 8×8" in message
    assert "doesn't match model (16)" in message
    assert "set image_size" in message
    assert "learner.model_args = {img_size = 8}" in message
    # The fix it names works, and the argument reaches the saved model.
    result, model = fit(resolve(None, {}, [*sets, "learner.model_args.img_size=8"]), quiet=True)
    assert result["config"]["learner"]["model_args"] == {"img_size": 8}
    model.save(tmp_path / "m.safetensors")
    loaded = dpvision.load_model(tmp_path / "m.safetensors")
    assert loaded.score(*_digits_test()) == result["test_accuracy"]


def _digits_test() -> tuple[np.ndarray, np.ndarray]:
    digits = load_dataset("digits")
    return digits.test_images, digits.test_labels


@pytest.mark.parametrize(
    ("model_args", "model", "match"),
    [
        ("{img_size = 8}", "mlp-8", "mlp-8 takes none"),
        ("{img_size = 8}", "auto", "set learner.model too"),
        ("{num_classes = 3}", "python:net.py:Net", "model_args.num_classes is set by dpvision"),
        ("{depth = nan}", "python:net.py:Net", "must be a number, string"),
        ("{bogus = 1}", "python:net.py:Net", "takes no argument 'bogus'"),
        ("5", "python:net.py:Net", "must be a table"),
    ],
)
def test_bad_model_args_are_one_line_errors_before_any_work(
    model_args: str, model: str, match: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_factory(tmp_path)
    sets = ['method="dp-sgd"', f'learner.model="{model}"', f"learner.model_args={model_args}"]
    with pytest.raises(DPVisionError, match=match):
        _resolve_and_fit(sets)


def _resolve_and_fit(sets: list[str]) -> None:
    fit(resolve(None, {}, sets), quiet=True)  # a factory's arguments are checked when built


def test_model_args_of_an_older_run_settings_are_absent_when_empty() -> None:
    from dpvision.training.options import DPSGDOptions

    # Checkpoints written before learner.model_args existed still resume.
    assert "model_args" not in DPSGDOptions.from_dict({"model": "mlp-8"}).run_settings()
    assert DPSGDOptions.from_dict(
        {"model": "python:torch.nn:Linear", "model_args": {"img_size": 32}}
    ).run_settings()["model_args"] == {"img_size": 32}
