"""``dpvision sweep`` and ``dpvision report``: privacy-utility grids, tables and plots.

:func:`sweep` runs configs over a grid of target ε and seeds and writes one result JSON per
run (the DESIGN.md contract, the resolved config inside, ``[reference]`` included) to a
folder; a run whose JSON is already there, made by the same resolved config, is kept (so an
interrupted sweep resumes), and one made by another config (a smoke run's ``--set``) is
rerun, naming what differs. Every (config, ``--set``) pair is validated before any run.

:func:`report` reads every result JSON of a folder and writes a markdown report beside one
PNG per dataset:

* a table per dataset: for each setup (method, features, model) and target ε, the median
  test accuracy over seeds, the min–max spread, the published number beside it
  (``[reference]``) and the difference;
* flags: a run whose reported ε exceeds its target, and a run at the published ε whose
  accuracy lies outside the config's ``reference.band``;
* the privacy ledger of every run, summarised (σ, q, steps, accountant, what was released);
* the plot: test accuracy against ε (log axis) per setup, the seeds' spread as error bars,
  and the published points overlaid.

Everything here reads results (already released models' test accuracies and ledgers):
nothing touches private training data.
"""

# local imports: start-up time (heavy modules are imported in the functions using them)
import dataclasses
import json
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpvision.errors import DPVisionError
from dpvision.log import remaining, say

if TYPE_CHECKING:
    from dpvision.config import TrainConfig

#: Relative slack when comparing a reported ε with its target (float printing only).
EPSILON_SLACK = 1e-9
#: A run is "at" a published ε when its ε is within this relative distance (a fixed-σ run
#: reproducing a published σ lands near, not on, the published ε).
SAME_EPSILON = 0.01


def _same_epsilon(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=SAME_EPSILON)


def _format_epsilon(epsilon: float) -> str:
    return "inf" if math.isinf(epsilon) else f"{epsilon:g}".replace(".", "p")


def sweep(
    configs: Sequence[str | Path],
    *,
    epsilons: Sequence[float],
    seeds: Sequence[int],
    out: str | Path,
    sets: Sequence[str] = (),
    data_dir: str | None = None,
    quiet: bool = False,
) -> list[Path]:
    """Runs every config at every target ε and seed; returns the result files (new or kept).

    A result already in ``out`` is kept only when its config is the one this run resolves
    to (the data folder aside); otherwise the run is redone.

    Privacy: each run is a separate private training of its own config (its own ledger);
    the runs are not composed with each other, so a sweep over ε on the same data spends
    the sum of their budgets if all the models are released. ``--seeds`` varies the public
    ``seed`` only: a single ``imagefolder:`` tree keeps one test split (keyed by
    ``split_seed``), released exactly, across the runs, and configs that would split one
    tree in two ways are refused before any run (:func:`_one_split_per_tree`).
    """
    from dpvision.config import resolve
    from dpvision.fileio import write_json_atomic
    from dpvision.runs.train import run_training

    if not configs:
        raise DPVisionError("give at least one --config")
    if not epsilons or not seeds:
        raise DPVisionError("give at least one ε (--epsilons) and one seed (--seeds)")
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise DPVisionError(f"--out {folder} is a file; give a folder")
    # Every (config, ε, seed) is resolved and validated before the first run starts.
    planned = [
        (
            file,
            epsilon,
            seed,
            resolve(file, {"epsilon": epsilon, "seed": seed, "data_dir": data_dir}, list(sets)),
        )
        for file in configs
        for epsilon in epsilons
        for seed in seeds
    ]
    _one_split_per_tree([config for _, _, _, config in planned])
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    ran, seconds = 0, 0.0  # runs trained here and their time, for the time left
    for index, (file, epsilon, seed, config) in enumerate(planned, 1):
        name = f"{Path(file).stem}_eps{_format_epsilon(epsilon)}_seed{seed}.json"
        path = folder / name
        written.append(path)
        stale = _stale(path, config)
        if stale is None:
            say(f"{name} exists (same config), kept", quiet)
            continue
        if stale:
            say(f"{name} was made by another config (differs in: {stale}); rerunning", quiet)
        left = remaining(ran, ran + len(planned) - index + 1, seconds)
        say(f"run {index}/{len(planned)} ({name}){': ' + left if left else ''}", quiet)
        clock = time.monotonic()
        result = run_training(config, quiet=True)
        ran, seconds = ran + 1, seconds + time.monotonic() - clock
        result["sweep_config"] = str(file)
        write_json_atomic(path, result)
        say(
            f"{name}: test accuracy {result['test_accuracy']:.4f}, ε = {result['epsilon']:.4g}",
            quiet,
        )
    return written


