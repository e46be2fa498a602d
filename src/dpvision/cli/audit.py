"""``dpvision audit``."""

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


def add_parser(commands: Any) -> None:
    audit = commands.add_parser(
        "audit",
        help="empirical ε lower bound of a training configuration by membership inference",
        description="Train many models on a small D and on D' = D ∪ {canary}, and turn how "
        "well the canary's loss tells them apart into a lower bound on ε (Clopper-Pearson, "
        "De et al. 2022 App. A.2). A bound above the claimed ε proves a privacy bug. Phase I "
        "picks the canary and swept settings that separate best; phase II measures with "
        "fresh runs. δ defaults to 1/|D|.",
    )
    add_run_arguments(audit)
    audit.add_argument(
        "--runs",
        type=whole_number,
        default=1000,
        metavar="N",
        help="phase II: models trained on each of D and D' (default 1000)",
    )
    audit.add_argument(
        "--phase1-runs",
        type=whole_number,
        default=100,
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
        help="comma-separated canaries for phase I: blank, noise, mislabeled (default: all)",
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
        default=0.999,
        metavar="P",
        help="confidence of the lower bound (default 0.999)",
    )
    audit.add_argument(
        "--selection-fraction",
        type=positive_float,
        default=0.1,
        metavar="F",
        help="share of phase II runs that choose the threshold (default 0.1)",
    )
    audit.add_argument(
        "--histogram", type=output_file, metavar="FILE.png", help="write the loss histogram here"
    )
    audit.add_argument(
        "--json",
        nargs="?",
        const="-",
        type=output_file,
        metavar="FILE",
        help="print the report as JSON (or write it to FILE)",
    )


def run(args: argparse.Namespace) -> None:
    # local import: start-up time (dpvision.audit imports torch)
    from dpvision.audit import AuditSettings, audit_config, parse_sweep, run_audit, summary
    from dpvision.audit.canaries import CANARIES
    from dpvision.fileio import write_json_atomic

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
        phase1_runs=args.phase1_runs,
        runs=args.runs,
        confidence=args.confidence,
        selection_fraction=args.selection_fraction,
        delta=args.delta,
        seed=args.seed if args.seed is not None else 0,
    )
    report = run_audit(config, settings, progress=not args.quiet, histogram=args.histogram)
    if args.json == "-":
        print(json.dumps(report, default=float))
        return
    if args.json:
        write_json_atomic(args.json, report)
    print(summary(report))
    if args.json:
        print(f"report written to {args.json}")
    if args.histogram:
        print(f"histogram written to {args.histogram}")
