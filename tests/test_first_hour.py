"""What a newcomer hit in the first hour (issue 18), one test per item: each failed before
its fix."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpvision import PrivacyEngine
from dpvision.cli import main
from dpvision.errors import DPVisionError
from dpvision.report import sweep
from dpvision.runs.dpsgd import format_metrics
from dpvision.runs.train import summary


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit:  # argparse's own errors
        code = int(exit.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    lines = [line for line in err.splitlines() if not line.startswith("[dpvision]")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _config(folder: Path, name: str, body: str) -> str:
    path = folder / name
    path.write_text(body)
    return str(path)


# 1. A kept sweep result must have been made by the same resolved config.
def test_sweep_reruns_a_result_of_another_config(tmp_path: Path, capsys) -> None:
    config = _config(tmp_path, "fc.toml", 'dataset = "digits"\nmethod = "dp-fc"\n')
    out = tmp_path / "runs"
    [path] = sweep([config], epsilons=[1.0], seeds=[0], out=out, sets=["learner.epochs=1"])
    assert json.loads(path.read_text())["config"]["learner"] == {"epochs": 1}
    sweep([config], epsilons=[1.0], seeds=[0], out=out, sets=["learner.epochs=2"])
    assert json.loads(path.read_text())["config"]["learner"] == {"epochs": 2}
    assert "differs in: learner.epochs" in capsys.readouterr().err
    before = path.stat().st_mtime_ns
    sweep([config], epsilons=[1.0], seeds=[0], out=out, sets=["learner.epochs=2"])
    assert path.stat().st_mtime_ns == before  # same config: kept
    assert "kept" in capsys.readouterr().err


# 2. Every (config, --set) pair is checked before anything runs.
def test_sweep_checks_every_config_before_the_first_run(tmp_path: Path) -> None:
    fc = _config(tmp_path, "fc.toml", 'dataset = "digits"\nmethod = "dp-fc"\n')
    ls = _config(tmp_path, "ls.toml", 'dataset = "digits"\nmethod = "dp-ls"\n')
    with pytest.raises(DPVisionError, match="unknown learner option 'epochs' for dp-ls"):
        sweep([fc, ls], epsilons=[1.0], seeds=[0], out=tmp_path / "r", sets=["learner.epochs=1"])
    assert not (tmp_path / "r").exists()


# 3. A PrivacyEngine model trained with augmult evaluates on any batch; the EMA is a model.
def test_private_model_with_augmult_evaluates_and_gives_its_ema_model() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 3, (64,)))
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(144, 3))
    model, optimizer, loader = PrivacyEngine().make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        augmult=4,
        ema_decay=0.9,
        seed=0,
    )
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step == 1:  # evaluation in the middle of training records nothing
            model.eval()
            assert model(torch.randn(7, 3, 8, 8)).shape == (7, 3)
            model.train()
    model.eval()
    assert model(torch.randn(1797 % 100, 3, 8, 8)).shape == (97, 3)
    ema = optimizer.ema_model()
    assert not ema.training
    assert torch.equal(ema[3].weight, optimizer.ema.shadow["3.weight"])
    assert not torch.equal(ema[3].weight, net[3].weight)
    assert not ema[0]._forward_hooks  # no recording hooks on the copy
    assert ema(torch.randn(5, 3, 8, 8)).shape == (5, 3)


# 4. An output path that is a folder is refused before the work starts.
@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--json", "{d}"],
        ["train", "--config", "{d}"],
        ["pretrain", "--out", "{d}"],
        ["audit", "--json", "{d}"],
        ["report", "{r}", "--out", "{d}"],
        ["synth", "--kind", "spectral", "--out", "{d}"],
        ["train", "--json", "{d}/missing/x.json"],
        ["sweep", "--config", "{c}", "--epsilons", "1", "--out", "{c}"],
    ],
)
def test_a_folder_or_missing_folder_as_output_is_refused_before_work(
    argv: list[str], tmp_path: Path, capsys
) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    results = tmp_path / "results"
    results.mkdir()
    (results / "r.json").write_text(json.dumps(_fake_result()))
    config = _config(tmp_path, "c.toml", 'dataset = "digits"\n')
    args = [a.format(d=folder, r=results, c=config) for a in argv]
    code, _out, err = _cli(capsys, *args)
    _one_line_error(code, err)
    assert not list(folder.iterdir())
    assert sorted(p.name for p in results.iterdir()) == ["r.json"]  # no PNG left behind


def _fake_result() -> dict:
    return {
        "dataset": "digits",
        "method": "dp-ls",
        "features": "pixels",
        "test_accuracy": 0.9,
        "epsilon": 1.0,
        "delta": 1e-5,
        "accountant": "gaussian",
        "noise_multiplier": 3.0,
        "steps": 3,
        "sample_rate": 1.0,
        "privacy_ledger": [],
        "config": {"epsilon": 1.0, "learner": {}},
    }


# 5. One line, exit 2, for what ended in a traceback.
@pytest.mark.parametrize(
    "argv",
    [
        ["privacy", "epsilon", "--noise-multiplier", "1", "--steps", "10"],
        ["privacy", "noise", "--epsilon", "3", "--steps", "10"],
        ["privacy", "steps", "--epsilon", "3", "--noise-multiplier", "1"],
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_gaussian_accountant_with_sampling_is_one_line(argv, as_json, capsys) -> None:
    common = ["--accountant", "gaussian", "--sample-rate", "0.1", "--delta", "1e-5"]
    code, _, err = _cli(capsys, *argv, *common, *(["--json"] if as_json else []))
    assert "full" in _one_line_error(code, err)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["--seed", "-1"], "seed must be a whole number in [0, 2**63)"),
        (["--set", "learner.clip_norm=abc"], "learner.clip_norm must be a number, got 'abc'"),
        (["--set", "learner.ridge=abc"], 'learner.ridge must be "auto" or a number >= 0'),
        (["--set", "learner.clip_norm=-1"], "learner.clip_norm must be a number > 0"),
    ],
)
def test_bad_values_are_one_line_before_training(sets, message, capsys) -> None:
    code, _, err = _cli(capsys, "train", "--method", "dp-ls", *sets)
    assert message in _one_line_error(code, err)
    assert "loading dataset" not in err  # refused before any work


# 7. Output that reads right.
def test_the_zcdp_figure_does_not_read_as_the_guarantee(capsys) -> None:
    code, out, _ = _cli(capsys, "train", "--quiet", "--method", "dp-ls")
    assert code == 0
    assert "gives ε = 3.7064" not in out
    assert "for comparison only" in out
    assert "the guarantee is the ε above" in out


def test_progress_lines_format_metrics_and_name_augmult_only_when_on() -> None:
    assert format_metrics(
        {"step": 96, "phase": 2, "test_accuracy": 0.5, "test_accuracy_ema": 0.6}
    ) == ("test accuracy 50.00 % (EMA 60.00 %)")


def test_dpsgd_start_line_says_no_augmult(capsys) -> None:
    code, _, err = _cli(
        capsys,
        "train",
        "--method",
        "dp-sgd",
        "--set",
        "learner.model='mlp-8'",
        "--set",
        "learner.steps=1",
        "--set",
        "learner.batch_size=64",
    )
    assert code == 0, err
    assert "K = 0" not in err
    assert "no augmult" in err


def test_changed_pretrain_option_names_the_field(tmp_path: Path, capsys) -> None:
    common = ["--batch-size", "8", "--num-images", "16", "--quiet"]
    checkpoint = ["--checkpoint", str(tmp_path / "ck.pt")]
    out = ["--out", str(tmp_path / "enc.pt")]
    code, _, err = _cli(capsys, "pretrain", *out, "--steps", "1", *checkpoint, *common)
    assert code == 0, err
    code, _, err = _cli(capsys, "pretrain", *out, "--steps", "2", *checkpoint, *common)
    assert "(differs in: steps)" in _one_line_error(code, err)


def test_privacy_steps_says_what_it_is_doing(capsys) -> None:
    code, _out, err = _cli(
        capsys,
        "privacy",
        "steps",
        "--epsilon",
        "1",
        "--noise-multiplier",
        "2",
        "--sample-rate",
        "0.01",
        "--delta",
        "1e-5",
        "--accountant",
        "rdp",
    )
    assert code == 0
    assert "searching with the rdp accountant" in err


def test_summary_of_a_result_without_zcdp_has_no_comparison() -> None:
    result = {**_fake_result(), "epsilon_zcdp": None, "n_train": 1, "n_test": 1}
    result |= {"num_features": 4, "wall_seconds": 0.1}
    assert "zCDP" not in summary(result)


def test_the_calculators_table_is_not_widened_by_a_note(capsys) -> None:
    """The gaussian row's "n/a (exact only for full batch …)" padded every row to 60+
    columns; it runs on past the columns instead."""
    argv = ["privacy", "epsilon", "--noise-multiplier", "1", "--sample-rate", "0.01"]
    code, out, _ = _cli(capsys, *argv, "--steps", "100", "--delta", "1e-5")
    assert code == 0
    lines = out.splitlines()
    assert any(line.startswith("  gaussian     n/a (exact only for full batch") for line in lines)
    table = [line for line in lines[1:] if "n/a" not in line]
    assert max(len(line) for line in table) < 30, table
    assert all(line == line.rstrip() for line in lines)
