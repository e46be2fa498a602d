"""The adversary of docs/guarantees.md, played against every training method end to end.

The adversary knows the code, the config (the public ``seed`` included), every byte a run
publishes and the whole dataset except the target. Two kinds of test, for dp-ls,
dp-newton, dp-fc, dp-sgd-linear, dp-sgd and dp-randp (tune: tests/training/test_tune.py;
PrivacyEngine loops: tests/test_privacy_engine_secret.py):

* **replay**: the adversary reruns the published config on the data *with* the target (the
  strongest replay) and compares with the published model. Before issue 35 the noise and
  the batches came from the published seed, so the rerun equalled the published model
  exactly when the target was in, which decides membership with TPR 1 at FPR 0.
* **neighbours through the real split code**: with the noise off and a fixed
  ``secret_seed``, one example is added to the dataset file — appended, inserted first and
  in the middle — and every release (the validation counts included) must move by at most
  its stated sensitivity, with ``validation_fraction`` and ``public_fraction`` set. Before
  issue 35 the splits were seeded permutations of range(n), and one added example moved
  many other rows between training and validation (the releases moved 2–9× their
  sensitivity).
"""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

import dpvision
from dpvision.data.splits import PUBLIC_KEY, split_coins
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.testing import check_sensitivity, coupled_coins

SECRET = 918273645546372819  # distinctive: searched for in every published byte


def _digits(n: int = 360) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    digits = load_digits()
    images = (digits.images * 15).astype(np.uint8)[..., None]
    labels = digits.target.astype(np.int64)
    return images[:n], labels[:n], images[n : n + 120], labels[n : n + 120]


def _write(path: Path, images: np.ndarray, labels: np.ndarray) -> str:
    _, _, x_test, y_test = _digits()
    np.savez(path, x_train=images, y_train=labels, x_test=x_test, y_test=y_test)
    return f"npz:{path}"


METHODS: dict[str, dict[str, Any]] = {
    "dp-ls": {"method": "dp-ls", "features": "pixels"},
    "dp-newton": {"method": "dp-newton", "features": "pixels", "learner": {"iterations": 2}},
    "dp-fc": {"method": "dp-fc", "features": "pixels", "learner": {"epochs": 2}},
    "dp-sgd-linear": {"method": "dp-sgd-linear", "features": "pixels", "learner": {"epochs": 2}},
    "dp-sgd": {
        "method": "dp-sgd",
        "features": "pixels",
        "learner": {"model": "mlp-8", "steps": 3, "batch_size": 64},
    },
    "dp-randp": {
        "method": "dp-randp",
        "learner": {"model": "mlp-16", "steps": 4, "batch_size": 64, "phase2_steps": 2},
    },
}
# Full-batch learners see every training row in every release; the Poisson-sampled ones
# draw each row's coin by its position, so only an appended example keeps D and D′ coupled
# (the coins are i.i.d. secret either way: the position changes no distribution).
FULL_BATCH = ("dp-ls", "dp-newton", "dp-fc")


def _fields(method: str, encoder: Path) -> dict[str, Any]:
    fields = {k: (dict(v) if isinstance(v, dict) else v) for k, v in METHODS[method].items()}
    if method == "dp-randp":
        fields["learner"]["encoder"] = str(encoder)
    return fields


def _weights(model: Any) -> np.ndarray:
    if model.network is not None:
        return torch.cat(
            [v.flatten().double() for v in model.network.state_dict().values()]
        ).numpy()
    return np.concatenate([np.ravel(model.coef), np.ravel(model.intercept)])


