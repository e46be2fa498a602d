"""Every ``auto`` left in a config, resolved when the run starts (the default recipe):
``method = "auto"`` and ``dp-sgd``'s ``learner.model = "auto"`` filled in from the public
facts of the data (the number of training examples N and the image shape), with what was
chosen and why for the result.

The rules are :mod:`dpvision.recipes`; this module only reads the facts and fills them in.
"""

import dataclasses
from typing import Any

from dpvision.config import TrainConfig, validate
from dpvision.data.splits import training_rows
from dpvision.features import parse_feature_spec
from dpvision.features.precomputed import load_feature_files
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.recipes import (
    AUTO,
    RECIPE_METHOD,
    deep_schedule,
    default_features,
    default_model,
    default_preprocessing,
    describe,
    is_colour,
    linear_schedule,
    schedule_for,
)
from dpvision.runs.weight_rows import run_weight_rows

__all__ = ["DataFacts", "apply_recipe", "data_facts"]


def apply_recipe(
    config: TrainConfig, secret: SecretRandomness | None = None, private_statistics: bool = True
) -> tuple[TrainConfig, dict[str, Any]]:
    """The config with every ``auto`` left resolved, and the result's ``recipe`` entry:
    ``default`` (whether the method came from the recipe), ``set`` (the options the recipe
    filled in, dotted), ``why`` and ``summary`` (one line, printed after the run).

    Privacy: reads N (public, as in every sample rate B/N) and the image shape, never the
    labels or the pixels' values; the options the user set are kept. ``secret``: the
    run's secret randomness (its validation split decides N). ``private_statistics``:
    whether the recipe may choose preprocessing that makes releases of its own (the colour
    images' PrivDataNorm); ``tune`` calibrates only its candidates' steps, so it passes
    False and gets group-norm.
    """
    chosen: dict[str, Any] = {}
    why = "as configured"
    model = config.learner.get("model", AUTO)
    needs_model = config.method in ("dp-sgd", "dp-randp") and model == AUTO
    pending = config.features == AUTO or config.preprocessing.kind == AUTO
    needs_schedule = config.method == "dp-sgd" and bool(_deep_unset(config.learner))
    if config.method == AUTO or pending or needs_model or needs_schedule:
        facts = data_facts(config, secret)
        num_train, image_shape = facts.num_train, facts.image_shape
        if pending:
            assert image_shape is not None  # precomputed features are never auto
            features = config.features
            if features == AUTO:
                features = chosen["features"] = default_features(config.method, image_shape)
            pre = config.preprocessing
            if pre.kind == AUTO:
                colour = private_statistics and is_colour(image_shape[0], num_train, config.epsilon)
                recipe = default_preprocessing(config.method, features, image_shape[0], colour)
                pre = pre.filled(recipe)
                chosen["preprocessing"] = {key: getattr(pre, key) for key in recipe}
            config = dataclasses.replace(config, features=features, preprocessing=pre)
        if config.method == AUTO:
            # the colour schedules were tuned after PrivDataNorm on ScatterNet features
            colour = (
                image_shape is not None
                and is_colour(image_shape[0], num_train, config.epsilon)
                and config.preprocessing.kind == "private-norm"
                and parse_feature_spec(config.features).name == "scatternet"
            )
            schedule = {
                key: value
                for key, value in linear_schedule(
                    num_train, config.epsilon, config.learner.get("batch_size"), colour=colour
                ).items()
                if key not in config.learner
                and not (key == "epochs" and "steps" in config.learner)  # steps override it
            }
            chosen["method"] = RECIPE_METHOD
            chosen.update({f"learner.{key}": value for key, value in schedule.items()})
            tuned = schedule_for(config.epsilon, colour).epsilon
            target = "a fixed σ" if config.epsilon is None else f"ε = {config.epsilon:g}"
            where = "on CIFAR-10's training set, colour images" if colour else ""
            why = (
                f"the default recipe for N = {num_train} at {target} (schedule tuned at "
                f"ε = {tuned:g}{' ' + where if where else ''}; docs/guide/recipes.md)"
            )
            config = dataclasses.replace(
                config, method=RECIPE_METHOD, learner={**config.learner, **schedule}
            )
        if needs_model and image_shape is not None:
            chosen["learner.model"] = default_model(image_shape, config.features)
            why += (
                f"; model {chosen['learner.model']} fits "
                f"{'×'.join(str(v) for v in image_shape)} images"
            )
            config = dataclasses.replace(
                config, learner={**config.learner, "model": chosen["learner.model"]}
            )
        if needs_schedule:
            options = deep_schedule(
                num_train,
                config.epsilon,
                config.learner.get("optimizer"),
                config.learner.get("finetune"),
                config.learner.get("batch_size"),
            )
            schedule = {key: options[key] for key in _deep_unset(config.learner) if key in options}
            chosen.update({f"learner.{key}": value for key, value in schedule.items()})
            target = "a fixed σ" if config.epsilon is None else f"ε = {config.epsilon:g}"
            why = (
                f"the dp-sgd recipe for N = {num_train} at {target} "
                "(Tramèr & Boneh's CNN schedule; docs/guide/recipes.md)"
            ) + why.removeprefix("as configured")
            config = dataclasses.replace(config, learner={**config.learner, **schedule})
        config = validate(config)
    recipe = {"default": "method" in chosen, "set": chosen, "why": why}
    if "features" in chosen and "method" not in chosen:
        recipe["why"] += f"; features {chosen['features']} are the default of {config.method}"
    recipe["summary"] = _summary(config, recipe)
    return config, recipe


