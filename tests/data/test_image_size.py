"""Images of any size (issue 39, item 3): ``image_size`` with timm's crop and interpolation
choices, applied alike in ``train``, ``predict``, ``evaluate`` and the feature cache's key;
the seeded, neighbour-stable split of a single ``imagefolder:ROOT/<class>/`` tree; and
``dpvision predict --proba``."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from dpvision.cli import main
from dpvision.config import resolve
from dpvision.data import load_dataset
from dpvision.data.imagefolder import read_images
from dpvision.data.resize import ImageGeometry
from dpvision.data.splits import tree_split
from dpvision.errors import DPVisionError
from dpvision.features.cache import cache_key
from dpvision.features.spec import parse_feature_spec
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.training.options import names_before_rename


def _shape_image(rng: np.random.Generator, kind: str, size: tuple[int, int]) -> Image.Image:
    """A light circle or square on a dark background, ``size`` = (width, height)."""
    width, height = size
    image = Image.new("RGB", size, tuple(int(v) for v in rng.integers(0, 60, 3)))
    box = (width * 0.2, height * 0.2, width * 0.8, height * 0.8)
    draw = ImageDraw.Draw(image)
    (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=(230, 230, 230))
    return image


def _tree(root: Path, per_class: int = 16, seed: int = 0) -> Path:
    """``root/circle/*`` and ``root/square/*``: images of mixed sizes, PNGs and JPEGs, no
    ``train/`` or ``test/`` folder."""
    rng = np.random.default_rng(seed)
    for kind in ("circle", "square"):
        (root / kind).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            size = (int(rng.integers(20, 90)), int(rng.integers(20, 90)))
            image = _shape_image(rng, kind, size)
            if i % 2:
                image.save(root / kind / f"{i:03d}.png")
            else:
                image.save(root / kind / f"{i:03d}.jpg", quality=95)
    return root


def _rows(images: np.ndarray) -> set[bytes]:
    return {image.tobytes() for image in images}


# --- the geometry ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "pct", "scaled"),
    [
        ("center", 1.0, (8, 16)),  # the shorter side fits, the centre is cropped
        ("squash", 1.0, (8, 8)),  # the aspect ratio is dropped
        ("border", 1.0, (4, 8)),  # the longer side fits, the rest padded
        ("center", 0.5, (16, 32)),  # resize to 16 / 0.5, keep the centre 8
    ],
)
def test_each_crop_mode_resizes_as_timm_says(mode, pct, scaled):
    geometry = ImageGeometry((8, 8), crop_mode=mode, crop_pct=pct)
    assert geometry.scale_size((20, 40)) == scaled
    image = Image.fromarray(np.full((20, 40, 3), 200, np.uint8))
    out = np.asarray(geometry.apply(image))
    assert out.shape == (8, 8, 3)
    if mode == "border":  # padded with black above and below, the image in the middle rows
        assert (out[:2] == 0).all()
        assert (out[-2:] == 0).all()
        assert (out[2:6] == 200).all()
    else:
        assert (out == 200).all()


def test_a_whole_image_and_its_channels_resize_alike():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (3, 13, 21, 3), dtype=np.uint8)
    geometry = ImageGeometry((9, 7), interpolation="bicubic", crop_pct=0.875)
    whole = np.stack([np.asarray(geometry.apply(Image.fromarray(image))) for image in images])
    np.testing.assert_array_equal(geometry.apply_array(images), whole)


def test_an_image_already_at_the_size_is_unchanged():
    images = np.random.default_rng(2).integers(0, 256, (2, 8, 8, 1), dtype=np.uint8)
    np.testing.assert_array_equal(ImageGeometry((8, 8)).apply_array(images), images)


# --- a single tree, any sizes ---------------------------------------------------------------


def test_a_mixed_size_tree_without_train_and_test_loads_at_the_image_size(tmp_path):
    root = _tree(tmp_path / "shapes")
    name = f"imagefolder:{root}"
    with pytest.raises(DPVisionError, match=r"not all of one size.*--set image_size=64") as error:
        load_dataset(name)  # the API without a size: mixed sizes refused, no file named
    assert ".png" not in str(error.value)
    assert ".jpg" not in str(error.value)
    dataset = load_dataset(name, geometry=ImageGeometry((64, 64)))
    assert dataset.class_names == ("circle", "square")
    assert dataset.image_shape == (64, 64, 3)
    assert dataset.num_train + dataset.num_test == 32
    assert dataset.num_test > 0
    assert dataset.num_train > 0
    assert dataset.geometry == ImageGeometry((64, 64)).describe()


def test_adding_one_image_anywhere_moves_no_other_image(tmp_path):
    root = _tree(tmp_path / "shapes", per_class=20)
    geometry = ImageGeometry((16, 16))
    name = f"imagefolder:{root}"
    before = load_dataset(name, geometry=geometry, split_seed=3)
    for kind, stem in (("circle", "000a"), ("square", "zzz"), ("circle", "010b")):
        rng = np.random.default_rng(len(stem))
        _shape_image(rng, kind, (33, 47)).save(root / kind / f"{stem}.png")
        after = load_dataset(name, geometry=geometry, split_seed=3)
        assert after.num_train + after.num_test == before.num_train + before.num_test + 1
        assert _rows(before.train_images) <= _rows(after.train_images)
        assert _rows(before.test_images) <= _rows(after.test_images)
        before = after
    other_seed = load_dataset(name, geometry=geometry, split_seed=4)
    assert _rows(other_seed.test_images) != _rows(before.test_images)  # seeded


def test_the_split_reads_each_file_alone(tmp_path):
    paths = []
    for i in range(200):
        paths.append(tmp_path / f"{i}.bin")
        paths[-1].write_bytes(i.to_bytes(2, "little"))
    names = ["a"] * len(paths)
    train, test = tree_split(paths, names, 0.2, split_seed=0)
    held = {paths[i] for i in test}
    assert 20 < len(held) < 60  # about 0.2 · 200
    # the files in another order, with one more in the middle: the same files are held out
    extra = tmp_path / "extra.bin"
    extra.write_bytes(b"new")
    shuffled = [*paths[::-1][:100], extra, *paths[::-1][100:]]
    _, test2 = tree_split(shuffled, [*names, "a"], 0.2, split_seed=0)
    assert {shuffled[i] for i in test2} - {extra} == held
    # exact copies of a file (of the same class) land on its side
    copies = [tmp_path / "copy_test.bin", tmp_path / "copy_train.bin"]
    copies[0].write_bytes(paths[test[0]].read_bytes())
    copies[1].write_bytes(paths[train[0]].read_bytes())
    _, test3 = tree_split([*paths, *copies], [*names, "a", "a"], 0.2, split_seed=0)
    assert len(paths) in test3
    assert len(paths) + 1 not in test3


def test_test_fraction_is_for_a_single_tree_only(tmp_path):
    root = tmp_path / "ds"
    for split in ("train", "test"):
        (root / split / "a").mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(root / split / "a" / "x.png")
    with pytest.raises(DPVisionError, match="has its own train/ and test/ folders"):
        load_dataset(f"imagefolder:{root}", test_fraction=0.3)
    with pytest.raises(DPVisionError, match="test_fraction splits a single imagefolder"):
        load_dataset("digits", test_fraction=0.3)
    with pytest.raises(DPVisionError, match=r"split_seed splits a single .* leave split_seed"):
        load_dataset(f"imagefolder:{root}", split_seed=1)
    with pytest.raises(DPVisionError, match="split_seed splits a single imagefolder"):
        load_dataset("digits", split_seed=1)


def test_built_in_array_datasets_are_resized_too():
    dataset = load_dataset("digits", geometry=ImageGeometry((16, 12)))
    assert dataset.image_shape == (16, 12, 1)
    assert dataset.num_train == load_dataset("digits").num_train


# --- the same geometry everywhere -----------------------------------------------------------


def test_the_cache_key_names_the_geometry(tmp_path):
    root = _tree(tmp_path / "shapes", per_class=12)
    spec = parse_feature_spec("pixels")
    keys = [
        cache_key(load_dataset(f"imagefolder:{root}", geometry=geometry), spec)
        for geometry in (
            ImageGeometry((16, 16)),
            ImageGeometry((16, 16), interpolation="nearest"),
            ImageGeometry((16, 16), crop_mode="squash"),
            ImageGeometry((12, 16)),
        )
    ]
    assert len({json.dumps(key, sort_keys=True) for key in keys}) == 4
    assert keys[1]["geometry"]["interpolation"] == "nearest"
    assert "geometry" not in cache_key(load_dataset("digits"), spec)  # older keys unchanged


def test_predict_reads_files_as_training_loaded_them(tmp_path):
    root = _tree(tmp_path / "shapes", per_class=6)
    geometry = ImageGeometry((24, 24), crop_mode="border", interpolation="bicubic")
    dataset = load_dataset(f"imagefolder:{root}", geometry=geometry)
    files = sorted(root.rglob("*.*"))
    decoded = read_images(files, channels=3, geometry=geometry)
    assert _rows(decoded) == _rows(dataset.train_images) | _rows(dataset.test_images)


def test_train_predict_proba_and_evaluate_on_own_images_of_any_size(tmp_path, capsys):
    """Issue 39's acceptance: mixed-size JPEGs and PNGs with no test/ folder train at
    image_size = 64, and ``predict --proba`` works on a new, larger image."""
    root = _tree(tmp_path / "shapes", per_class=16)
    model, result = tmp_path / "m.safetensors", tmp_path / "r.json"
    argv = ["train", "--dataset", f"imagefolder:{root}", "--method", "dp-sgd-linear"]
    argv += ["--features", "pixels", "--set", "image_size=64", "--set", "learner.epochs=3"]
    code = main([*argv, "--json", str(result), "--save", str(model)])
    assert code == 0, capsys.readouterr().err
    released = json.loads(result.read_text())
    assert released["config"]["image_size"] == 64
    assert released["n_train"] + released["n_test"] == 32
    capsys.readouterr()

    big = tmp_path / "new.png"
    _shape_image(np.random.default_rng(9), "circle", (300, 220)).save(big)
    assert main(["predict", str(model), str(big), "--proba"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["input", "label", "class", "p_circle", "p_square"]
    probabilities = [float(p) for p in rows[1][3:]]
    assert sum(probabilities) == pytest.approx(1.0, abs=1e-12)
    assert rows[1][2] == ("circle", "square")[int(np.argmax(probabilities))]
    assert int(rows[1][1]) == int(np.argmax(probabilities))

    assert main(["predict", str(model), str(root)]) == 0  # without --proba: labels only
    assert capsys.readouterr().out.splitlines()[0] == "input,label,class"

    assert main(["evaluate", str(model), "--json", str(tmp_path / "e.json")]) == 0
    evaluated = json.loads((tmp_path / "e.json").read_text())
    assert evaluated["n"] == released["n_test"]  # the same split, the same size
    assert evaluated["accuracy"] == pytest.approx(released["test_accuracy"])


# --- the config -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("image_size=0", "image_size must be a whole number in [1, 4096]"),
        ("image_size=[1, 2, 3]", "image_size must be"),
        ("image_size=abc", "image_size must be"),
        ("image_size=5000", "image_size must be a whole number in [1, 4096]"),
        ("crop_mode=middle", "unknown crop_mode 'middle'; choose one of: center"),
        ("crop_pct=0", "crop_pct must be in (0, 1]"),
        ("crop_pct=1.5", "crop_pct must be in (0, 1]"),
        ("interpolation=cubic", "unknown interpolation 'cubic'"),
        ("test_fraction=1", "test_fraction must be in (0, 1)"),
        ("test_fraction=0.3", "test_fraction splits a single imagefolder: tree"),
        ("crop_pct=0.9", "crop_pct needs image_size"),
    ],
)
def test_a_bad_geometry_is_one_line_before_any_work(item, message, tmp_path, capsys):
    code = main(["train", "--set", item, "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


def test_new_options_at_their_defaults_leave_the_secret_context_as_it_was():
    """A ``secret_seed`` replays runs published before these options existed."""
    config = dataclasses.replace(resolve(), secret_seed=7)
    before = {
        k: v
        for k, v in config.to_dict().items()
        if k not in ("data_dir", "device", "image_size", "crop_mode", "crop_pct", "interpolation")
        and k not in ("test_fraction", "leave_out_rows_of", "split_seed")
    }
    before["learner"] = names_before_rename(before["learner"])
    old = SecretRandomness(7, context=json.dumps(before, sort_keys=True, default=str))
    assert config.secret_randomness().split_key() == old.split_key()
    resized = dataclasses.replace(config, image_size=16)
    assert resized.secret_randomness().split_key() != old.split_key()


def test_checkpoints_written_before_the_geometry_options_still_resume():
    """The run settings a checkpoint is matched by leave the new options out at their
    defaults (as the secret context does), and keep them once they are set."""
    from dpvision.config import TrainConfig
    from dpvision.runs.schedule import run_settings

    learner = {"model": "mlp-8", "steps": 2, "batch_size": 64}
    added = ("image_size", "crop_mode", "crop_pct", "interpolation", "test_fraction", "split_seed")
    default = run_settings(TrainConfig(method="dp-sgd", learner=learner))
    assert not [key for key in added if key in default]
    resized = run_settings(TrainConfig(method="dp-sgd", learner=learner, image_size=16))
    assert resized["image_size"] == 16


def test_weights_that_record_their_rows_are_refused_when_the_rows_have_no_native_copy():
    """Pre-training records the digests of its rows at their own size: rows resized as
    each file was decoded (an image folder) would match none, so the rows the weights saw
    would pass as private ones: refused."""
    from dpvision.errors import DPVisionError
    from dpvision.training.supervised import public_rows_record, rows_trained_on

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (20, 8, 8, 1), dtype=np.uint8)
    labels = np.arange(20) % 2
    record = {**public_rows_record(images, labels), "public_fraction": 0.0, "n_images": 20}
    with pytest.raises(DPVisionError, match="resizes each image as it is decoded"):
        rows_trained_on(record, "digits", images, labels, 0.0, what="w.pt", resized=True)
    assert (
        len(
            rows_trained_on(
                record, "digits", images, labels, 0.0, what="w.pt", allow=True, resized=True
            )
        )
        == 0
    )


def test_resized_arrays_are_matched_to_weights_by_their_native_rows():
    """A resized array dataset keeps its rows at their own size: weights pre-trained on
    another dataset pass (the issue-40 journey: Fashion-MNIST weights, digits at 28×28),
    weights trained on the same rows are still refused, and the public split is the one
    pre-training used, whatever image_size the run asks for."""
    from dpvision.config import TrainConfig
    from dpvision.data.splits import public_split
    from dpvision.training.supervised import public_rows_record, rows_trained_on

    native = TrainConfig(dataset="digits").load_dataset()
    dataset = TrainConfig(dataset="digits", image_size=28).load_dataset()
    assert dataset.image_shape == (28, 28, 1)
    assert dataset.row_identity_kept
    assert np.array_equal(dataset.row_images, native.train_images)
    labels = dataset.train_labels
    other = np.random.default_rng(1).integers(0, 256, (50, 8, 8, 1), dtype=np.uint8)
    elsewhere = {
        **public_rows_record(other, np.arange(50) % 10),
        "public_fraction": 0.0,
        "n_images": 50,
    }
    kept = rows_trained_on(
        elsewhere, "digits", dataset.row_images, labels, 0.0, what="w.pt", resized=False
    )
    assert len(kept) == 0
    same = {
        **public_rows_record(native.train_images, labels),
        "public_fraction": 0.0,
        "n_images": len(labels),
    }
    # Whole-set weights: their rows are left out, silently (issue 48), matched at their size.
    every = rows_trained_on(same, "npz:copy.npz", dataset.row_images, labels, 0.0, what="w.pt")
    assert np.array_equal(every, np.arange(len(labels)))
    public = public_split(native.train_images, labels, 0.1)[1]
    assert np.array_equal(public_split(dataset.row_images, labels, 0.1)[1], public)


@pytest.mark.parametrize("where", [0, 700, 1438])
def test_a_resized_run_splits_each_row_alone_whatever_row_is_added(where):
    """Neighbouring datasets: the public slice and the validation coins of a resized run
    read each row at its own size, so adding one row anywhere moves no other row."""
    from dpvision.data.core import ImageDataset
    from dpvision.data.datasets import resized
    from dpvision.data.resize import ImageGeometry
    from dpvision.data.splits import training_rows

    native = _native_digits()
    geometry = ImageGeometry.from_config({"image_size": 16})
    extra = np.random.default_rng(9).integers(0, 256, (1, 8, 8, 1), dtype=np.uint8)
    grown = ImageDataset(
        native.name,
        np.insert(native.train_images, where, extra, axis=0),
        np.insert(native.train_labels, where, 3),
        native.test_images,
        native.test_labels,
        native.num_classes,
    )
    sides = []
    for data in (resized(native, geometry), resized(grown, geometry)):
        rows = training_rows(
            data.row_images,
            np.asarray(data.train_labels),
            public_fraction=0.2,
            validation_fraction=0.2,
            key=b"k" * 32,
        )
        side = np.zeros(len(data.train_labels), dtype=np.int8)
        side[rows.validation], side[rows.public] = 1, 2
        sides.append(side)
    assert np.array_equal(np.delete(sides[1], where), sides[0])


def _native_digits():  # type: ignore[no-untyped-def]
    from dpvision.config import TrainConfig

    return TrainConfig(dataset="digits").load_dataset()
