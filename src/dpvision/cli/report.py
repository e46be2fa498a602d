"""``dpvision sweep`` and ``dpvision report``."""

import argparse
from typing import Any

from dpvision.cli.arguments import input_file, number_list, output_file, output_folder, whole_list
from dpvision.report import report, sweep


def add_parsers(commands: Any) -> None:
    sweep = commands.add_parser(
        "sweep",
        help="run configs over a grid of target ε and seeds; one result JSON per run",
        description="Runs each --config at every target ε of --epsilons and every seed of "
        "--seeds, writing one result JSON per run into --out. A run already there is kept "
        "when the same resolved config made it (an interrupted sweep resumes) and rerun "
        "otherwise. Then: dpvision report OUT.",
    )
    sweep.add_argument(
        "--config",
        action="append",
        type=input_file,
        required=True,
        metavar="FILE.toml",
        help="repeatable",
    )
    sweep.add_argument(
        "--epsilons", type=number_list, required=True, metavar="E1,E2,...", help="target ε"
    )
    sweep.add_argument("--seeds", type=whole_list, default=[0], metavar="S1,S2,...")
    sweep.add_argument(
        "--out", type=output_folder, required=True, metavar="DIR", help="folder for the JSONs"
    )
    sweep.add_argument("--data-dir", metavar="DIR", help="folder with the dataset's files")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    report = commands.add_parser(
        "report",
        help="markdown report and privacy-utility plots from a folder of result JSONs",
        description="Reads every result JSON under RESULTS_DIR and writes a markdown report "
        "(median and spread over seeds, the published number and the difference, flags for "
        "ε above target or accuracy outside the published band, each run's ledger) and one "
        "PNG per dataset: accuracy against ε with the published points.",
    )
    report.add_argument("results", nargs="+", metavar="RESULTS_DIR")
    report.add_argument(
        "--out",
        type=output_file,
        metavar="FILE.md",
        help="default: report.md in the first RESULTS_DIR",
    )
    report.add_argument(
        "--references",
        nargs="+",
        default=[],
        type=input_file,
        metavar="CONFIG.toml",
        help="configs whose [reference] published points are plotted as well",
    )


def run_sweep(args: argparse.Namespace) -> None:
    files = sweep(
        args.config,
        epsilons=args.epsilons,
        seeds=args.seeds,
        out=args.out,
        sets=args.set,
        data_dir=args.data_dir,
        quiet=args.quiet,
    )
    print(f"{len(files)} result files in {args.out}; next: dpvision report {args.out}")


def run_report(args: argparse.Namespace) -> None:
    summary = report(args.results, args.out, references=args.references)
    print(f"report written to {summary['report']}")
    for png in summary["plots"]:
        print(f"plot written to {png}")
    if summary["flagged"]:
        print(f"{len(summary['flagged'])} flagged runs (see the report's Flags section)")