_LENGTH = ("steps", "epochs")


def _deep_unset(learner: dict[str, Any]) -> list[str]:
    """The schedule options of ``dp-sgd`` the user left to the recipe: the batch, the
    length (unless ``steps`` or ``epochs`` is set), the learning rate, the clip norm and
    the optimizer with its momentum (momentum only for SGD)."""
    unset = [key for key in ("batch_size", "learning_rate", "max_grad_norm") if key not in learner]
    if not any(key in learner for key in _LENGTH):
        unset.append("epochs")
    if "optimizer" not in learner:
        unset.append("optimizer")
    if learner.get("optimizer", "sgd") == "sgd" and "momentum" not in learner:
        unset.append("momentum")
    return unset


def _summary(config: TrainConfig, recipe: dict[str, Any]) -> str:
    """:func:`~dpvision.recipes.describe`'s line; for ``dp-sgd`` and ``dp-randp`` with the
    batch size, schedule, learning rate, momentum (or Adam) and clip norm the run uses, the
    learner's defaults included, named as such (public: the config)."""
    if config.method not in ("dp-sgd", "dp-randp"):
        return describe(config.to_dict(), recipe)
    options = config.dpsgd
    length = {"steps": options.steps} if options.steps is not None else {"epochs": options.epochs}
    used = {
        "batch_size": options.batch_size,
        **length,
        "learning_rate": options.learning_rate,
        "max_grad_norm": options.max_grad_norm,
    }
    line = describe({**config.to_dict(), "learner": {**config.learner, **used}}, recipe)
    head, _, why = line.partition(" — ")
    optimizer = "adam" if options.optimizer == "adam" else f"momentum {options.momentum:g}"
    keys = [*used, "momentum" if options.optimizer == "sgd" else "optimizer"]
    defaults = [key for key in keys if key not in config.learner]
    note = f" (learner defaults: {', '.join(defaults)})" if defaults else ""
    return f"{head}, {optimizer} — {why}{note}"


@dataclasses.dataclass(frozen=True)
class DataFacts:
    """The public facts of a run's data the recipe reads.

    Attributes:
      num_train: N, the rows trained on (after the public and validation splits).
      num_validation: the rows held out for validation.
      image_shape: (C, H, W), or ``None`` for precomputed feature vectors.
    """

    num_train: int
    num_validation: int
    image_shape: tuple[int, int, int] | None


def data_facts(config: TrainConfig, secret: SecretRandomness | None = None) -> DataFacts:
    """N, the validation rows and the image shape of ``config``'s data: sizes and shapes,
    never a pixel or a label (the splits hash each example to decide its side; only the
    sizes leave this function). ``secret``: the run's, whose key the validation split uses
    (None: the config's ``secret_seed``, else fresh)."""
    spec = parse_feature_spec("pixels" if config.features == AUTO else config.features)
    shape: tuple[int, int, int] | None = None
    also_public = None
    if spec.name == "precomputed":
        assert spec.path is not None  # checked by FeatureSpec
        files = load_feature_files(spec.path, config.dataset, config.num_classes)
        rows, labels = files.train, files.train_labels
    else:
        dataset = config.load_dataset()
        height, width, channels = dataset.image_shape
        rows, labels, shape = dataset.row_images, dataset.train_labels, (channels, height, width)
        # the rows the run's weight files were trained on are left out as the run does
        also_public = run_weight_rows(config, dataset)
    secret = secret or config.secret_randomness()
    # A replayable run on other rows draws other noise (tune's K and draws included).
    secret.bind_rows(lambda: (rows, labels))
    split = training_rows(
        rows,
        labels,
        public_fraction=config.public_fraction,
        validation_fraction=config.validation_fraction,
        key=secret.split_key(),
        also_public=also_public,
    )
    return DataFacts(len(split.train), len(split.validation), shape)
