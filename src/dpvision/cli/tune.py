"""``dpvision tune``."""

import argparse
from typing import Any

from dpvision.cli.arguments import add_run_arguments, output_file, positive_float, run_flags


def run(args: argparse.Namespace) -> None:
    # local import: start-up time
    from dpvision.config import resolve

    # local import: start-up time
    from dpvision.fileio import write_json_atomic

    # local import: start-up time
    from dpvision.runs.train import summary

    # local import: start-up time
    from dpvision.runs.tune import TuneSettings, parse_search, run_tune

    search = parse_search(args.search)  # spelling first: one line, before any data is read
    settings = TuneSettings(args.distribution, args.mean_runs, args.score_noise)
    settings.repetitions(len(search.candidates()))
    config = resolve(args.config, run_flags(args), list(args.set))
    result, model = run_tune(config, search, settings, quiet=args.quiet)
    if args.json:
        write_json_atomic(args.json, result)
    tuning = result["tuning"]
    if model is None:
        print(
            f"K = 0 runs were drawn ({tuning['distribution']}): nothing was trained or "
            f"released; ε = {result['epsilon']:.4f} at δ = {result['delta']:g} (rdp)"
        )
    else:
        print(summary(result))
        chosen = ", ".join(f"{k} = {v!r}" for k, v in result["selected"]["setting"].items())
        print(
            f"selected: {chosen} (candidate {result['selected']['candidate']} of "
            f"{len(tuning['candidates'])}), noisy validation accuracy "
            f"{100 * result['validation_score_noisy']:.2f} % after {tuning['runs']} "
            f"run{'s' if tuning['runs'] != 1 else ''} "
            f"({tuning['distribution']}); the ε above covers every run and the selection"
        )
        if args.save:
            model.save(args.save)
            print(f"model written to {args.save} (dpvision predict {args.save} IMAGES)")
    if args.json:
        print(f"result written to {args.json}")


def add_parser(commands: Any) -> None:
    """``dpvision tune``."""
    tune = commands.add_parser(
        "tune",
        help="private hyper-parameter selection, its cost in the ε reported",
        description="Trains randomly drawn candidates a random number of times K and "
        "releases the best by a noisy validation score (Papernot & Steinke 2022). --epsilon "
        "is the budget of the whole search: every run and the selection are in the ledger.",
    )
    add_run_arguments(tune)
    tune.add_argument(
        "--search",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="values to try for a config key, e.g. --search learner.learning_rate=4,8,16 "
        "(repeat for more keys: every combination is a candidate)",
    )
    tune.add_argument(
        "--mean-runs",
        type=positive_float,
        metavar="MU",
        help="the mean number of runs E[K] (default: the number of candidates)",
    )
    tune.add_argument(
        "--distribution",
        default="geometric",
        metavar="NAME",
        help="of the number of runs K: geometric (default), logarithmic, poisson or "
        "tnb:ETA (truncated negative binomial)",
    )
    tune.add_argument(
        "--score-noise",
        type=positive_float,
        metavar="S",
        help="std of the noise on the count of correct validation examples (default: "
        "the σ at which that count alone would cost a tenth of --epsilon)",
    )
    tune.add_argument("--json", type=output_file, metavar="FILE", help="write the result JSON")
    tune.add_argument(
        "--save", type=output_file, metavar="MODEL", help="write the selected model here"
    )
