"""benchmarks/cifar10.py: every row's commands resolve to a valid run, a row runs and lands
in the store with what it measured, and the page says where each row stands.

No CIFAR-10 is read: the commands are parsed and resolved (as the docs' commands are, in
tests/test_docs_code.py), and the run goes through a digits row.
"""

from __future__ import annotations

import itertools
import json
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cifar10  # noqa: E402 (the benchmark is a script folder, not a package)
import cifar10_page  # noqa: E402


def test_rows_are_unique_and_name_what_they_compare() -> None:
    keys = [row.key for row in cifar10.ROWS]
    assert len(keys) == len(set(keys))
    for row in cifar10.ROWS:
        assert row.published is None or 0 < row.published < 1
        assert row.commands
        assert row.commands[-1][0] == "train"
        assert row.seeds in (1, 3)
    papers = {row.paper for row in cifar10.ROWS}
    assert papers == {cifar10.T0, cifar10.T2, cifar10.T3, cifar10.T4, cifar10.DPV}


@pytest.mark.parametrize("row", cifar10.ROWS, ids=lambda row: row.key)
def test_every_command_resolves_to_a_valid_run(
    row: cifar10.Row, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dpvision.cli import build_parser
    from dpvision.cli.arguments import run_flags
    from dpvision.config import resolve

    monkeypatch.chdir(ROOT)
    (tmp_path / "encoder_wrn10_1.pt").touch()
    (tmp_path / "encoder.pt").touch()
    for command in row.commands:
        argv = cifar10._fill(command, seed="0", json=str(tmp_path / "r.json"), work=str(tmp_path))
        args = build_parser().parse_args(argv)
        if argv[0] != "train":
            continue
        config = resolve(args.config, run_flags(args), list(args.set))
        assert config.dataset == "cifar10-jpeg"
        if config.method in ("dp-sgd", "dp-randp"):
            assert config.dpsgd is not None  # the learner options validate
        assert config.epsilon == row.epsilon or (
            config.epsilon is None and config.noise_multiplier is not None
        )


def _row(**changes: object) -> cifar10.Row:
    base = cifar10.Row(
        key="digits-dp-ls",
        paper="A paper",
        table="Table 9",
        what="dp-ls on digits",
        epsilon=1.0,
        published=0.5,
        commands=(
            (
                "train",
                "--dataset",
                "digits",
                "--method",
                "dp-ls",
                "--features",
                "pixels",
                "--epsilon",
                "1",
                "--quiet",
            ),
        ),
        seeds=1,
    )
    return cifar10.Row(**{**base.__dict__, **changes})  # type: ignore[arg-type]


def test_a_row_runs_and_its_measurements_land_in_the_store(tmp_path: Path) -> None:
    store = {"copy": "x", "runs": [], "projections": []}
    saved: list[dict] = []
    original = cifar10._save
    cifar10._save = lambda s: saved.append(json.loads(json.dumps(s)))  # type: ignore[assignment]
    try:
        cifar10.run_row(_row(), [0], tmp_path, store)
    finally:
        cifar10._save = original  # type: ignore[assignment]
    (run,) = store["runs"]
    assert run["row"] == "digits-dp-ls"
    assert run["seed"] == 0
    assert run["dataset"] == "digits"
    assert 0.3 < run["test_accuracy"] <= 1
    assert run["epsilon"] <= 1.0
    assert run["wall_seconds"] > 0
    assert 0.05 < run["peak_rss_gib"] < 16
    assert run["commit"]
    assert run["commands"] == [shlex.join(["dpvision", *_row().commands[0]])]
    assert saved[-1]["runs"] == store["runs"]


def _page(tmp_path: Path, rows: list[cifar10.Row], runs: list[dict]) -> str:
    store = {"runs": runs, "projections": []}
    page = tmp_path / "page.md"
    cifar10_page.write_page(rows, store, page, "the copy", 0.03)
    return page.read_text()


def _run(row: str, accuracy: float, seed: int = 0) -> dict:
    return {
        "row": row,
        "seed": seed,
        "test_accuracy": accuracy,
        "epsilon": 0.999,
        "wall_seconds": 60.0,
        "peak_rss_gib": 1.0,
        "commit": "abc",
        "machine": "x86_64, 2 cores",
    }


def test_the_page_says_where_each_row_stands_against_the_paper(tmp_path: Path) -> None:
    rows = [_row(key=k, published=0.70) for k in ("in", "copy", "far", "none", "gpu")]
    rows[-1] = _row(key="gpu", published=0.70, gpu=True)
    runs = [
        _run("in", 0.69),
        _run("copy", 0.665),
        _run("far", 0.60),
        _run("far", 0.62, seed=1),
        _run("far", 0.61, seed=2),
    ]
    text = _page(tmp_path, rows, runs)
    line = {key: next(x for x in text.splitlines() if f"`{key}`" in x) for key in ("in", "copy")}
    assert "within the band" in line["in"]
    assert "within the copy's expected cost" in line["copy"]
    far = next(x for x in text.splitlines() if "`far`" in x)
    assert "**61.00** (60.00–62.00)" in far
    assert "**unexplained**" in far
    assert "not run yet" in next(x for x in text.splitlines() if "`none`" in x)
    gpu = next(x for x in text.splitlines() if "`gpu`" in x)
    assert "`scripts/gpu-check --cifar` projects it on a GPU and runs it" in gpu
    assert "the copy" in text


def test_a_projection_whose_steps_did_not_separate_is_a_lower_bound() -> None:
    projection = {
        "projected_seconds": 8.0e6,
        "device": "cpu",
        "machine": "x86_64, 2 cores",
        "timed_steps": [2, 4],
        "parts": [
            {"command": "pretrain", "seconds_per_step": 97.7, "steps": 82031},
            {"command": "train", "seconds_per_step": 0.0, "steps": 875},
        ],
    }
    text = cifar10_page._projection(projection)
    assert text.startswith("projected at least 93 days on cpu")
    assert "a lower bound: the train part's two timed runs did not separate" in text
    projection["parts"].pop()
    assert "lower bound" not in cifar10_page._projection(projection)


def test_a_reason_replaces_unexplained(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(cifar10_page.WHY, "far", "the non-private run is 5 points lower too")
    text = _page(tmp_path, [_row(key="far", published=0.7)], [_run("far", 0.6)])
    assert "the non-private run is 5 points lower too" in text
    assert "unexplained" not in text


def test_a_reason_fills_in_the_measurements_it_rests_on(tmp_path: Path, monkeypatch) -> None:
    """A CPU-sized row (no level to reach) shows its reason too, with the median of the
    row the reason names, or says that row has not run."""
    monkeypatch.setitem(
        cifar10_page.WHY, "small", "its ceiling is {ceiling} ({range:ceiling}), not {other}"
    )
    rows = [_row(key="small", published=0.7, level=False), _row(key="ceiling", published=None)]
    runs = [_run("small", 0.4), _run("ceiling", 0.45, seed=0), _run("ceiling", 0.47, seed=1)]
    text = _page(tmp_path, rows, runs)
    assert "its ceiling is 46.00 (45.00–47.00), not (`other`: not run yet)" in text


def test_a_projection_times_k_and_2k_steps_of_each_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cifar10, "RESULTS", tmp_path / "cifar10.json")  # not the page's store
    row = _row(
        key="digits-pretrain-and-train",
        commands=(
            ("pretrain", "--model", "mlp-16", "--synthetic", "dead-leaves-squares", "--size", "8",
             "--channels", "1", "--num-images", "64", "--batch-size", "16",
             "--out", "{work}/encoder.pt", "--quiet"),
            ("train", "--dataset", "digits", "--method", "dp-sgd", "--features", "pixels",
             "--epsilon", "1", "--set", 'learner.model="mlp-16"', "--set",
             "learner.batch_size=64", "--quiet"),
        ),
        steps=500,
        pretrain_steps=1000,
    )  # fmt: skip
    store = {"copy": "x", "runs": [], "projections": []}
    original = cifar10._save
    cifar10._save = lambda s: None  # type: ignore[assignment]
    try:
        cifar10.project_row(row, tmp_path, store, 1, batch=16)
    finally:
        cifar10._save = original  # type: ignore[assignment]
    (projection,) = store["projections"]
    assert projection["timed_steps"] == [1, 2]
    assert [part["command"] for part in projection["parts"]] == ["pretrain", "train"]
    assert [part["steps"] for part in projection["parts"]] == [1000, 500]
    assert projection["projected_seconds"] > 0
    assert projection["device"] == "cpu"
    # The timed runs' short encoder is kept apart: the row itself would skip a made file.
    assert not (tmp_path / "encoder.pt").exists()
    assert (tmp_path / "projection" / "encoder.pt").exists()
    log = (tmp_path / "p.log").read_text()
    assert "--steps 1" in log
    assert "learner.steps=2" in log
    # Timed at B = 16, K = 1; the row's step has B = 64: four times the views.
    assert "learner.batch_size=16" in log
    assert projection["parts"][1]["views_scale"] == 4.0


def test_the_ablation_adds_one_technique_per_row_in_the_papers_order() -> None:
    from dpvision.cli import build_parser
    from dpvision.cli.arguments import run_flags
    from dpvision.config import resolve

    def learner(row: cifar10.Row) -> dict:
        args = build_parser().parse_args(list(row.commands[-1]))
        return dict(resolve(args.config, run_flags(args), list(args.set)).learner)

    rows = [row for row in cifar10.ROWS if row.key.startswith("t3-ablation-")]
    *rows, ceiling = rows
    assert ceiling.key == "t3-ablation-nonprivate"
    steps = [learner(row) for row in rows]
    assert learner(ceiling) == steps[-1]  # the last step's recipe, at ε = ∞
    command = ceiling.commands[-1]
    assert command[command.index("--epsilon") + 1] == "inf"
    first = steps[0]
    assert first["model_args"] == {
        "depth": 10,
        "width": 1,
        "group_norm": False,
        "standardize": False,
    }
    assert (first["batch_size"], first["augmult"], first["ema_decay"]) == (256, 0, 0.0)
    changed = []
    for before, after in itertools.pairwise(steps):
        flat = {**before, **before["model_args"]}
        now = {**after, **after["model_args"]}
        changed.append(sorted(k for k in now if k != "model_args" and now[k] != flat.get(k)))
    assert changed == [
        ["group_norm"],
        ["batch_size"],
        ["standardize"],
        ["augmult"],
        ["ema_decay"],
    ]


def test_a_claim_row_shows_its_difference_beside_the_papers(tmp_path: Path) -> None:
    base = _row(key="scratch", published=0.57, level=False)
    claim = _row(key="prior", published=0.72, level=False, against="scratch", published_delta=0.15)
    worse = _row(key="worse", published=None, against="scratch", published_delta=0.1)
    text = _page(
        tmp_path,
        [base, claim, worse],
        [_run("scratch", 0.40), _run("prior", 0.45), _run("worse", 0.38)],
    )
    prior = next(x for x in text.splitlines() if "`prior`:" in x)
    assert "+5.00 points against `scratch` (paper +15.0: same direction)" in prior
    assert "unexplained" not in prior  # a CPU-sized stand-in is not held to the level
    worse_line = next(x for x in text.splitlines() if "`worse`:" in x)
    assert "-2.00 points against `scratch` (paper +10.0: **opposite**)" in worse_line


def test_every_cifar10_config_resolves_on_the_jpeg_copy(monkeypatch) -> None:
    import tomllib

    from dpvision.config import resolve
    from dpvision.errors import DPVisionError

    monkeypatch.chdir(ROOT)
    files = [
        path
        for path in sorted((ROOT / "configs").rglob("*.toml"))
        if tomllib.loads(path.read_text()).get("dataset") == "cifar10"
    ]
    assert len(files) >= 40
    resolved = 0
    for path in files:
        try:
            resolve(path)
        except DPVisionError:
            continue  # needs a weight file first (the fine-tuning configs): not a data question
        config = resolve(path, {"dataset": "cifar10-jpeg"}, [])
        assert config.dataset == "cifar10-jpeg", path
        resolved += 1
    assert resolved >= 30


def test_missing_seeds_only_runs_what_the_store_lacks(tmp_path: Path) -> None:
    done = _run("digits-dp-ls", 0.9)
    store = {"copy": "x", "runs": [done], "projections": []}
    cifar10.run_row(_row(), [0], tmp_path, store, skip_done=True)
    assert store["runs"] == [done]
    assert not (tmp_path / "digits-dp-ls.log").exists()


def test_the_best_on_a_cpu_is_the_best_cpu_median_at_each_epsilon(tmp_path: Path) -> None:
    """The summary takes the highest median among the CPU rows at that ε (not a GPU row, not
    another ε), with its seeds and wall time, and fills the ablation's measurements in."""
    rows = [
        _row(key="low", published=0.6, epsilon=3.0),
        _row(key="high", published=0.6, epsilon=3.0),
        _row(key="gpu", published=0.6, epsilon=3.0, gpu=True),
        _row(key="other-epsilon", published=0.6, epsilon=1.0),
    ]
    runs = [_run("low", 0.50), _run("high", 0.62), _run("high", 0.64, seed=1), _run("gpu", 0.9)]
    runs.append(_run("other-epsilon", 0.8))
    targets = {3.0: {"target": 0.72, "published": (("seed 004", 0.693),)}}
    by_row: dict[str, list[dict[str, object]]] = {}
    for run in runs:
        by_row.setdefault(str(run["row"]), []).append(run)
    lines = cifar10_page._best_on_cpu(rows, by_row, targets, "low {low}, high {high}, {none}")
    line = next(x for x in lines if x.startswith("| 3 "))
    for cell in ("`high`", "**63.00**", "| 2 |", "72.00", "seed 004: 69.30"):
        assert cell in line
    assert "low 50.00, high 63.00, (`none`: not run yet)" in lines
    nothing = cifar10_page._best_on_cpu(rows, by_row, {8.0: targets[3.0]}, "")
    assert "not run yet" in next(x for x in nothing if x.startswith("| 8 "))