@pytest.mark.parametrize("method", list(METHODS))
def test_replaying_the_published_config_does_not_reproduce_the_model(tmp_path, method, encoder):
    images, labels, _, _ = _digits()
    dataset = _write(tmp_path / "d.npz", images, labels)
    fields = {**_fields(method, encoder), "dataset": dataset, "num_classes": 10, "epsilon": 1.0}
    published = dpvision.train(**fields, validation_fraction=0.1, save=tmp_path / "model.bin")
    config = published.result["config"]
    assert config["seed"] == 0
    assert "secret_seed" not in config
    assert published.result["secret_randomness"] == "os"
    # The adversary's rerun: every published field, on the data with the target in.
    replay = {k: config[k] for k in ("dataset", "method", "features", "seed", "epsilon")}
    replay |= {"learner": config["learner"], "validation_fraction": 0.1, "num_classes": 10}
    rerun = dpvision.train(**replay)
    assert not np.array_equal(_weights(rerun.model), _weights(published.model))
    # A research replay with a secret seed reproduces, and never publishes the seed.
    first = dpvision.train(**fields, secret_seed=SECRET, save=tmp_path / "seeded.bin")
    second = dpvision.train(**fields, secret_seed=SECRET)
    assert np.array_equal(_weights(first.model), _weights(second.model))
    assert first.result["secret_randomness"] == "user-secret"
    text = repr(first.result) + repr(first.model.config)
    for form in (str(SECRET), hex(SECRET)):
        assert form not in text
        assert form.encode() not in (tmp_path / "seeded.bin").read_bytes()
    assert SECRET.to_bytes(8, "little") not in (tmp_path / "seeded.bin").read_bytes()


def _random_example(data: tuple[Any, ...], rng: np.random.Generator) -> tuple[Any, ...]:
    images, labels = data
    image = rng.integers(0, 256, images.shape[1:], dtype=np.uint8)
    return image, labels[int(rng.integers(len(labels)))]


def _example_on(side: str, secret_key: bytes) -> Any:
    """An outlier that lands on ``side`` (``validation``, ``public`` or ``train``) of the
    splits of :func:`test_releases_move_at_most_their_sensitivity_through_the_splits`
    (``secret_key``: the run's validation split key)."""

    def make(data: tuple[Any, ...], rng: np.random.Generator) -> tuple[Any, ...]:
        while True:
            image, label = _random_example(data, rng)
            one, tag = image[None], np.array([label])
            public = split_coins(one, tag, PUBLIC_KEY)[0] < PUBLIC_FRACTION
            held = split_coins(one, tag, secret_key)[0] < VALIDATION_FRACTION
            where = "public" if public else "validation" if held else "train"
            if where == side:
                return image, label

    return make


PUBLIC_FRACTION, VALIDATION_FRACTION = 0.1, 0.2


