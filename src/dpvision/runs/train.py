"""``dpvision train``: one configuration, trained and evaluated, as the result of DESIGN.md.

The whole path is one function, :func:`run_training`, so the command line, the benchmarks
and the tests run exactly the same code: :func:`dpvision.runs.features.run_features` for
the feature learners, :func:`dpvision.runs.dpsgd.run_dpsgd` for deep models.
"""

import dataclasses
import math
from pathlib import Path
from typing import Any

from dpvision.config import TrainConfig, resolve
from dpvision.data.imagefolder import single_tree
from dpvision.distributed import current
from dpvision.errors import DPVisionError
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.runs.auto import apply_recipe
from dpvision.runs.dpsgd import run_dpsgd
from dpvision.runs.features import run_features
from dpvision.runs.saved import TrainedModel
from dpvision.runs.validation import ValidationRelease
from dpvision.training.checkpoint import checkpoint_secret


def run_training(
    config: TrainConfig,
    *,
    quiet: bool = False,
    checkpoint: str | Path | None = None,
    save: str | Path | None = None,
) -> dict[str, Any]:
    """Trains and evaluates one configuration; returns the result dict (DESIGN.md contract).

    ``checkpoint`` (``dp-sgd``, ``dp-randp``): a file to resume from when it exists and to
    write to. ``save``: write the trained model there (:mod:`dpvision.runs.saved`).
    """
    result, model = fit(config, quiet=quiet, checkpoint=checkpoint)
    if save is not None and current().is_main:  # every rank holds the same model
        model.save(save)
    return result


def fit(
    config: TrainConfig,
    *,
    quiet: bool = False,
    checkpoint: str | Path | None = None,
    secret: SecretRandomness | None = None,
    validation: ValidationRelease | None = None,
) -> tuple[dict[str, Any], TrainedModel]:
    """:func:`run_training`'s work: the result dict and the trained model, after checking
    that the run kept within its target ε.

    ``secret``: the run's secret randomness (None: from ``config.secret_seed``, else 256
    fresh bits from the OS; :mod:`dpvision.mechanisms.secret`); ``validation``: tune's
    selection mode (:class:`~dpvision.runs.validation.ValidationRelease`).
    """
    if secret is None:
        secret = config.secret_randomness()
    if checkpoint is not None and config.method in ("dp-sgd", "dp-randp"):
        # A resumed run keeps its secret: the same split (and recipe), noise and batches.
        secret = checkpoint_secret(Path(checkpoint), current()) or secret
    # Under torchrun every rank draws the same noise, batches and split: rank 0's secret.
    secret = SecretRandomness.from_state(current().from_main(secret.state))
    config, recipe = apply_recipe(config, secret)
    run = run_dpsgd if config.method in ("dp-sgd", "dp-randp") else run_features
    result, model = run(
        config, quiet=quiet, checkpoint=checkpoint, secret=secret, validation=validation
    )
    result["recipe"] = recipe
    if single_tree(config.dataset):  # its test side is public evaluation data
        result["test_split"] = {
            "split_seed": config.split_seed,
            "test_fraction": config.test_fraction,
            "released": "exactly (n_test, test accuracy)",
        }
    return _within_target(config, result), model


@dataclasses.dataclass(frozen=True)
class TrainingRun:
    """What :func:`train` returns: the result JSON of DESIGN.md and the trained model."""

    result: dict[str, Any]
    model: TrainedModel

    @property
    def test_accuracy(self) -> float:
        return float(self.result["test_accuracy"])

    @property
    def epsilon(self) -> float:
        return float(self.result["epsilon"])

    def __str__(self) -> str:
        return summary(self.result)


def train(
    config: str | Path | None = None,
    *,
    save: str | Path | None = None,
    checkpoint: str | Path | None = None,
    quiet: bool = True,
    **fields: Any,
) -> TrainingRun:
    """``dpvision train`` from Python: trains one configuration and returns its result and
    model.

    ``config`` is a TOML file (or None: the defaults); ``fields`` set any config field as
    ``--set`` would, a table as a dict::

        run = dpvision.train(dataset="digits", method="dp-fc", epsilon=1.0,
                             learner={"epochs": 5})
        run.test_accuracy, run.epsilon, run.result["privacy_ledger"]
        run.model.predict(images)

    Bad values raise :class:`~dpvision.errors.DPVisionError` before any work. ``save``
    writes the model file (:func:`dpvision.load_model` reads it back).

    Privacy: as ``dpvision train``: the result's ε (at its δ) covers everything the run
    released, and never exceeds a target ε.
    """
    resolved = resolve(config, fields)
    result, model = fit(resolved, quiet=quiet, checkpoint=checkpoint)
    if save is not None:
        model.save(save)
    return TrainingRun(result, model)


