"""Result JSONs read back for the report: loading, setup labels, published points, flags.

Privacy:
  Reads results (released models' test accuracies and ledgers); touches no private data.
"""

# local imports: start-up time (heavy modules are imported in the functions using them)
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpvision.errors import DPVisionError

if TYPE_CHECKING:
    pass


#: Relative slack when comparing a reported ε with its target (float printing only).
EPSILON_SLACK = 1e-9
#: A run is "at" a published ε when its ε is within this relative distance (a fixed-σ run
#: reproducing a published σ lands near, not on, the published ε).
SAME_EPSILON = 0.01


def _same_epsilon(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=SAME_EPSILON)


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
                + (_caveat(result.get("dataset")) if accuracy < band[0] else "")
            )
    return flags


def _caveat(dataset: object) -> str:
    """``" (CAVEAT)"`` for a dataset whose results need one beside a band, else ``""``."""
    from dpvision.data.datasets import dataset_info

    info = dataset_info(dataset) if isinstance(dataset, str) else None
    return f" ({info.caveat})" if info is not None and info.caveat else ""


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