@pytest.mark.parametrize("method", list(METHODS))
def test_releases_move_at_most_their_sensitivity_through_the_splits(tmp_path, method, encoder):
    """Appended, inserted first and in the middle: every release moves at most its
    sensitivity. Poisson-sampled methods: the example lands in the validation or the public
    rows (then no training release may move at all, wherever it is inserted), or is
    appended to the training rows with q and the divisor qN held fixed (dp-sgd-linear;
    with q = B/N an added training example changes q for every row, the convention of
    every DP-SGD library that treats N as public)."""
    images, labels, _, _ = _digits()
    fields = {**_fields(method, encoder), "num_classes": 10, "noise_multiplier": 0.0}
    fields |= {
        "validation_fraction": VALIDATION_FRACTION,
        "public_fraction": PUBLIC_FRACTION,
        "secret_seed": SECRET,
    }
    if method in ("dp-sgd", "dp-randp"):
        fields["learner"]["eval_every"] = 2  # validation counts along training too
    if method == "dp-sgd-linear":
        fields["learner"] |= {"sample_rate": 0.2, "expected_batch_size": 60.0, "batch_size": None}

    def run(data: tuple[Any, ...]) -> None:
        # One path for D and D′: the path is part of the config that keys the secret.
        dataset = _write(tmp_path / "d.npz", *data)
        dpvision.train(**fields, dataset=dataset)

    from dpvision.config import resolve

    # The run's secret (from its secret seed and its config) keys its validation split.
    secret_key = resolve(None, {**fields, "dataset": _write(tmp_path / "d.npz", images, labels)})
    secret_key = secret_key.secret_randomness().split_key()
    n = len(labels)
    sides = ["validation", "public"]
    if method in FULL_BATCH or method == "dp-sgd-linear":
        sides.append("train")
    for side in sides:
        appended_only = side == "train" and method not in FULL_BATCH
        with coupled_coins():  # the same Poisson coins for the rows D and D′ share
            report = check_sensitivity(
                run,
                (images, labels),
                positions=[n] if appended_only else [n, 0, n // 2],
                outlier=_example_on(side, secret_key),
                tolerance=1e-5,
            )
        assert report.refusal is None, report.refusal
        assert report.ok, f"{side}: {report.summary()}"
        moved = {m.released for m in report.movements if m.movement > 0}
        if side == "public":
            assert not moved
        if side == "validation":
            assert moved <= {"noisy count of correct validation examples"}


def test_the_secret_seed_is_in_no_published_byte(tmp_path, capsys):
    from dpvision.cli import main

    files = {name: tmp_path / name for name in ("result.json", "model.bin", "run.log")}
    argv = ["train", "-v", "--secret-seed", str(SECRET), "--json", str(files["result.json"])]
    argv += ["--save", str(files["model.bin"]), "--log-file", str(files["run.log"])]
    argv += ["--set", "validation_fraction=0.2", "--set", "learner.epochs=2"]
    argv += ["--method", "dp-fc", "--features", "pixels"]
    assert main(argv) == 0
    streams = capsys.readouterr()
    published = [path.read_bytes() for path in files.values()]
    published += [streams.out.encode(), streams.err.encode()]
    assert b"<secret>" in files["run.log"].read_bytes()  # the command line, redacted
    for blob in published:
        for form in (str(SECRET).encode(), hex(SECRET).encode(), SECRET.to_bytes(8, "little")):
            assert form not in blob
    assert b'"secret_randomness": "user-secret"' in files["result.json"].read_bytes()
    # A bad secret seed is refused without repeating it.
    with pytest.raises(SystemExit) as refused:
        main(["train", "--secret-seed", "12x34"])
    assert refused.value.code == 2
    assert "12x34" not in capsys.readouterr().err
    assert main(["train", "--set", "secret_seed='s3cr3t'"]) == 2
    assert "s3cr3t" not in capsys.readouterr().err


def test_every_justified_field_is_in_the_guarantees_table():
    from test_released_outputs import JUSTIFIED

    table = (Path(__file__).parents[1] / "docs" / "guarantees.md").read_text("utf-8")
    missing = [field for field in JUSTIFIED if f"`{field}`" not in table]
    assert not missing, f"docs/guarantees.md does not list: {missing}"


def test_validation_accuracies_are_noisy_counts_in_the_ledger():
    fields = {"dataset": "digits", "method": "dp-fc", "features": "pixels", "epsilon": 1.0}
    fields |= {"validation_fraction": 0.3, "learner": {"epochs": 2}}
    runs = [dpvision.train(**fields, secret_seed=SECRET + i) for i in range(2)]
    for run in runs:
        entries = [e for e in run.result["privacy_ledger"] if "validation" in e["released"]]
        assert len(entries) == 1
        assert entries[0]["l2_sensitivity"] == 1.0
        assert run.result["validation"] == "private"
        assert run.result["validation_noise"] > 0
        assert run.result["epsilon"] <= 1.0
    # Public validation: exact, named, and nothing in the ledger.
    public = dpvision.train(**fields, validation="public", secret_seed=SECRET)
    assert public.result["validation"] == "public"
    assert not [e for e in public.result["privacy_ledger"] if "validation" in e["released"]]
    held = public.result["n_validation"]
    assert round(public.result["validation_accuracy"] * held, 6) == round(
        public.result["validation_accuracy"] * held
    )


MODEL_DOCUMENT = {
    "format": "public: the file format",
    "method": "public: the config",
    "dataset": "public: the config",
    "num_classes": "public: the dataset registry or the config",
    "image_shape": "public by convention",
    "features": "public: the config",
    "encoder_sha256": "public: the digest of a weight file named in the config",
    "preprocessing": "public: the preprocessing config and channels",
    "pixel_mean": "public: the dataset's published statistics or the encoder's",
    "pixel_std": "public: the dataset's published statistics or the encoder's",
    "input_shape": "public: the model's input shape",
    "model_name": "public: the config",
    "model_args": "public: the config (learner.model_args)",
    "groups": "public: the config",
    "batchnorm": "public: the config",
    "privacy": "the result's privacy part: accounting of the ledger",
    "config": "public: the resolved config without secret_seed",
    "class_names": "public: the dataset's class names",
}
MODEL_TENSORS = ("coef", "intercept", "network.", "preprocessing.")


@pytest.mark.parametrize(
    "fields",
    [
        {"method": "dp-ls", "preprocessing": {"kind": "private-norm"}},
        {"method": "dp-sgd", "learner": {"model": "mlp-8", "steps": 2, "batch_size": 64}},
    ],
    ids=["dp-ls-private-norm", "dp-sgd"],
)
def test_every_model_file_field_is_public_or_released(tmp_path, fields):
    import json

    from safetensors import safe_open

    path = tmp_path / "model.bin"
    dpvision.train(dataset="digits", features="pixels", epsilon=1.0, save=path, **fields)
    with safe_open(str(path), framework="pt") as handle:
        document = json.loads(handle.metadata()["dpvision"])
        tensors = list(handle.keys())
    assert not sorted(set(document) - set(MODEL_DOCUMENT))
    assert "secret_seed" not in document["config"]
    # Released parameters (post-processing), noisy preprocessing statistics, and buffers
    # no private forward pass wrote (a written one is refused: tests/training/test_buffers.py).
    assert all(name.startswith(MODEL_TENSORS) for name in tensors)


def test_progress_lines_show_the_noisy_validation_accuracies(capsys):
    import re

    run = dpvision.train(
        dataset="digits",
        method="dp-sgd",
        features="pixels",
        epsilon=3.0,
        validation_fraction=0.3,
        learner={"model": "mlp-8", "steps": 6, "batch_size": 64, "eval_every": 2},
        quiet=False,
    )
    shown = [
        float(v) for v in re.findall(r"validation accuracy ([0-9.]+) %", capsys.readouterr().err)
    ]
    history = [
        100 * entry[key]
        for entry in run.result["history"]
        for key in ("validation_accuracy",)
        if key in entry
    ]
    assert len(shown) >= 2
    assert shown[: len(history) - 1] == [round(v, 2) for v in history[:-1]]
    ledger = [e for e in run.result["privacy_ledger"] if "validation" in e["released"]]
    assert ledger[0]["count"] == 3  # steps 2 and 4, and the end (no EMA here)


def test_a_resumed_run_draws_no_validation_noise_twice(tmp_path):
    """Each validation count has its own secret noise stream, indexed by how many the run
    released; a resumed run restores that number from its checkpoint, so it never adds the
    noise of one count to another (their difference would be an exact statistic)."""
    fields = {"dataset": "digits", "method": "dp-sgd", "features": "pixels", "epsilon": 3.0}
    fields |= {"validation_fraction": 0.3, "secret_seed": SECRET}
    fields["learner"] = {"model": "mlp-8", "steps": 4, "batch_size": 64, "eval_every": 2}
    checkpoint = tmp_path / "run.ckpt"
    first = dpvision.train(**fields, checkpoint=checkpoint).result
    again = dpvision.train(**fields, checkpoint=checkpoint).result  # resumed at the end
    assert again["history"] == first["history"]
    assert again["validation_accuracy"] == first["validation_accuracy"]
    noises = {
        float(gaussian)
        for gaussian in (
            SecretRandomness(1).noise(f"validation {k}").initial_seed() for k in range(2)
        )
    }
    assert len(noises) == 2  # one stream per released count


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--secret-seed", str(SECRET)],
        ["train", f"--secret-seed={SECRET}"],
        ["train", f"--secret={SECRET}"],  # an abbreviation argparse accepts
        ["train", "--set", f"secret_seed={SECRET}"],
        ["train", f"--set=secret_seed={SECRET}"],
        ["train", "--set", f"secret_seed = {SECRET}"],
    ],
)
def test_the_logged_command_line_hides_the_secret_seed_in_any_spelling(argv):
    from dpvision.cli import build_parser
    from dpvision.cli.arguments import redact_secrets

    args = build_parser().parse_args(argv)
    assert str(SECRET) not in " ".join(redact_secrets(argv, args))


