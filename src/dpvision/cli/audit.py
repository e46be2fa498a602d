"""``dpvision audit``."""

# local imports: start-up time (heavy modules are imported in the functions using them)
import argparse
import json
from typing import Any

from dpvision.cli.arguments import (
    add_run_arguments,
    output_file,
    positive_float,
    run_flags,
    whole_number,
)
from dpvision.errors import DPVisionError


def add_parser(commands: Any) -> None:
    audit = commands.add_parser(
        "audit",
        help="empirical ε lower bound of a training configuration by membership inference",
        description="Train many models on a small D and on D' = D ∪ {canary}, and turn how "
        "well the canary's loss tells them apart into a lower bound on ε (Clopper-Pearson, "
        "De et al. 2022 App. A.2). A bound above the claimed ε proves a privacy bug. Phase I "
        "picks the canary and swept settings that separate best; phase II measures with "
        "fresh runs. δ defaults to 1/|D|. With --one-run: one training with m canaries, "
        "each in with probability 1/2 (Steinke, Nasr & Jagielski 2023); δ is the config's.",
    )
    add_run_arguments(audit)
    audit.add_argument(
        "--one-run",
        action="store_true",
        help="audit with one training run and --canaries canaries instead of two phases",
    )
    audit.add_argument(
        "--runs",
        type=whole_number,
        default=None,
        metavar="N",
        help="phase II: models trained on each of D and D' (default 1000)",
    )
    audit.add_argument(
        "--phase1-runs",
        type=whole_number,
        default=None,
        metavar="N",
        help="phase I: models per side for each candidate (default 100)",
    )
    audit.add_argument(
        "--dataset-size",
        type=whole_number,
        default=100,
        metavar="N",
        help="|D|: the first N training examples (default 100)",
    )
    audit.add_argument(
        "--canary",
        default=None,
        metavar="KINDS",
        help="comma-separated canaries for phase I: blank, noise, mislabeled (default: all); "
        "with --one-run one of dirac (white-box, the default) or mislabeled (black-box)",
    )
    audit.add_argument(
        "--canaries",
        type=whole_number,
        default=None,
        metavar="M",
        help="--one-run: canaries, each in the training set with probability 1/2 (default 1000)",
    )
    audit.add_argument(
        "--guesses",
        type=whole_number,
        default=None,
        metavar="K",
        help="--one-run: the K highest scores guess in, the K lowest out (default 100)",
    )
    audit.add_argument(
        "--canary-label",
        type=whole_number,
        default=0,
        metavar="K",
        help="label of the blank and noise canaries (default 0)",
    )
    audit.add_argument(
        "--sweep",
        action="append",
        default=None,
        metavar="KEY=V1,V2",
        help="phase I tries each value of KEY (repeatable; default: a per-method grid; "
        "--sweep none for no sweep)",
    )
    audit.add_argument(
        "--confidence",
        type=positive_float,
        default=None,
        metavar="P",
        help="confidence of the lower bound (default 0.999; 0.95 with --one-run)",
    )
    audit.add_argument(
        "--selection-fraction",
        type=positive_float,
        default=None,
        metavar="F",
        help="share of phase II runs that choose the threshold (default 0.1)",
    )
    audit.add_argument(
        "--histogram",
        type=output_file,
        metavar="FILE.png",
        help="write the histogram of the canary losses (or one-run scores) here",
    )
    audit.add_argument(
        "--json",
        nargs="?",
        const="-",
        type=output_file,
        metavar="FILE",
        help="print the report as JSON (or write it to FILE)",
    )


TWO_PHASE_ONLY = ("runs", "phase1_runs", "sweep", "selection_fraction")
ONE_RUN_ONLY = ("canaries", "guesses")


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def run(args: argparse.Namespace) -> None:
    only = TWO_PHASE_ONLY if args.one_run else ONE_RUN_ONLY
    wrong = [name for name in only if getattr(args, name) is not None]
    if wrong:
        where = "the two-phase audit" if args.one_run else "--one-run"
        raise DPVisionError(f"{_flag(wrong[0])} applies to {where} only")
    report, text = _one_run(args) if args.one_run else _two_phase(args)
    if args.json == "-":
        print(json.dumps(report, default=float))
        return
    if args.json:
        from dpvision.fileio import write_json_atomic

        write_json_atomic(args.json, report)
    print(text)
    if args.json:
        print(f"report written to {args.json}")
    if args.histogram:
        print(f"histogram written to {args.histogram}")


def _one_run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from dpvision.audit.one_run_harness import (
        OneRunSettings,
        one_run_config,
        one_run_summary,
        run_one_run_audit,
    )

    settings = OneRunSettings(
        dataset_size=args.dataset_size,
        canaries=_given(args.canaries, 1000),
        canary=args.canary,
        guesses=_given(args.guesses, 100),
        confidence=_given(args.confidence, 0.95),
        delta=args.delta,
        seed=args.seed if args.seed is not None else 0,
    )
    config = one_run_config(args.config, run_flags(args), args.set, settings)
    report = run_one_run_audit(config, settings, histogram=args.histogram)
    return report, one_run_summary(report)


def _two_phase(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from dpvision.audit import AuditSettings, audit_config, parse_sweep, run_audit, summary
    from dpvision.audit.canaries import CANARIES

    config, default_sweep = audit_config(args.config, run_flags(args), args.set)
    if args.sweep is None:
        sweep = default_sweep
    elif args.sweep == ["none"]:
        sweep = ()
    else:
        sweep = parse_sweep(args.sweep)
    canaries = tuple(c.strip() for c in args.canary.split(",")) if args.canary else CANARIES
    settings = AuditSettings(
        dataset_size=args.dataset_size,
        canaries=canaries,
        canary_label=args.canary_label,
        sweep=sweep,
        phase1_runs=_given(args.phase1_runs, 100),
        runs=_given(args.runs, 1000),
        confidence=_given(args.confidence, 0.999),
        selection_fraction=_given(args.selection_fraction, 0.1),
        delta=args.delta,
        seed=args.seed if args.seed is not None else 0,
    )
    report = run_audit(config, settings, progress=not args.quiet, histogram=args.histogram)
    return report, summary(report)
