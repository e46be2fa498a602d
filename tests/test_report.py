"""``dpvision sweep`` and ``dpvision report``: the grid, the tables, the flags, the plot."""

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from dpvision.cli import main
from dpvision.config import resolve
from dpvision.errors import DPVisionError
from dpvision.report import load_results, report, run_flags, sweep


def _write_config(path: Path, method: str, reference: dict[str, Any] | None = None) -> Path:
    lines = [
        'dataset = "digits"',
        f'method = "{method}"',
        'features = "pixels"',
        'accountant = "rdp"',  # the sweep is under test here; PLD calibration takes seconds
        "epsilon = 3.0",
        "",
        "[learner]",
        "clip_norm = 8.0" if method == "dp-ls" else "clip_norm = 1.0",
    ]
    if method == "dp-sgd-linear":
        lines += ["batch_size = 256", "epochs = 2", "learning_rate = 0.5"]
    if reference is not None:
        lines += ["", "[reference]"]
        lines += [f"{key} = {json.dumps(value)}" for key, value in reference.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# dp-ls on digits at ε = 0.5 lands anywhere from about 40 to 70 % with the noise drawn.
REFERENCE = {"source": "a paper, Table 1", "accuracy": 0.9, "epsilon": 1.0, "band": [0.3, 1.0]}


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sweep")
    configs = [
        _write_config(folder / "ls.toml", "dp-ls", REFERENCE),
        _write_config(folder / "sgd.toml", "dp-sgd-linear"),
    ]
    # A secret seed replays the runs' noise (each run's config keys its own streams).
    sets = ["secret_seed=11"]
    sweep(
        configs,
        epsilons=[0.5, 1.0, 3.0],
        seeds=[0, 1],
        out=folder / "results",
        sets=sets,
        quiet=True,
    )
    return folder / "results"


def test_sweep_writes_one_result_per_config_epsilon_and_seed(swept: Path) -> None:
    files = sorted(p.name for p in swept.glob("*.json"))
    assert len(files) == 12
    assert "ls_eps0p5_seed1.json" in files
    result = json.loads((swept / "sgd_eps3_seed0.json").read_text())
    assert result["config"]["epsilon"] == 3.0
    assert result["config"]["seed"] == 0
    assert result["epsilon"] <= 3.0


def test_sweep_keeps_finished_runs(swept: Path, tmp_path: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in swept.glob("*.json")}
    config = _write_config(tmp_path / "ls.toml", "dp-ls", REFERENCE)
    sweep([config], epsilons=[0.5, 1.0, 3.0], seeds=[0, 1], out=swept, quiet=True)
    assert {p.name: p.stat().st_mtime_ns for p in swept.glob("*.json")} == before


def test_report_tables_plot_and_ledgers(swept: Path, tmp_path: Path) -> None:
    summary = report(swept, tmp_path / "report.md")
    text = (tmp_path / "report.md").read_text()
    assert len(summary["rows"]) == 6  # 2 setups × 3 ε
    row = next(r for r in summary["rows"] if r["setup"] == "dp-ls · pixels" and r["epsilon"] == 1)
    assert row["runs"] == 2
    assert row["paper"] == pytest.approx(90.0)
    assert row["min"] <= row["median"] <= row["max"]
    assert f"| dp-ls · pixels | 1 | 2 | {row['median']:.2f} |" in text
    assert "| 90.0 |" in text
    assert "## Privacy ledgers" in text
    assert "DP-LS G" in text  # what each run released
    assert summary["flagged"] == []
    (png,) = summary["plots"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        assert image.size[0] > 600
        pixels = np.asarray(image.convert("L"))
    assert pixels.std() > 10  # something is drawn


def test_report_takes_several_folders_and_published_points(swept: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "cnn.json").write_text(json.dumps(_fake(0.9, 1.0, 0.6, None)))
    config = _write_config(
        tmp_path / "paper.toml",
        "dp-ls",
        {"source": "paper B", "accuracy": 0.95, "epsilon": 3.0, "points": [[4.0, 0.97]]},
    )
    summary = report([swept, other], tmp_path / "all.md", references=[config])
    assert {row["dataset"] for row in summary["rows"]} == {"digits", "toy"}
    assert len(summary["plots"]) == 2
    assert "other/cnn.json" in (tmp_path / "all.md").read_text()
    from dpvision.report import published_points

    expected = {(3.0, 0.95, "paper B"), (4.0, 0.97, "paper B")}
    assert published_points([config])[("digits", "dp-ls · pixels")] == expected
    # The reference config's number fills the paper column of the matching setup and ε.
    row = next(r for r in summary["rows"] if r["setup"] == "dp-ls · pixels" and r["epsilon"] == 3)
    assert row["paper"] == pytest.approx(95.0)
    other_setup = [r for r in summary["rows"] if r["setup"] == "dp-sgd-linear · pixels"]
    assert all(r["paper"] is None for r in other_setup)


def _fake(epsilon: float, target: float | None, accuracy: float, band: list[float] | None):
    reference = {"source": "x", "accuracy": 0.8, "epsilon": 3.0}
    if band is not None:
        reference["band"] = band
    return {
        "dataset": "toy",
        "method": "dp-ls",
        "features": "pixels",
        "test_accuracy": accuracy,
        "epsilon": epsilon,
        "config": {"epsilon": target, "reference": reference},
        "privacy_ledger": [],
    }


def test_flags_catch_epsilon_over_target_and_accuracy_outside_the_band() -> None:
    assert run_flags(_fake(2.9999, 3.0, 0.8, [0.75, 0.85])) == []
    (flag,) = run_flags(_fake(3.0001, 3.0, 0.8, [0.75, 0.85]))
    assert "exceeds the target 3" in flag
    (flag,) = run_flags(_fake(2.99, 3.0, 0.70, [0.75, 0.85]))
    assert "outside the band 75.0–85.0 %" in flag
    # The band belongs to the published ε: a run at another ε is not held to it.
    assert run_flags(_fake(0.99, 1.0, 0.5, [0.75, 0.85])) == []
    # A fixed-σ run is held to the band when its ε is the published one (to 1 %).
    assert run_flags(_fake(3.0026, None, 0.5, [0.75, 0.85]))


def test_a_run_on_the_jpeg_copy_outside_the_band_carries_the_copys_caveat() -> None:
    run = {**_fake(2.99, 3.0, 0.70, [0.75, 0.85]), "dataset": "cifar10-jpeg"}
    (flag,) = run_flags(run)
    assert "outside the band 75.0–85.0 %" in flag
    assert "JPEG q75 copy" in flag
    assert "2-3 points" in flag
    (plain,) = run_flags({**run, "dataset": "cifar10"})
    assert "JPEG" not in plain
    # Above the band the copy's cost explains nothing.
    (above,) = run_flags({**run, "test_accuracy": 0.90})
    assert "JPEG" not in above


def test_report_lists_flagged_runs(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text(json.dumps(_fake(3.5, 3.0, 0.5, [0.75, 0.85])))
    (tmp_path / "notes.json").write_text('{"not": "a result"}')
    summary = report(tmp_path)
    assert len(summary["flagged"]) == 2
    text = (tmp_path / "report.md").read_text()
    assert "**bad.json**: ε 3.5 exceeds the target 3" in text
    assert len(load_results(tmp_path)) == 1


def test_reference_tables_are_validated(tmp_path: Path) -> None:
    bad = [
        ({"accuracy": 0.9}, "needs source"),
        ({"source": "s", "accuracy": 90}, "fraction in"),
        ({"source": "s", "band": [0.9, 0.8]}, "band must be"),
        ({"source": "s", "year": 2021}, "unknown key reference.year"),
    ]
    for reference, message in bad:
        path = _write_config(tmp_path / "c.toml", "dp-ls", reference)
        with pytest.raises(DPVisionError, match=message):
            resolve(path)


def test_a_config_that_needs_missing_data_says_how_to_run_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write_config(tmp_path / "c.toml", "dp-ls", {"source": "s", "needs": "CIFAR-10"})
    top = f'dataset = "cifar10"\ndata_dir = "{tmp_path / "nowhere"}"\n'
    path.write_text(top + path.read_text().replace('dataset = "digits"\n', ""))
    assert main(["train", "--config", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "this config needs CIFAR-10; where it is, run: dpvision train --config" in err
    assert err.count("\n") == 1


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no dpvision result JSONs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", "x.toml", "--epsilons", "a,b", "--out", str(tmp_path)])
    assert exit_info.value.code == 2


def test_setups_differ_by_training_length_and_name_precomputed_folders() -> None:
    """Mehta et al.'s DP-FC at 1 and at 10 epochs are two setups, not one."""
    from dpvision.report import setup_label

    def run(method: str, features: str, learner: dict[str, object]) -> dict[str, object]:
        return {"method": method, "features": features, "config": {"learner": learner}}

    folder = "precomputed:path=features/cifar10/vit-b16-i21k/"
    one = setup_label(run("dp-fc", folder, {"epochs": 1}))
    ten = setup_label(run("dp-fc", folder, {"epochs": 10}))
    assert (one, ten) == ("dp-fc · vit-b16-i21k · E=1", "dp-fc · vit-b16-i21k · E=10")
    assert setup_label(run("dp-fc", "pixels", {})) == "dp-fc · pixels · E=10"  # the default
    assert setup_label(run("dp-newton", "pixels", {"iterations": 3})) == "dp-newton · pixels · E=3"
    assert setup_label(run("dp-ls", "pixels", {"epochs": 5})) == "dp-ls · pixels"


def _recipe_config(path: Path) -> Path:
    """A config of the default recipe (no method: ``auto``); the pixels keep it quick."""
    lines = ['dataset = "digits"', 'features = "pixels"', 'accountant = "rdp"', "epsilon = 1.0"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sweep_resumes_a_default_recipe_config_and_report_draws_it_as_one_curve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The result records the config as the recipe resolved it; an identical rerun keeps
    every run, a changed option reruns, and the recipe's per-ε epochs (5 at ε = 0.1, 10 at
    ε = 0.5) do not split the config into two setups."""
    config = _recipe_config(tmp_path / "recipe.toml")
    out = tmp_path / "results"
    sweep_args = ["sweep", "--config", str(config), "--epsilons", "0.1,0.5", "--out", str(out)]
    assert main(sweep_args) == 0
    first = capsys.readouterr()
    assert first.err.count("test accuracy") == 2
    files = sorted(out.glob("*.json"))
    results = [json.loads(p.read_text()) for p in files]
    assert [r["recipe"]["set"]["learner.epochs"] for r in results] == [5, 10]
    assert all(r["recipe"]["set"]["method"] == "dp-sgd-linear" for r in results)
    before = {p.name: p.stat().st_mtime_ns for p in files}

    assert main(sweep_args) == 0
    again = capsys.readouterr()
    assert again.err.count("exists (same config), kept") == 2
    assert "another config" not in again.err
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")} == before

    # An option the config now sets itself is a different config: that run is redone.
    changed = [*sweep_args[:4], "0.5", *sweep_args[5:], "--set", "learner.epochs=2"]
    assert main(changed) == 0
    err = capsys.readouterr().err
    assert "recipe_eps0p5_seed0.json was made by another config (differs in: learner.epochs)" in err
    assert (
        json.loads((out / "recipe_eps0p5_seed0.json").read_text())["config"]["learner"]["epochs"]
        == 2
    )
    # ... and a changed option the recipe fills in when left out is one too.
    assert main([*sweep_args[:4], "0.1", *sweep_args[5:], "--set", "learner.batch_size=64"]) == 0
    assert "differs in: learner.batch_size); rerunning" in capsys.readouterr().err

    # The first sweep's results (recipe epochs 5 and 10): one setup, one curve of two points.
    for path, result in zip(files, results, strict=True):
        path.write_text(json.dumps(result))
    summary = report(out, tmp_path / "report.md")
    assert {row["setup"] for row in summary["rows"]} == {"dp-sgd-linear · pixels · default recipe"}
    assert sorted(row["epsilon"] for row in summary["rows"]) == [0.1, 0.5]


def test_a_recipe_run_with_the_epochs_set_keeps_them_in_its_setup() -> None:
    from dpvision.report import setup_label

    def run(learner: dict[str, object], chosen: dict[str, object]) -> dict[str, object]:
        return {
            "method": "dp-sgd-linear",
            "features": "scatternet",
            "config": {"learner": learner},
            "recipe": {"default": "method" in chosen, "set": chosen},
        }

    recipe = {"method": "dp-sgd-linear", "learner.epochs": 20}
    assert setup_label(run({"epochs": 20}, recipe)) == "dp-sgd-linear · scatternet · default recipe"
    assert setup_label(run({"epochs": 40}, {**recipe, "learner.epochs": 40})) == (
        "dp-sgd-linear · scatternet · default recipe"
    )
    own = setup_label(run({"epochs": 3}, {"method": "dp-sgd-linear"}))
    assert own == "dp-sgd-linear · scatternet · default recipe · E=3"
    assert setup_label(run({"epochs": 3}, {})) == "dp-sgd-linear · scatternet · E=3"


def test_a_sweeps_lines_print_accuracy_as_train_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One format for one number: "test accuracy 93.04 %", as ``train`` prints it."""
    config = _write_config(tmp_path / "ls.toml", "dp-ls", REFERENCE)
    caplog.set_level("INFO", logger="dpvision")
    sweep([config], epsilons=[1.0], seeds=[0], out=tmp_path / "out", quiet=False)
    line = next(r.getMessage() for r in caplog.records if "test accuracy" in r.getMessage())
    assert re.search(r"ls_eps1_seed0\.json: test accuracy \d{1,3}\.\d\d %, ε = ", line), line


def test_a_kept_dp_sgd_run_is_not_rerun_for_the_schedule_its_recipe_chose(tmp_path: Path) -> None:
    """Review of issue 52: a sweep took the dp-sgd recipe's batch, epochs, learning rate, C
    and momentum for a changed config and reran every dp-sgd run."""
    from dpvision.report.sweep import _stale
    from dpvision.runs.auto import apply_recipe

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (400, 12, 12), dtype=np.uint8)
    y = rng.integers(0, 3, 400)
    data = tmp_path / "d.npz"
    np.savez(data, x_train=x[:300], y_train=y[:300], x_test=x[300:], y_test=y[300:])
    config = resolve(sets=[f"dataset='npz:{data}'", "num_classes=3", 'method="dp-sgd"'])
    resolved, recipe = apply_recipe(config)
    assert "learner.batch_size" in recipe["set"]
    kept = tmp_path / "kept.json"
    kept.write_text(json.dumps({"config": resolved.to_dict(), "recipe": recipe}))
    assert _stale(kept, config) is None
    changed = resolve(
        sets=[f"dataset='npz:{data}'", "num_classes=3", 'method="dp-sgd"', "learner.batch_size=32"]
    )
    assert _stale(kept, changed) == "learner.batch_size"