def _drawn_streams(monkeypatch: pytest.MonkeyPatch) -> list[list[bytes]]:
    """Spies on every secret stream a run draws (the noise's, the learners', tune's scores
    and runs, and the coins: Poisson sampling, tune's K and draws), one list per run: the
    caller appends a list before each run."""
    runs: list[list[bytes]] = []
    for method in ("key", "coin_key"):
        original = getattr(SecretRandomness, method)

        def spy(self: SecretRandomness, name: str, original=original) -> bytes:  # type: ignore[no-untyped-def]
            key = original(self, name)
            runs[-1].append(key)
            return key

        monkeypatch.setattr(SecretRandomness, method, spy)
    return runs


@pytest.mark.parametrize("entry", ["dp-ls", "dp-sgd", "tune"])
def test_one_secret_seed_on_a_changed_dataset_replays_no_noise(
    tmp_path, monkeypatch, entry, encoder
):
    """Issue 48, finding 4: the secret's context was the config alone, so the same config
    rerun with one example added to the dataset file drew the same noise (dp-ls on D′ with
    D's statistics replayed gave a bit-identical model): publishing both runs released the
    new example's statistics without noise. Now the training rows key every noise stream;
    the split keys stay the same, so the splits still move no other row. The coins too
    (Poisson sampling, tune's K and draws), so the two runs compose as independent ones."""
    images, labels, _, _ = _digits()
    runs = _drawn_streams(monkeypatch)
    split_keys = []
    for data in ((images, labels), (np.concatenate([images, images[:1]]), np.append(labels, 3))):
        fields = {"dataset": _write(tmp_path / "d.npz", *data), "num_classes": 10}
        fields |= {"epsilon": 2.0, "validation_fraction": 0.2, "secret_seed": SECRET}
        runs.append([])
        if entry == "tune":
            fields |= {"method": "dp-fc", "features": "pixels", "learner": {"epochs": 2}}
            dpvision.tune(["learner.learning_rate=0.1,0.5"], mean_runs=2.0, **fields)
        else:
            dpvision.train(**fields, **_fields(entry, encoder))
        from dpvision.config import resolve

        config = resolve(None, {k: v for k, v in fields.items() if k != "learner"})
        split_keys.append(config.secret_randomness().split_key())
    assert runs[0]
    assert runs[1]
    assert not set(runs[0]) & set(runs[1])
    assert split_keys[0] == split_keys[1]
    # The same rows replay the same streams (research replays still work).
    runs.append([])
    fields = {"dataset": _write(tmp_path / "d.npz", images, labels), "num_classes": 10}
    fields |= {"epsilon": 2.0, "validation_fraction": 0.2, "secret_seed": SECRET}
    if entry != "tune":
        dpvision.train(**fields, **_fields(entry, encoder))
        assert runs[2] == runs[0]