def _one_split_per_tree(configs: Sequence["TrainConfig"]) -> None:
    """Refuses, by the configs alone, a sweep whose configs split one ``imagefolder:``
    tree in two ways (``split_seed``, ``test_fraction``): an image would be released exactly
    as test data by one run and be private training data of another."""
    from dpvision.data.datasets import same_dataset

    seen: list[tuple[str, tuple[int, float]]] = []
    for config in configs:
        if not config.dataset.strip().lower().startswith("imagefolder:"):
            continue
        split = (config.split_seed, config.test_fraction)
        for dataset, other in seen:
            if same_dataset(dataset, config.dataset) and other != split:
                raise DPVisionError(
                    f"the sweep's configs split {config.dataset} in two ways (split_seed, "
                    f"test_fraction = {other[0]}, {other[1]:g} and {split[0]}, {split[1]:g}): "
                    "an image would be test data, released exactly, in one run and private "
                    "training data in another; give them one split_seed and test_fraction"
                )
        seen.append((config.dataset, split))


def _stale(path: Path, config: "TrainConfig") -> str | None:
    """None when ``path`` holds a result of exactly ``config`` (where the data files are
    aside); else what differs ("" when there is no readable result).

    The result records the config its run resolved, the default recipe's choices filled in
    (``method``, ``features``, ``preprocessing``, the schedule); ``config`` is compared with
    it after the same choices, as the result's ``recipe.set`` records them, are filled into
    what ``config`` leaves ``auto`` (:func:`_with_recipe`).
    """
    from dpvision.fileio import differing_keys

    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(kept, dict) or not isinstance(kept.get("config"), dict):
        return ""
    recipe = kept.get("recipe")
    chosen = recipe.get("set") if isinstance(recipe, dict) else None
    try:
        resolved = _with_recipe(config, chosen if isinstance(chosen, dict) else {})
    except (DPVisionError, TypeError, ValueError):  # a garbled recipe entry: not this config's
        resolved = config
    ours = json.loads(json.dumps(resolved.to_dict()))  # inf, tuples: as they read back from JSON
    theirs = dict(kept["config"])
    if "split_seed" not in theirs:  # from before split_seed: a tree was split by its seed
        tree = str(theirs.get("dataset", "")).strip().lower().startswith("imagefolder:")
        theirs["split_seed"] = theirs.get("seed") if tree else ours.get("split_seed")
    differ = [k for k in differing_keys(ours, theirs) if k != "data_dir"]
    return ", ".join(differ) if differ else None


def _with_recipe(config: "TrainConfig", chosen: dict[str, Any]) -> "TrainConfig":
    """``config`` with the default recipe's recorded choices (a result's ``recipe.set``:
    ``method``, ``features``, ``preprocessing``, ``learner.KEY``) filled in, each only where
    ``config`` leaves it to the recipe, as :func:`dpvision.runs.auto.apply_recipe` fills
    them: an option ``config`` sets itself keeps its value (and so differs when the kept
    run's differs). Reads no data."""
    from dpvision.config import validate
    from dpvision.recipes import AUTO

    if not chosen:
        return config
    method, features, pre = config.method, config.features, config.preprocessing
    learner = dict(config.learner)
    if config.features == AUTO and isinstance(chosen.get("features"), str):
        features = chosen["features"]
    if config.preprocessing.kind == AUTO and isinstance(chosen.get("preprocessing"), dict):
        pre = dataclasses.replace(pre, **chosen["preprocessing"])
    if config.method == AUTO and isinstance(chosen.get("method"), str):
        method = chosen["method"]
        for key, value in chosen.items():
            option = key.removeprefix("learner.")
            if key.startswith("learner.") and option != "model" and option not in learner:
                learner[option] = value
    if learner.get("model", AUTO) == AUTO and "learner.model" in chosen:
        learner["model"] = chosen["learner.model"]
    if (method, features, pre, learner) == (
        config.method,
        config.features,
        config.preprocessing,
        config.learner,
    ):
        return config
    return validate(
        dataclasses.replace(
            config, method=method, features=features, preprocessing=pre, learner=learner
        )
    )


# --- report ------------------------------------------------------------------------------


