"""``dpvision predict`` and ``dpvision evaluate``: a saved model (``train --save``) applied
to new images or to a dataset's test split."""

# local imports: start-up time (heavy modules are imported in the functions using them)
import argparse
import csv
import io
import sys
from pathlib import Path
from typing import Any

import numpy as np

from dpvision.cli.arguments import add_device_arguments, input_file, output_file
from dpvision.errors import DPVisionError


def add_parsers(commands: Any) -> None:
    predict = commands.add_parser(
        "predict",
        help="classify images with a saved model (dpvision train --save MODEL)",
        description="Prints (or writes to --out) one CSV row per input: input,label[,class] "
        "(with --proba, then one column p_<class> per class: the class probabilities, each row "
        "summing to 1). INPUTS is an image file, a folder of images (.png/.jpg/.jpeg, "
        "recursively), or a .npy array of uint8 images (N, H, W, C); for a model trained on "
        "precomputed features, a .npy of feature vectors (N, d). Images are brought to the "
        "size the model was trained at (its image_size, crop_mode, crop_pct, interpolation). "
        "Predictions use only the released model: no privacy cost.",
    )
    predict.add_argument("model", type=input_file, metavar="MODEL")
    predict.add_argument("inputs", metavar="INPUTS")
    predict.add_argument("--out", type=output_file, metavar="FILE.csv", help="default: stdout")
    predict.add_argument(
        "--proba",
        action="store_true",
        help="add the class probabilities, one column p_<class> (p_0, p_1, … without class "
        "names) per class",
    )
    add_device_arguments(predict, precision=False)
    evaluate = commands.add_parser(
        "evaluate",
        help="accuracy of a saved model on a dataset's test split",
        description="Loads a saved model and reports its accuracy on the test split of its "
        "dataset (or --dataset), with the ε it was trained at. The training split is never "
        "evaluated: its accuracy would be an exact statistic of the private data.",
    )
    evaluate.add_argument("model", type=input_file, metavar="MODEL")
    evaluate.add_argument("--dataset", help="default: the dataset the model was trained on")
    evaluate.add_argument("--data-dir", metavar="DIR", help="folder with the dataset's files")
    evaluate.add_argument("--json", type=output_file, metavar="FILE", help="write a JSON here")
    add_device_arguments(evaluate, precision=False)


def run_predict(args: argparse.Namespace) -> None:
    from dpvision.data.imagefolder import image_files
    from dpvision.data.npzfiles import read_npy
    from dpvision.fileio import atomic_open
    from dpvision.runs.saved import load_model

    model = load_model(args.model).to(args.device)
    source = Path(args.inputs)
    npy = source.suffix == ".npy" and source.is_file()
    if model.image_shape is None:
        if not npy:
            raise DPVisionError(
                f"this model takes feature vectors ({model.features}): give a .npy of shape (N, d)"
            )
        inputs = np.asarray(read_npy(source, mmap=False, fix="save a NumPy array with np.save"))
    else:
        inputs = model.images(source)  # the same path as TrainedModel.predict's
    if npy:
        names = [f"{source.name}[{i}]" for i in range(len(inputs))]
    else:
        names = [str(f) for f in image_files(source)]
    if args.proba:
        probabilities = model.predict_proba(inputs)
        labels = probabilities.argmax(axis=1)
    else:
        labels = model.predict(inputs)
    classes = model.class_names
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    columns = [f"p_{c}" for c in (classes or range(model.num_classes))] if args.proba else []
    writer.writerow(["input", "label", *(["class"] if classes else []), *columns])
    for i, (name, label) in enumerate(zip(names, labels, strict=True)):
        row = [name, int(label), *([classes[label]] if classes else [])]
        writer.writerow(row + ([repr(float(p)) for p in probabilities[i]] if args.proba else []))
    if args.out:
        with atomic_open(args.out) as out:
            out.write(text.getvalue())
        print(f"{len(labels)} predictions written to {args.out}")
    else:
        sys.stdout.write(text.getvalue())


def run_evaluate(args: argparse.Namespace) -> None:
    """``dpvision evaluate``: the model's accuracy on the dataset's test split.

    Privacy: reads the test split only (a single tree's by the model's ``split_seed``, or
    for a model from before it, its ``seed``: the split its run used), evaluation data
    released exactly as the run's ``n_test`` and test accuracy; never the training split.
    """
    from dpvision.data.datasets import load_dataset
    from dpvision.data.resize import ImageGeometry
    from dpvision.data.splits import SPLIT_SEED, TEST_FRACTION
    from dpvision.features.precomputed import load_feature_files
    from dpvision.features.spec import parse_feature_spec
    from dpvision.fileio import write_json_atomic
    from dpvision.runs.saved import load_model

    model = load_model(args.model).to(args.device)
    name = args.dataset or model.dataset
    config = model.config
    if model.image_shape is None:
        path = parse_feature_spec(model.features).path
        assert path is not None
        features = load_feature_files(path, name, config.get("num_classes"))
        inputs, labels = np.asarray(features.test), np.asarray(features.test_labels)
    else:
        tree = name.strip().lower().startswith("imagefolder:")
        geometry = ImageGeometry.from_config(config)
        if geometry is None and tree:  # a model from before image_size was required for
            # image folders: its own input size (public: the model file holds it)
            height, width = model.image_shape[:2]
            geometry = ImageGeometry((int(height), int(width)))
        dataset = load_dataset(
            name,
            args.data_dir if args.data_dir is not None else config.get("data_dir"),
            num_classes=config.get("num_classes"),
            channels=config.get("image_channels"),
            geometry=geometry,
            # A model from before split_seed: its tree was split by its seed.
            split_seed=int(config.get("split_seed", config.get("seed", SPLIT_SEED)))
            if tree
            else SPLIT_SEED,
            test_fraction=float(config.get("test_fraction", TEST_FRACTION))
            if tree
            else TEST_FRACTION,
        )
        inputs, labels = dataset.test_images, dataset.test_labels
    accuracy = model.score(inputs, labels)
    report = {
        "model": str(args.model),
        "dataset": name,
        "split": "test",
        "n": len(labels),
        "accuracy": accuracy,
        "method": model.method,
        "epsilon": model.epsilon,
        "delta": model.delta,
    }
    if args.json:
        write_json_atomic(args.json, report)
    print(
        f"test accuracy {100 * accuracy:.2f} % on {name} ({len(labels)} images); "
        f"{model.method} trained at ε = {model.epsilon:.4g}, δ = {model.delta:g}"
    )
