"""``dpvision train``."""

# local imports: start-up time (heavy modules are imported in the functions using them)
import argparse
from typing import Any

from dpvision.cli.arguments import add_run_arguments, output_file, run_flags
from dpvision.errors import DPVisionError, Interrupted


def _what_was_saved(checkpoint: str | None) -> str:
    """What an interrupted run leaves to resume from, in words (the step count is public:
    the schedule's)."""
    from dpvision.training.checkpoint import last_saved

    saved = last_saved()
    if saved is not None:
        path, step = saved
        return f"the last checkpoint, step {step}, is {path}: the same command resumes from it"
    if checkpoint is None:
        return (
            "nothing was saved (--checkpoint PATH saves the run every "
            "learner.checkpoint_every steps, and the same command resumes from it)"
        )
    return f"no checkpoint was written to {checkpoint} yet (learner.checkpoint_every: how often)"


def run(args: argparse.Namespace) -> None:
    from dpvision.config import resolve
    from dpvision.fileio import write_json_atomic
    from dpvision.runs.train import run_training, summary
    from dpvision.training.checkpoint import forget_saved

    flags = run_flags(args)
    sets = list(args.set)
    if args.phase2_fraction is not None:
        sets.append(f"learner.phase2_fraction={args.phase2_fraction!r}")
    config = resolve(args.config, flags, sets)
    workers = _join_torchrun()
    forget_saved()
    try:
        result = run_training(config, quiet=args.quiet, checkpoint=args.checkpoint, save=args.save)
    except KeyboardInterrupt:
        raise Interrupted(_what_was_saved(args.checkpoint)) from None
    except DPVisionError as error:
        needs = config.reference.get("needs")
        if needs and args.config:
            raise DPVisionError(
                f"{error} — this config needs {needs}; where it is, run: dpvision train "
                f"--config {args.config}"
            ) from None
        raise
    finally:
        if workers is not None:
            from dpvision.distributed import shutdown

            shutdown()
    if workers is not None and not workers.is_main:
        return  # rank 0 reports; every rank holds the same result
    if args.json:
        write_json_atomic(args.json, result)
    print(summary(result))
    if args.json:
        print(f"result written to {args.json}")
    if args.save:
        print(f"model written to {args.save} (dpvision predict {args.save} IMAGES)")


def _join_torchrun() -> Any:
    """Joins the process group when launched by torchrun with several processes."""
    from dpvision.distributed import init_from_env, launched_by_torchrun

    return init_from_env() if launched_by_torchrun() else None


def add_parser(commands: Any) -> None:
    """``dpvision train``."""
    train = commands.add_parser(
        "train",
        help="train a private classifier and evaluate it (no arguments: a small default run)",
        description="Train on a dataset's features, evaluate on its test split, print a "
        "summary and (with --json) write the result JSON. With no arguments it runs the "
        "default recipe at ε = 3 on scikit-learn's digits, which needs no download: "
        "dp-sgd-linear on ScatterNet features (docs/guide/recipes.md).",
    )
    add_run_arguments(train)
    train.add_argument(
        "--json", type=output_file, metavar="FILE", help="write the result JSON here"
    )
    train.add_argument(
        "--save",
        type=output_file,
        metavar="MODEL",
        help="write the trained model (weights, feature and preprocessing spec, ledger) "
        "here; use it with dpvision predict / evaluate or dpvision.load_model",
    )
    train.add_argument(
        "--checkpoint",
        type=output_file,
        metavar="FILE",
        help="dp-sgd, dp-randp: resume from FILE if it exists; write it every "
        "learner.checkpoint_every "
        "steps and at the end",
    )
    train.add_argument(
        "--phase2-fraction",
        type=float,
        metavar="F",
        help="dp-randp: the share ε₁/ε of the budget for Phase II (the head); N₁ is the most "
        "steps within it (same as --set learner.phase2_fraction=F; default: N₁ = 96 steps)",
    )
