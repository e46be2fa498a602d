"""``dpvision sweep``: configs run over a grid of target ε and seeds, one result JSON each.

A run whose JSON is already there, made by the same resolved config, is kept (so an
interrupted sweep resumes), and one made by another config (a smoke run's ``--set``) is
rerun, naming what differs. Every (config, ``--set``) pair is validated before any run.

Privacy:
  Runs the configs' own commands (each run's guarantees are its own); publishes their
  result JSONs under names made of public settings (config, target ε, seed).
"""

# local imports: start-up time (heavy modules are imported in the functions using them)
import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpvision.errors import DPVisionError
from dpvision.log import remaining, say

if TYPE_CHECKING:
    from dpvision.config import TrainConfig


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
            f"{name}: test accuracy {100 * result['test_accuracy']:.2f} %, "
            f"ε = {result['epsilon']:.4g}",
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
    """``config`` with the recipe's recorded choices (a result's ``recipe.set``: ``method``,
    ``features``, ``preprocessing``, ``learner.KEY`` of the default recipe or of ``dp-sgd``'s
    schedule) filled in, each only where ``config`` leaves it to the recipe, as
    :func:`dpvision.runs.auto.apply_recipe` fills them: an option ``config`` sets itself
    keeps its value (and so differs when the kept run's differs). Reads no data."""
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
    if method != AUTO and (config.method == AUTO or config.method == "dp-sgd"):
        # the default recipe's schedule, or dp-sgd's (for the options the config leaves)
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
