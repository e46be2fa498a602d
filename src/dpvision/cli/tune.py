"""``dpvision tune``."""

# local imports: start-up time (heavy modules are imported in the functions using them)
import argparse
from typing import Any

from dpvision.cli.arguments import add_run_arguments, output_file, positive_float, run_flags


def run(args: argparse.Namespace) -> None:
    from dpvision.config import resolve
    from dpvision.errors import DPVisionError
    from dpvision.fileio import write_json_atomic
    from dpvision.runs.search import transfer_search
    from dpvision.runs.tune import TuneSettings, parse_search, run_tune

    # spelling first: one line, before any data is read
    search = parse_search(args.search) if args.search or not args.transfer else None
    settings = TuneSettings(args.distribution, args.mean_runs, args.score_noise)
    config = resolve(args.config, run_flags(args), list(args.set))
    if args.transfer:
        if config.method not in ("dp-sgd", "auto") or config.dpsgd.init is None:
            raise DPVisionError(
                "--transfer chooses between scratch and fine-tuning learner.init: give "
                "--method dp-sgd and --set learner.init=FILE"
            )
        rate = config.learner.get("learning_rate")  # None: the dp-sgd recipe's, at run time
        search = transfer_search(config.dpsgd.init, rate, search)
    assert search is not None
    settings.repetitions(len(search.candidates()))
    result, model = run_tune(config, search, settings, quiet=args.quiet)
    if args.json:
        write_json_atomic(args.json, result)
    print(summary(result))
    if model is not None and args.save:
        model.save(args.save)
        print(f"model written to {args.save} (dpvision predict {args.save} IMAGES)")
    if args.json:
        print(f"result written to {args.json}")


def summary(result: dict[str, Any]) -> str:
    """A tune result in a few lines: what was selected and what the search cost. Nothing of
    K, the runs or their timing: the result holds none of them (:mod:`dpvision.runs.tune`)."""
    tuning = result["tuning"]
    privacy = (
        f"ε = {result['epsilon']:.4f} at δ = {result['delta']:g} (rdp) for the whole search: "
        f"every run and the selection (a secret number of runs K: {tuning['distribution']})"
    )
    if result["selected"] is None:
        return f"no run was drawn (K = 0): nothing was trained or released; {privacy}"
    model = f" ({result['model']})" if "model" in result else ""
    chosen = ", ".join(f"{k} = {v!r}" for k, v in result["selected"]["setting"].items())
    return (
        f"{result['method']}{model} on {result['dataset']} ({result['n_train']} train / "
        f"{result['n_test']} test), features {result['features']}\n"
        f"selected: {chosen} (candidate {result['selected']['candidate']} of "
        f"{len(tuning['candidates'])}), σ = {result['noise_multiplier']:.4g}, noisy validation "
        f"accuracy {100 * result['validation_score_noisy']:.2f} %\n"
        f"test accuracy {100 * result['test_accuracy']:.2f} %\n"
        f"privacy: {privacy}"
    )


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
        "--transfer",
        action="store_true",
        help="with --set learner.init=FILE: choose privately between training from scratch, "
        "fine-tuning all of FILE's weights and its classifier only (4x the learning rate); "
        "with --search, each combination of those keys too",
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
