"""``dpvision pretrain`` (DP-RandP Phase I) and ``dpvision synth`` (preview images)."""

# local imports: start-up time (heavy modules are imported in the functions using them)
import argparse
import time
from typing import Any

from dpvision.cli.arguments import add_device_arguments, input_file, output_file, whole_number
from dpvision.data.synthetic import write_preview
from dpvision.errors import DPVisionError


def add_pretrain_parser(commands: Any) -> None:
    pretrain = commands.add_parser(
        "pretrain",
        help="pre-train without privacy: on synthetic images (DP-RandP Phase I) or a public "
        "dataset",
        description="--objective contrastive (the default): DP-RandP's Phase I, alignment + "
        "uniformity (Wang & Isola) on images from a random process; writes an encoder for "
        "`dpvision train --method dp-randp --set learner.encoder=FILE`. --objective "
        "supervised: cross-entropy on the training images of a public --dataset (or its "
        "public slice, --public-fraction); writes a file for `--set learner.init=FILE`. Both "
        "also serve `--features encoder:path=FILE`. Neither may read private data: they "
        "record no privacy cost.",
    )
    pretrain.add_argument(
        "--objective",
        choices=("contrastive", "supervised"),
        default="contrastive",
        help="contrastive (synthetic images, DP-RandP) or supervised (a public dataset)",
    )
    pretrain.add_argument("--dataset", help="supervised: the public dataset")
    pretrain.add_argument("--data-dir", metavar="DIR", help="supervised: where its files are")
    pretrain.add_argument(
        "--public-fraction",
        type=float,
        metavar="F",
        help="supervised: train on the public slice, about this share of the training set "
        "(each example's side is its own published hash; a private run with public_fraction "
        ">= F leaves these rows out, whatever rows are added to the dataset)",
    )
    pretrain.add_argument("--epochs", type=float, help="supervised: epochs (or --steps)")
    pretrain.add_argument("--learning-rate", type=float, help="SGD learning rate")
    pretrain.add_argument(
        "--label-smoothing", type=float, help="supervised: of the cross-entropy (default 0)"
    )
    pretrain.add_argument(
        "--out", type=output_file, required=True, metavar="FILE", help="the encoder file"
    )
    pretrain.add_argument(
        "--config", type=input_file, metavar="FILE.toml", help="a TOML file of options"
    )
    pretrain.add_argument("--model", help="tanh-cnn, wrn-DEPTH-WIDTH, … (default tanh-cnn)")
    pretrain.add_argument(
        "--synthetic", metavar="KIND", help="the generator (see `dpvision synth --help`)"
    )
    pretrain.add_argument("--size", type=whole_number, help="image side (default 28)")
    pretrain.add_argument("--channels", type=whole_number, help="1 or 3 (default 1)")
    pretrain.add_argument("--steps", type=whole_number, help="optimisation steps")
    pretrain.add_argument("--batch-size", type=whole_number, help="images per step")
    pretrain.add_argument(
        "--num-images", type=whole_number, help="images generated once (0: fresh each step)"
    )
    pretrain.add_argument("--seed", type=whole_number, help="random seed")
    add_device_arguments(pretrain, precision=False)
    pretrain.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other option, e.g. --set learning_rate=0.06",
    )
    pretrain.add_argument(
        "--checkpoint",
        type=output_file,
        metavar="FILE",
        help="resume from FILE if it exists; write it as it runs",
    )
    pretrain.add_argument(
        "--json", type=output_file, metavar="FILE", help="write a summary JSON here"
    )


def run_pretrain(args: argparse.Namespace) -> None:
    from dpvision.devices import resolve_device
    from dpvision.fileio import write_json_atomic
    from dpvision.training.pretrain import pretrain
    from dpvision.training.pretrain_options import PretrainOptions

    objective, raw = _raw_options(args)
    if objective == "supervised":
        run_supervised(raw, args)
        return
    options = PretrainOptions.from_dict(raw)
    device = resolve_device(args.device)
    result = pretrain(
        options, args.out, checkpoint=args.checkpoint, quiet=args.quiet, device=device
    )
    if args.json:
        write_json_atomic(args.json, result)
    print(
        f"encoder {options.model} pre-trained on {options.synthetic} "
        f"({options.channels}×{options.size}×{options.size}) for {options.steps} steps: final "
        f"loss {result['final_loss']:.4f}, wall time {result['wall_seconds']:.1f} s\n"
        f"written to {args.out} (no private data used: ε = 0)"
    )