def load_results(folders: str | Path | Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every result JSON under ``folders`` (recursively), each with its ``_file``."""
    roots = [Path(folders)] if isinstance(folders, str | Path) else [Path(f) for f in folders]
    results = []
    for root in roots:
        if not root.is_dir():
            raise DPVisionError(f"{root}: no such folder of result JSONs")
        for path in sorted(root.rglob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and {"test_accuracy", "epsilon", "config"} <= set(data):
                relative = path.relative_to(root)
                data["_file"] = str(relative if len(roots) == 1 else root.name / relative)
                results.append(data)
    if not results:
        names = ", ".join(str(r) for r in roots)
        raise DPVisionError(f"{names}: no dpvision result JSONs found (run dpvision sweep)")
    return results


#: The learner option that sets a feature learner's training length, shown as ``E=…``:
#: Mehta et al. report DP-Newton, DP-FC and DP-Adam at 1, 10 and 100 epochs as separate setups.
_LENGTH_OPTION = {"dp-fc": "epochs", "dp-newton": "iterations", "dp-sgd-linear": "epochs"}


def setup_label(result: dict[str, Any]) -> str:
    """What a run trained: method, features, model, augmentation multiplicity and, for the
    iterative feature learners, the number of epochs (e.g. ``dp-sgd · pixels · tanh-cnn ·
    K=4``, ``dp-fc · vit-b16-i21k · E=10``). Runs with the same label are one setup.

    A run of the default recipe (``method = "auto"``) is labelled ``default recipe``, and the
    number of epochs is shown only where the config set it: the recipe chooses it per ε
    (the result's ``recipe.set``), so one recipe config is one setup, one curve.

    Precomputed features are named by their folder (``precomputed:path=features/cifar10/
    vit-b16-i21k`` is ``vit-b16-i21k``)."""
    features = str(result.get("features", "pixels"))
    if features.startswith("precomputed:"):
        features = Path(features.partition("path=")[2].split(",")[0].rstrip("/")).name
    label = f"{result['method']} · {features}"
    if result.get("model"):
        label += f" · {result['model']}"
    learner = result["config"].get("learner") or {}
    recipe = result.get("recipe")
    chosen = recipe.get("set") if isinstance(recipe, dict) else None
    chosen = chosen if isinstance(chosen, dict) else {}
    if "method" in chosen:
        label += " · default recipe"
    if learner.get("augmult", 0):
        label += f" · K={learner['augmult']}"
    option = _LENGTH_OPTION.get(result["method"])
    if option is not None and f"learner.{option}" not in chosen:
        from dpvision.learners import LEARNERS

        length = learner.get(option, LEARNERS[result["method"]]().get_params()[option])
        label += f" · E={length:g}"
    return label


def published_points(
    configs: Sequence[str | Path],
) -> dict[tuple[str, str], set[tuple[float, float, str]]]:
    """(dataset, setup) → the published (ε, accuracy, source) points of these configs'
    ``[reference]`` tables; the setup is labelled as :func:`setup_label` labels runs."""
    from dpvision.config import resolve

    out: dict[tuple[str, str], set[tuple[float, float, str]]] = defaultdict(set)
    for file in configs:
        config = resolve(file)
        as_run = {
            "method": config.method,
            "features": config.features,
            "model": config.learner.get("model"),
            "config": config.to_dict(),
        }
        out[(config.dataset, setup_label(as_run))].update(_reference_points(config.reference))
    return out


def _reference_points(reference: dict[str, Any]) -> set[tuple[float, float, str]]:
    if not reference:
        return set()
    points = {(float(e), float(a), reference["source"]) for e, a in reference.get("points", [])}
    if reference.get("accuracy") is not None and reference.get("epsilon") is not None:
        points.add((float(reference["epsilon"]), float(reference["accuracy"]), reference["source"]))
    return points


def target_epsilon(result: dict[str, Any]) -> float | None:
    """The run's target ε, or None when it ran at a fixed σ."""
    value = result["config"].get("epsilon")
    return None if value is None else float(value)


def run_flags(result: dict[str, Any]) -> list[str]:
    """What is wrong with a run: ε above its target, accuracy outside the published band."""
    flags = []
    target = target_epsilon(result)
    epsilon = float(result["epsilon"])
    if target is not None and epsilon > target * (1 + EPSILON_SLACK):
        flags.append(f"ε {epsilon:.6g} exceeds the target {target:g}")
    reference = result["config"].get("reference") or {}
    band = reference.get("band")
    at = reference.get("epsilon")
    grid = target if target is not None else epsilon
    if band is not None and (at is None or _same_epsilon(grid, float(at))):
        accuracy = float(result["test_accuracy"])
        if not band[0] <= accuracy <= band[1]:
            flags.append(
                f"accuracy {100 * accuracy:.2f} % outside the band "
                f"{100 * band[0]:.1f}–{100 * band[1]:.1f} %"
            )
    return flags


def _groups(results: list[dict[str, Any]]) -> dict[str, dict[tuple[str, float], list[Any]]]:
    """dataset → (setup, ε) → runs; ε is the target, or the reported ε at a fixed σ."""
    out: dict[str, dict[tuple[str, float], list[Any]]] = defaultdict(lambda: defaultdict(list))
    for result in results:
        target = target_epsilon(result)
        epsilon = target if target is not None else round(float(result["epsilon"]), 3)
        out[result["dataset"]][(setup_label(result), epsilon)].append(result)
    return out


def _published(runs: list[dict[str, Any]]) -> set[tuple[float, float, str]]:
    points: set[tuple[float, float, str]] = set()
    for run in runs:
        points.update(_reference_points(run["config"].get("reference") or {}))
    return points


def _ledger_summary(result: dict[str, Any]) -> str:
    entries = result.get("privacy_ledger") or []
    parts = []
    for entry in entries:
        sigma = entry.get("noise_multiplier")
        what = entry.get("released", "?")
        rate = entry.get("sample_rate", 1.0)
        count = entry.get("count", 1)
        noise = "no noise" if sigma is None else f"σ {sigma:.4g}"
        parts.append(f"{count}× {what} ({noise}, q {rate:.4g})")
    return "; ".join(parts) or "empty"


def report(
    folders: str | Path | Sequence[str | Path],
    out: str | Path | None = None,
    *,
    references: Sequence[str | Path] = (),
) -> dict[str, Any]:
    """Writes the markdown report (default ``FOLDER/report.md``, the first folder) and one
    PNG per dataset. ``references``: configs whose published points are plotted too.

    Returns a summary: the report's path, the PNGs, the rows and the flagged runs.
    """
    from dpvision.fileio import atomic_open

    roots = [folders] if isinstance(folders, str | Path) else list(folders)
    out_path = Path(out) if out is not None else Path(roots[0]) / "report.md"
    if out_path.is_dir() or (out is not None and not out_path.parent.is_dir()):  # before writing
        raise DPVisionError(f"cannot write the report to {out_path}: not a file in a folder")
    results = load_results(roots)
    extra = published_points(references)
    where = ", ".join(f"`{r}`" for r in roots)
    lines = ["# dpvision report", ""]
    lines += [f"{len(results)} runs from {where}. Accuracy is test accuracy in %.", ""]
    flagged = []
    rows = []
    pngs = []
    for dataset, groups in sorted(_groups(results).items()):
        lines += [f"## {dataset}", ""]
        lines += [
            "| setup | target ε | runs | median | min–max | paper | Δ (median − paper) | flags |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for (label, epsilon), runs in sorted(groups.items()):
            accuracies = [100 * float(r["test_accuracy"]) for r in runs]
            median = statistics.median(accuracies)
            paper = None
            for at, accuracy, _ in sorted(extra.get((dataset, label), ())):
                if _same_epsilon(at, epsilon):
                    paper = 100 * accuracy
            for run in runs:
                reference = run["config"].get("reference") or {}
                published_at = reference.get("epsilon")
                if reference.get("accuracy") is not None and (
                    published_at is None or _same_epsilon(float(published_at), epsilon)
                ):
                    paper = 100 * float(reference["accuracy"])
            run_problems = [(r["_file"], f) for r in runs for f in run_flags(r)]
            flagged += run_problems
            rows.append(
                {
                    "dataset": dataset,
                    "setup": label,
                    "epsilon": epsilon,
                    "runs": len(runs),
                    "median": median,
                    "min": min(accuracies),
                    "max": max(accuracies),
                    "paper": paper,
                    "flags": [f for _, f in run_problems],
                }
            )
            lines.append(
                f"| {label} | {epsilon:g} | {len(runs)} | {median:.2f} | "
                f"{min(accuracies):.2f}–{max(accuracies):.2f} | "
                f"{'—' if paper is None else f'{paper:.1f}'} | "
                f"{'—' if paper is None else f'{median - paper:+.2f}'} | "
                f"{'**' + '; '.join(f for _, f in run_problems) + '**' if run_problems else ''} |"
            )
        png = out_path.with_name(
            f"{out_path.stem}-{dataset.replace(':', '_').replace('/', '_')}.png"
        )
        points = set().union(*(v for (d, _), v in extra.items() if d == dataset))
        plot_curves(dataset, groups, png, points)
        pngs.append(png)
        lines += ["", f"![privacy-utility on {dataset}]({png.name})", ""]
        curves = [r for runs in groups.values() for r in runs if len(_history(r)) >= 2]
        if curves:
            png = png.with_name(f"{png.stem}-training.png")
            plot_history(dataset, curves, png)
            pngs.append(png)
            lines += [f"![training curves on {dataset}]({png.name})", ""]
    lines += ["## Flags", ""]
    if flagged:
        lines += [f"- **{file}**: {flag}" for file, flag in flagged]
    else:
        lines.append(
            "None: no run reports an ε above its target, and every run at a published ε "
            "lies inside its config's band."
        )
    lines += ["", "## Privacy ledgers", "", "| run | ε | δ | accountant | ledger |"]
    lines += ["|---|---:|---:|---|---|"]
    for result in results:
        lines.append(
            f"| {result['_file']} | {float(result['epsilon']):.4g} | {result.get('delta', '')} | "
            f"{result.get('accountant', '')} | {_ledger_summary(result)} |"
        )
    lines.append("")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(out_path, "w") as handle:
        handle.write("\n".join(lines))
    return {"report": out_path, "plots": pngs, "rows": rows, "flagged": flagged}


def _history(result: dict[str, Any]) -> list[tuple[int, float, str]]:
    """(step, accuracy in %, split) of a run's ``history``: the validation split's where
    the run held one out, else the test set's (the EMA's when it kept one)."""
    points = []
    for entry in result.get("history") or []:
        for split in ("validation", "test"):
            value = entry.get(f"{split}_accuracy_ema", entry.get(f"{split}_accuracy"))
            if value is not None:
                points.append((int(entry["step"]), 100 * float(value), split))
                break
    split = "validation" if any(s == "validation" for *_, s in points) else "test"
    return [p for p in points if p[2] == split]


def plot_history(dataset: str, results: list[dict[str, Any]], path: Path) -> None:
    """Accuracy against training step, one line per run (from each result's ``history``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpvision.fileio import atomic_open

    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    splits: set[str] = set()
    for result in sorted(results, key=lambda r: r["_file"]):
        points = _history(result)
        splits.update(s for *_, s in points)
        axes.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker=".",
            label=f"{result['_file']} (ε = {float(result['epsilon']):.3g})",
        )
    axes.set_xlabel("step")
    axes.set_ylabel(f"{' / '.join(sorted(splits))} accuracy (%)")
    axes.set_title(f"{dataset}: accuracy during training")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    figure.tight_layout()
    with atomic_open(path, "wb") as handle:
        figure.savefig(handle, format="png")
    plt.close(figure)


def plot_curves(
    dataset: str,
    groups: dict[tuple[str, float], list[dict[str, Any]]],
    path: Path,
    published: set[tuple[float, float, str]] | None = None,
) -> None:
    """Accuracy against ε (log axis) per setup, with the seeds' spread and published points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpvision.fileio import atomic_open

    by_setup: dict[str, list[tuple[float, list[float]]]] = defaultdict(list)
    published = set(published or ())
    for (label, epsilon), runs in groups.items():
        if math.isfinite(epsilon):
            by_setup[label].append((epsilon, [100 * float(r["test_accuracy"]) for r in runs]))
        published.update(_published(runs))
    figure, axes = plt.subplots(figsize=(8, 6), dpi=120)
    ticks: set[float] = set()
    for label, points in sorted(by_setup.items()):
        points.sort()
        xs = [e for e, _ in points]
        ticks.update(xs)
        medians = [statistics.median(a) for _, a in points]
        low = [m - min(a) for m, (_, a) in zip(medians, points, strict=True)]
        high = [max(a) - m for m, (_, a) in zip(medians, points, strict=True)]
        axes.errorbar(xs, medians, yerr=[low, high], marker="o", capsize=3, label=label)
    # Published points in black, one marker shape per source, so they never read as runs.
    for source, marker in zip(sorted({s for _, _, s in published}), "*DP^sXv", strict=False):
        xs = [e for e, _, s in published if s == source]
        ys = [100 * a for _, a, s in published if s == source]
        ticks.update(xs)
        size = 170 if marker == "*" else 70
        axes.scatter(
            xs, ys, marker=marker, s=size, color="black", zorder=5, label=f"published: {source}"
        )
    axes.set_xscale("log")
    if ticks:
        axes.set_xticks(sorted(ticks))
        axes.set_xticklabels([f"{t:g}" for t in sorted(ticks)])
        axes.minorticks_off()
    axes.set_xlabel("ε (log scale), δ as in each config")
    axes.set_ylabel("test accuracy (%)")
    axes.set_title(f"{dataset}: privacy-utility (median over seeds, bars: min–max)")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    figure.tight_layout()
    with atomic_open(path, "wb") as handle:
        figure.savefig(handle, format="png")
    plt.close(figure)
