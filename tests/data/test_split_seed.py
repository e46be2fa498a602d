"""Issue 48: a single ``imagefolder:ROOT/<class>/`` tree is split by the config's public
``split_seed``, never by the run's ``seed`` (finding 3), and an image folder's input size is
the config's ``image_size``, never read off the private images (noticed item 3a).

The adversary knows the code, every published config and result, and the whole tree except
the target image: with a test split keyed by ``seed``, a sweep over five seeds released
about two thirds of the images exactly, as test data, in one run while they were private
training data in another.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dpvision
from dpvision.cli import main
from dpvision.config import TrainConfig, resolve
from dpvision.data import imagefolder, load_dataset
from dpvision.data.resize import ImageGeometry
from dpvision.errors import DPVisionError
from dpvision.report import _stale, sweep
from dpvision.testing import assert_same_outcome

SEEDS = (0, 1, 2, 3, 4)


def _tree(root: Path, per_class: int = 15) -> Path:
    """``root/a/*.png`` and ``root/b/*.png``: small random 8x8 images, no train/ or test/."""
    rng = np.random.default_rng(0)
    for kind in ("a", "b"):
        (root / kind).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / kind / f"{i:03d}.png")
    return root


def _config(path: Path, root: Path, extra: str = "") -> Path:
    path.write_text(
        f'dataset = "imagefolder:{root}"\nmethod = "dp-ls"\nfeatures = "pixels"\n'
        f"image_size = 8\n{extra}"
    )
    return path


def _test_side(config: dict) -> frozenset[bytes]:
    """What the adversary recomputes from a published config: the test images."""
    dataset = load_dataset(
        config["dataset"],
        geometry=ImageGeometry.from_config(config),
        split_seed=config["split_seed"],
        test_fraction=config["test_fraction"],
    )
    return frozenset(image.tobytes() for image in dataset.test_images)


def test_a_sweep_over_seeds_keeps_one_test_side(tmp_path, monkeypatch):
    """Finding 3's adversary test: five seeds, one test side (the split the runs used, and
    the one recomputed from each published config); before the fix 5 sides, 68 % of the
    images test data in one run and training data in another."""
    root = _tree(tmp_path / "tree")
    used: list[frozenset[str]] = []
    real = imagefolder.tree_split

    def spy(paths, names, fraction, key):  # type: ignore[no-untyped-def]
        train, test = real(paths, names, fraction, key)
        used.append(frozenset(f"{names[i]}/{paths[i].name}" for i in test))
        return train, test

    monkeypatch.setattr(imagefolder, "tree_split", spy)
    config = _config(tmp_path / "tiny.toml", root)
    written = sweep([config], epsilons=[1.0], seeds=SEEDS, out=tmp_path / "out", quiet=True)
    results = [json.loads(path.read_text()) for path in written]
    assert [r["config"]["seed"] for r in results] == list(SEEDS)
    assert len(used) >= len(SEEDS)
    assert len(set(used)) == 1, [sorted(side) for side in set(used)]
    assert 0 < len(used[0]) < 30
    assert len({r["n_test"] for r in results}) == 1
    assert {r["config"]["split_seed"] for r in results} == {0}
    # Each result says its test side is released exactly, and which split it is.
    assert {json.dumps(r["test_split"]) for r in results} == {
        json.dumps(
            {"split_seed": 0, "test_fraction": 0.2, "released": "exactly (n_test, test accuracy)"}
        )
    }
    assert "test_split" not in dpvision.train(method="dp-ls", features="pixels").result
    assert len({_test_side(r["config"]) for r in results}) == 1
    # Another split_seed is another test side (the key is the split's, not the run's).
    other = _test_side({**results[0]["config"], "split_seed": 7})
    assert other != _test_side(results[0]["config"])

    # A result written before split_seed existed: a tree was split by its seed, so the run
    # of seed 0 had this split and is kept; the run of seed 3 had another and is redone.
    for index, seed in ((0, 0), (3, 3)):
        kept = json.loads(written[index].read_text())
        del kept["config"]["split_seed"]
        written[index].write_text(json.dumps(kept))
        ours = resolve(config, {"epsilon": 1.0, "seed": seed})
        assert _stale(written[index], ours) == (None if seed == 0 else "split_seed")


def test_a_sweep_of_configs_that_split_one_tree_two_ways_is_refused(tmp_path):
    root = _tree(tmp_path / "tree", per_class=3)
    first = _config(tmp_path / "first.toml", root)
    second = _config(tmp_path / "second.toml", root, "split_seed = 1\n")
    with pytest.raises(DPVisionError, match=r"split .* in two ways") as error:
        sweep([first, second], epsilons=[1.0], seeds=[0], out=tmp_path / "out", quiet=True)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()  # refused by the configs, before any run


def test_split_seed_is_validated_like_seed(tmp_path, capsys):
    for item, message in (
        ("split_seed=-1", "split_seed must be a whole number"),
        ("split_seed=1.5", "split_seed must be a whole number"),
        ("split_seed=1", "split_seed splits a single imagefolder: tree"),
    ):
        code = main(["train", "--set", item, "--json", str(tmp_path / "r.json")])
        err = capsys.readouterr().err.strip()
        assert code == 2
        assert len(err.splitlines()) == 1, err
        assert message in err, err


def test_split_seed_and_test_fraction_are_not_searchable():
    from dpvision.runs.search import parse_search

    for item in ("split_seed=0,1", "test_fraction=0.2,0.3"):
        with pytest.raises(DPVisionError, match="fixed by the selection"):
            parse_search([item])


def test_a_search_over_an_image_folder_decoding_is_refused_whatever_the_images(tmp_path, capsys):
    """Issue 48's review: ``tune --search image_size=…`` on an image folder identified the
    rows by their pixels at each size, so the candidates' splits differed and the search ran
    or was refused as two Binomial counts happened to match (11 of 12 secret seeds refused).
    Now the config refuses it, before any image is read: the same line for D and D + x."""
    from dpvision.cli import main
    from dpvision.testing import assert_same_outcome

    root = _tree(tmp_path / "tree")

    def run(extra: tuple[int, ...]) -> object:
        for i in extra:
            pixels = np.full((8, 8, 3), i, dtype=np.uint8)
            Image.fromarray(pixels).save(root / "a" / f"extra{i}.png")
        argv = ["tune", "--quiet", "--dataset", f"imagefolder:{root}", "--method", "dp-ls"]
        argv += ["--set", "features='pixels'", "--set", "image_size=8", "--secret-seed", "5"]
        code = main([*argv, "--search", "image_size=8,10"])
        for i in extra:
            (root / "a" / f"extra{i}.png").unlink()
        message = capsys.readouterr().err.strip()
        if code == 2:
            raise DPVisionError(message)
        return code

    outcome = assert_same_outcome(run, (), [(7,), (200,)])
    assert outcome.refused
    assert "--search image_size" in str(outcome.message)


def test_a_checkpoint_from_before_split_seed_resumes_only_the_same_split():
    """Before split_seed a tree was split by the seed: the run settings of a run whose
    split_seed is its seed are those of that run, and others differ."""
    from dpvision.runs.schedule import run_settings

    learner = {"model": "mlp-8", "steps": 2, "batch_size": 8}
    tree = {"dataset": "imagefolder:/data/tree", "image_size": 8, "method": "dp-sgd"}
    same = run_settings(TrainConfig(**tree, seed=3, split_seed=3, learner=learner))
    assert "split_seed" not in same
    other = run_settings(TrainConfig(**tree, seed=3, learner=learner))
    assert other["split_seed"] == 0
    digits = run_settings(TrainConfig(method="dp-sgd", seed=3, learner=learner))
    assert "split_seed" not in digits  # no tree: old checkpoints of any seed resume


# --- an image folder's size is the config's (noticed item 3a) ---------------------------------


def _train(root: Path, tmp_path: Path, capsys, *extra: str) -> int:
    argv = ["train", "--quiet", "--dataset", f"imagefolder:{root}", "--method", "dp-ls"]
    argv += ["--features", "pixels", "--json", str(tmp_path / "r.json"), *extra]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    if code == 2:
        raise DPVisionError(err)
    return code


@pytest.mark.parametrize("size", [(), ("--set", "image_size=8")])
def test_an_odd_sized_image_changes_no_outcome(tmp_path, capsys, size):
    """D and D plus one image of another size: without image_size both are refused with
    the same line (by the config, naming no file); with it both run. Before the fix D ran
    and D + x was refused with a message naming x's path and another private file's."""
    root = _tree(tmp_path / "tree", per_class=6)
    odd = root / "a" / "odd.png"

    def run(data: tuple[bool]) -> int:
        if data[0]:  # D + x
            Image.fromarray(np.full((11, 9, 3), 200, np.uint8)).save(odd)
        else:
            odd.unlink(missing_ok=True)
        return _train(root, tmp_path, capsys, *size)

    outcome = assert_same_outcome(run, (False,), [(True,)])
    assert outcome.refused == (not size)
    if outcome.refused:
        assert outcome.message is not None
        assert "needs image_size" in outcome.message
        assert ".png" not in outcome.message
        assert "\n" not in outcome.message


def test_an_image_folder_needs_image_size_before_any_file_is_read(tmp_path, monkeypatch):
    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a file was read")

    monkeypatch.setattr(imagefolder, "load_image_folder", never)
    with pytest.raises(DPVisionError, match="needs image_size"):
        resolve(overrides={"dataset": f"imagefolder:{tmp_path}"})
    resolve(overrides={"dataset": f"imagefolder:{tmp_path}", "image_size": 8})  # no read either