def _raw_options(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(the objective, its options as given): the config's ``[pretrain]`` table, then the
    flags of that objective (a flag of the other objective refused), then ``--set``."""
    from dpvision.config import load_toml, parse_override

    raw: dict[str, Any] = {}
    objective = args.objective
    if args.config:
        table = load_toml(args.config)
        raw.update(table.get("pretrain", table))
        objective = str(raw.pop("objective", objective))
    common = {
        "model": args.model,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
    }
    only = {
        "contrastive": {
            "synthetic": args.synthetic,
            "size": args.size,
            "channels": args.channels,
            "num_images": args.num_images,
        },
        "supervised": {
            "dataset": args.dataset,
            "data_dir": args.data_dir,
            "public_fraction": args.public_fraction,
            "epochs": args.epochs,
            "label_smoothing": args.label_smoothing,
        },
    }
    if objective not in only:
        raise DPVisionError(f"unknown objective {objective!r}; choose contrastive or supervised")
    for other, flags in only.items():
        given = [k for k, v in flags.items() if v is not None]
        if other != objective and given:
            raise DPVisionError(
                f"--{given[0].replace('_', '-')} is for --objective {other}, not {objective}"
            )
    raw.update({k: v for k, v in {**common, **only[objective]}.items() if v is not None})
    for item in args.set:
        path, value = parse_override(item)
        raw[".".join(path)] = value
    return objective, raw


def run_supervised(raw: dict[str, Any], args: argparse.Namespace) -> None:
    """``dpvision pretrain --objective supervised``: validate, train, write, summarise."""
    from dpvision.devices import resolve_device
    from dpvision.fileio import write_json_atomic
    from dpvision.training.pretrain_options import SupervisedOptions
    from dpvision.training.supervised import pretrain_supervised

    options = SupervisedOptions.from_dict(raw)
    device = resolve_device(args.device)
    result = pretrain_supervised(
        options, args.out, checkpoint=args.checkpoint, quiet=args.quiet, device=device
    )
    if args.json:
        write_json_atomic(args.json, result)
    print(
        f"{options.model} pre-trained on {result['trained_on']} for {result['steps']} steps: "
        f"final loss {result['final_loss']:.4f}, "
        f"test accuracy {100 * result['test_accuracy']:.2f} %, "
        f"wall time {result['wall_seconds']:.1f} s\nwritten to {args.out} (public data only: no "
        "privacy cost recorded; use it with --set learner.init=FILE)"
    )


# The generators of dpvision.data.synthetic (kept here so `dpvision --help` needs no torch).
SYNTHETIC_KINDS = (
    "dead-leaves-squares",
    "dead-leaves-oriented",
    "dead-leaves-mixed",
    "oriented-filters",
    "spectral",
)


def add_synth_parser(commands: Any) -> None:
    synth = commands.add_parser(
        "synth",
        help="images from random processes: write a preview grid PNG",
        description="Generates images from one of the random processes of DP-RandP's Phase I "
        f"({', '.join(SYNTHETIC_KINDS)}) and writes them as one grid PNG to look at.",
    )
    synth.add_argument("--kind", required=True, help=", ".join(SYNTHETIC_KINDS))
    synth.add_argument("--n", type=whole_number, default=64, help="images (default 64)")
    synth.add_argument(
        "--out", type=output_file, required=True, metavar="FILE.png", help="the PNG to write"
    )
    synth.add_argument("--size", type=whole_number, default=32, help="image side (default 32)")
    synth.add_argument("--channels", type=whole_number, default=3, help="1 or 3 (default 3)")
    synth.add_argument("--seed", type=whole_number, default=0, help="random seed")
    synth.add_argument("--columns", type=whole_number, default=8, help="grid columns")


def run_synth(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    path = write_preview(
        args.kind,
        args.out,
        n=args.n,
        size=args.size,
        channels=args.channels,
        seed=args.seed,
        columns=args.columns,
    )
    seconds = time.perf_counter() - start
    print(
        f"{args.n} {args.kind} images ({args.channels}×{args.size}×{args.size}) in "
        f"{seconds:.2f} s: {path}"
    )