def _within_target(config: TrainConfig, result: dict[str, Any]) -> dict[str, Any]:
    """The result, after checking that its ledger's ε does not exceed the run's target.

    Calibration guarantees this; the check makes sure no later change can report a run
    as meeting a target it missed.
    """
    target = config.epsilon
    if target is not None and math.isfinite(target) and not result["epsilon"] <= target:
        raise DPVisionError(
            f"the run spent ε = {result['epsilon']:.6g}, more than its target {target:g}: "
            "this is a bug in dpvision, please report it; no result was written"
        )
    return result


def _ema_note(result: dict[str, Any]) -> str:
    if result.get("test_accuracy_ema") is None:
        return ""
    return (
        f" (EMA of the parameters; the last parameters: {100 * result['test_accuracy_last']:.2f} %)"
    )


def _inputs(result: dict[str, Any]) -> str:
    """What the learner was given: a deep model's images (H×W×C, as the dataset's images are
    read) or feature maps, or a feature learner's feature vectors."""
    shape = result.get("input_shape")
    if "model" not in result or not shape:
        return f"features {result['features']} ({result['num_features']} dims)"
    if result["features"] == "pixels" and len(shape) == 3:
        channels, height, width = shape
        return f"model {result['model']} on {height}×{width}×{channels} images"
    maps = "×".join(str(v) for v in shape)
    return f"model {result['model']} on {result['features']} features ({maps})"


def _validation_note(result: dict[str, Any]) -> str:
    if result.get("validation_accuracy") is None:
        return ""
    held = result["n_validation"]
    noise = result.get("validation_noise")
    how = ""
    if result.get("validation") == "private" and noise:
        # σ_v and n are public: the count's noise in accuracy points, and the clamp.
        how = (
            f"; a noisy count, ± {100 * noise / held:.2f} points (one std), clamped to "
            "0–100 %: not the exact accuracy"
        )
    return (
        f"validation accuracy {100 * result['validation_accuracy']:.2f} % "
        f"({held} training examples held out{how})\n"
    )


def _test_split_note(result: dict[str, Any]) -> str:
    split = result.get("test_split")
    if split is None:
        return ""
    return (
        f"test split: {100 * split['test_fraction']:g} % of the folder's images by split_seed "
        f"{split['split_seed']}, released exactly (not covered by ε)\n"
    )


def _phases_note(result: dict[str, Any]) -> str:
    if "phase2_steps" not in result:
        return ""
    share = result.get("phase2_epsilon_fraction")
    budget = (
        f" (ε₁ = {result['phase2_epsilon']:.4g}, ε₁/ε = {share:.3f})" if share is not None else ""
    )
    return (
        f"phases: encoder {result['encoder']}; Phase II (head) {result['phase2_steps']} steps"
        f"{budget}, Phase III (all) {result['phase3_steps']} steps\n"
    )


def summary(result: dict[str, Any]) -> str:
    """A few readable lines about a result."""
    sigma = result["noise_multiplier"]
    privacy = (
        "no noise (ε = ∞): non-private baseline"
        if sigma is None
        else f"ε = {result['epsilon']:.4f} at δ = {result['delta']:g} ({result['accountant']}), "
        f"σ = {sigma:.4g}, {result['steps']} noisy releases at sample rate "
        f"{result['sample_rate']:.4g}"
        + (
            f"\n  (for comparison only: the papers' looser zCDP bound would state ε = "
            f"{result['epsilon_zcdp']:.4f} for this same noise; the guarantee is the ε above)"
            if result.get("epsilon_zcdp") is not None
            else ""
        )
    )
    return (
        f"{result['method']} on {result['dataset']} ({result['n_train']} train / "
        f"{result['n_test']} test), {_inputs(result)}\n"
        f"{_validation_note(result)}"
        f"test accuracy {100 * result['test_accuracy']:.2f} %{_ema_note(result)}\n"
        f"{_test_split_note(result)}"
        f"privacy: {privacy}\n"
        f"{_phases_note(result)}"
        + (f"recipe: {result['recipe']['summary']}\n" if "recipe" in result else "")
        + f"wall time {result['wall_seconds']:.1f} s"
        + (f" on {result['device']}" if result.get("device") else "")
        + (f", {result['precision']}" if result.get("precision", "fp32") != "fp32" else "")
    )
