"""The ``dpvision`` command line (also ``python -m dpvision``).

Commands:
  dpvision privacy epsilon  ε spent by T steps of the (Poisson-sampled) Gaussian mechanism
  dpvision privacy noise    the noise multiplier σ that meets a target (ε, δ)
  dpvision privacy steps    how many steps a noise multiplier allows within (ε, δ)
  dpvision train            train a private classifier and write its result JSON
  dpvision audit            an empirical ε lower bound by membership inference

User errors (bad values, unreachable targets) print one line on stderr and exit with code 2.
"""

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from dpvision import __version__
from dpvision.audit.canaries import CANARIES
from dpvision.data.synthetic import write_preview
from dpvision.errors import DPVisionError
from dpvision.report import report, sweep

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _ceil_sig(value: float, digits: int = 6) -> str:
    """Formats ``value`` with ``digits`` significant digits, rounded *up* (never understates)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    exponent = math.floor(math.log10(abs(value))) - digits + 1
    scale = 10.0**exponent
    rounded = math.ceil(value / scale - 1e-9) * scale
    return f"{rounded:.{digits}g}"


def _positive_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _whole_number(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)


def _add_accountant_argument(parser: argparse.ArgumentParser) -> None:
    # local import: start-up time
    from dpvision.accounting import Accountant

    parser.add_argument(
        "--accountant",
        choices=[a.value for a in Accountant],
        default=None,
        help="privacy accountant (default: all side by side in the table; in --json the "
        "tightest valid one: gaussian for full batch, else pld)",
    )


def _add_common_arguments(
    parser: argparse.ArgumentParser, *, sigma: bool, epsilon: bool, steps: bool
) -> None:
    if sigma:
        parser.add_argument(
            "--noise-multiplier",
            type=_positive_float,
            required=True,
            metavar="S",
            help="σ: noise std divided by the clipping norm",
        )
    if epsilon:
        parser.add_argument(
            "--epsilon", type=_positive_float, required=True, metavar="E", help="target ε"
        )
    parser.add_argument(
        "--delta",
        type=_positive_float,
        required=True,
        metavar="D",
        help="δ, in (0, 1); commonly below 1/N for N training examples",
    )
    parser.add_argument(
        "--sample-rate",
        type=_positive_float,
        required=True,
        metavar="Q",
        help="Poisson sampling rate q = batch size / N; 1 means full batch",
    )
    if steps:
        parser.add_argument(
            "--steps", type=_whole_number, required=True, metavar="T", help="number of noisy steps"
        )
    _add_accountant_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that describe a training run (shared by ``train`` and ``audit``)."""
    parser.add_argument("--config", metavar="FILE.toml", help="a TOML run configuration")
    parser.add_argument(
        "--dataset",
        help="digits, mnist, fashion-mnist, cifar10, cifar100, "
        "dermamnist, npz:PATH, npy:DIR or imagefolder:PATH",
    )
    parser.add_argument("--data-dir", metavar="DIR", help="folder with the dataset's files")
    parser.add_argument(
        "--method",
        help="dp-ls, dp-newton, dp-fc, dp-sgd-linear (features), dp-sgd (deep models) or "
        "dp-randp (Phases II and III from a synthetic-data encoder)",
    )
    parser.add_argument(
        "--features",
        help="pixels, scatternet, encoder:path=FILE or precomputed:path=DIR (vectors in "
        "x_train.npy, y_train.npy, x_test.npy, y_test.npy) (e.g. scatternet:pool=2)",
    )
    parser.add_argument(
        "--epsilon",
        type=_positive_float,
        metavar="E",
        help="target ε of the whole run (inf: no noise)",
    )
    parser.add_argument("--delta", type=_positive_float, metavar="D", help="target δ")
    parser.add_argument(
        "--noise-multiplier",
        type=_positive_float,
        metavar="S",
        help="a fixed σ instead of a target ε (0: no noise)",
    )
    _add_accountant_argument(parser)
    parser.add_argument("--seed", type=_whole_number, metavar="N", help="random seed")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config field, e.g. --set learner.epochs=20",
    )


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dataset": args.dataset,
        "data_dir": args.data_dir,
        "method": args.method,
        "features": args.features,
        "epsilon": args.epsilon,
        "delta": args.delta,
        "noise_multiplier": args.noise_multiplier,
        "accountant": args.accountant,
        "seed": args.seed,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dpvision",
        description="Differentially private image classification.",
    )
    parser.add_argument("--version", action="version", version=f"dpvision {__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="COMMAND"
    )
    privacy = commands.add_parser(
        "privacy",
        help="privacy calculator: ε, noise multiplier or steps for the Gaussian mechanism",
        description="Privacy calculator for T steps of the Poisson-sampled Gaussian mechanism "
        "(DP-SGD) or, with --sample-rate 1, of the full-batch Gaussian mechanism. "
        "Add/remove-one adjacency.",
    )
    queries = privacy.add_subparsers(
        dest="query", required=True, parser_class=_Parser, metavar="QUERY"
    )
    _add_common_arguments(
        queries.add_parser("epsilon", help="ε for given σ, q, T, δ"),
        sigma=True,
        epsilon=False,
        steps=True,
    )
    _add_common_arguments(
        queries.add_parser("noise", help="σ that meets a target (ε, δ) for given q, T"),
        sigma=False,
        epsilon=True,
        steps=True,
    )
    _add_common_arguments(
        queries.add_parser("steps", help="largest T within a target (ε, δ) for given σ, q"),
        sigma=True,
        epsilon=True,
        steps=False,
    )
    train = commands.add_parser(
        "train",
        help="train a private classifier and evaluate it (no arguments: a small default run)",
        description="Train on a dataset's features, evaluate on its test split, print a "
        "summary and (with --json) write the result JSON. With no arguments it trains DP-LS "
        "on scikit-learn's digits at ε = 3, which needs no download.",
    )
    _add_run_arguments(train)
    train.add_argument("--json", metavar="FILE", help="write the result JSON here")
    train.add_argument(
        "--checkpoint",
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
    train.add_argument("--quiet", action="store_true", help="no progress messages")
    _add_audit_parser(commands)
    _add_pretrain_parser(commands)
    _add_synth_parser(commands)
    _add_report_parsers(commands)
    return parser


def _add_pretrain_parser(commands: Any) -> None:
    pretrain = commands.add_parser(
        "pretrain",
        help="DP-RandP Phase I: pre-train an encoder on synthetic images (no private data)",
        description="Contrastive pre-training (alignment + uniformity, Wang & Isola) of a "
        "model's body on images from a random process; writes an encoder file for "
        "`dpvision train --method dp-randp --set learner.encoder=FILE` or "
        "`--features encoder:path=FILE`. Uses no private data and costs no privacy.",
    )
    pretrain.add_argument("--out", required=True, metavar="FILE", help="the encoder file")
    pretrain.add_argument("--config", metavar="FILE.toml", help="a TOML file of options")
    pretrain.add_argument("--model", help="tanh-cnn, wrn-DEPTH-WIDTH, … (default tanh-cnn)")
    pretrain.add_argument(
        "--synthetic", metavar="KIND", help="the generator (see `dpvision synth --help`)"
    )
    pretrain.add_argument("--size", type=_whole_number, help="image side (default 28)")
    pretrain.add_argument("--channels", type=_whole_number, help="1 or 3 (default 1)")
    pretrain.add_argument("--steps", type=_whole_number, help="optimisation steps")
    pretrain.add_argument("--batch-size", type=_whole_number, help="images per step")
    pretrain.add_argument(
        "--num-images", type=_whole_number, help="images generated once (0: fresh each step)"
    )
    pretrain.add_argument("--seed", type=_whole_number, help="random seed")
    pretrain.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other option, e.g. --set learning_rate=0.06",
    )
    pretrain.add_argument(
        "--checkpoint", metavar="FILE", help="resume from FILE if it exists; write it as it runs"
    )
    pretrain.add_argument("--json", metavar="FILE", help="write a summary JSON here")
    pretrain.add_argument("--quiet", action="store_true", help="no progress messages")


def _run_pretrain(args: argparse.Namespace) -> None:
    # local import: start-up time
    from dpvision.config import load_toml, parse_override

    # local import: start-up time
    from dpvision.fileio import write_json_atomic

    # local import: start-up time
    from dpvision.training.pretrain import PretrainOptions, pretrain

    raw: dict[str, Any] = {}
    if args.config:
        table = load_toml(args.config)
        raw.update(table.get("pretrain", table))
    flags = {
        "model": args.model,
        "synthetic": args.synthetic,
        "size": args.size,
        "channels": args.channels,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "num_images": args.num_images,
        "seed": args.seed,
    }
    raw.update({k: v for k, v in flags.items() if v is not None})
    for item in args.set:
        path, value = parse_override(item)
        raw[".".join(path)] = value
    options = PretrainOptions.from_dict(raw)
    result = pretrain(options, args.out, checkpoint=args.checkpoint, quiet=args.quiet)
    if args.json:
        write_json_atomic(args.json, result)
    print(
        f"encoder {options.model} pre-trained on {options.synthetic} "
        f"({options.channels}×{options.size}×{options.size}) for {options.steps} steps: final "
        f"loss {result['final_loss']:.4f}, wall time {result['wall_seconds']:.1f} s\n"
        f"written to {args.out} (no private data used: ε = 0)"
    )


# The generators of dpvision.data.synthetic (kept here so `dpvision --help` needs no torch).
SYNTHETIC_KINDS = (
    "dead-leaves-squares",
    "dead-leaves-oriented",
    "dead-leaves-mixed",
    "oriented-filters",
    "spectral",
)


def _add_synth_parser(commands: Any) -> None:
    synth = commands.add_parser(
        "synth",
        help="images from random processes: write a preview grid PNG",
        description="Generates images from one of the random processes of DP-RandP's Phase I "
        f"({', '.join(SYNTHETIC_KINDS)}) and writes them as one grid PNG to look at.",
    )
    synth.add_argument("--kind", required=True, help=", ".join(SYNTHETIC_KINDS))
    synth.add_argument("--n", type=_whole_number, default=64, help="images (default 64)")
    synth.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
    synth.add_argument("--size", type=_whole_number, default=32, help="image side (default 32)")
    synth.add_argument("--channels", type=_whole_number, default=3, help="1 or 3 (default 3)")
    synth.add_argument("--seed", type=_whole_number, default=0, help="random seed")
    synth.add_argument("--columns", type=_whole_number, default=8, help="grid columns")


def _number_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _whole_list(text: str) -> list[int]:
    values = _number_list(text)
    if not all(v.is_integer() for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}")
    return [int(v) for v in values]


def _add_report_parsers(commands: Any) -> None:
    sweep = commands.add_parser(
        "sweep",
        help="run configs over a grid of target ε and seeds; one result JSON per run",
        description="Runs each --config at every target ε of --epsilons and every seed of "
        "--seeds, writing one result JSON per run into --out (runs already there are kept, "
        "so an interrupted sweep resumes). Then: dpvision report OUT.",
    )
    sweep.add_argument(
        "--config", action="append", required=True, metavar="FILE.toml", help="repeatable"
    )
    sweep.add_argument(
        "--epsilons", type=_number_list, required=True, metavar="E1,E2,...", help="target ε"
    )
    sweep.add_argument("--seeds", type=_whole_list, default=[0], metavar="S1,S2,...")
    sweep.add_argument("--out", required=True, metavar="DIR", help="folder for the JSONs")
    sweep.add_argument("--data-dir", metavar="DIR", help="folder with the dataset's files")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sweep.add_argument("--quiet", action="store_true")
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
        "--out", metavar="FILE.md", help="default: report.md in the first RESULTS_DIR"
    )
    report.add_argument(
        "--references",
        nargs="+",
        default=[],
        metavar="CONFIG.toml",
        help="configs whose [reference] published points are plotted as well",
    )


def _run_sweep(args: argparse.Namespace) -> None:

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


def _run_report(args: argparse.Namespace) -> None:

    summary = report(args.results, args.out, references=args.references)
    print(f"report written to {summary['report']}")
    for png in summary["plots"]:
        print(f"plot written to {png}")
    if summary["flagged"]:
        print(f"{len(summary['flagged'])} flagged runs (see the report's Flags section)")


def _run_synth(args: argparse.Namespace) -> None:

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


def _run_train(args: argparse.Namespace) -> None:
    # local import: start-up time
    from dpvision.config import resolve

    # local import: start-up time
    from dpvision.fileio import write_json_atomic

    # local import: start-up time
    from dpvision.runs.train import run_training, summary

    flags = _flags(args)
    sets = list(args.set)
    if args.phase2_fraction is not None:
        sets.append(f"learner.phase2_fraction={args.phase2_fraction!r}")
    config = resolve(args.config, flags, sets)
    if args.json:  # fail on an unwritable path before training, not after
        folder = Path(args.json).parent
        if str(folder) and not folder.is_dir():
            raise DPVisionError(f"cannot write {args.json}: folder {folder} does not exist")
    workers = _join_torchrun()
    try:
        result = run_training(config, quiet=args.quiet, checkpoint=args.checkpoint)
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
            # local import: start-up time
            from dpvision.distributed import shutdown

            shutdown()
    if workers is not None and not workers.is_main:
        return  # rank 0 reports; every rank holds the same result
    if args.json:
        write_json_atomic(args.json, result)
    print(summary(result))
    if args.json:
        print(f"result written to {args.json}")


def _join_torchrun() -> Any:
    """Joins the process group when launched by torchrun with several processes."""
    # local import: start-up time
    from dpvision.distributed import init_from_env, launched_by_torchrun

    return init_from_env() if launched_by_torchrun() else None


def _add_audit_parser(commands: Any) -> None:
    audit = commands.add_parser(
        "audit",
        help="empirical ε lower bound of a training configuration by membership inference",
        description="Train many models on a small D and on D' = D ∪ {canary}, and turn how "
        "well the canary's loss tells them apart into a lower bound on ε (Clopper-Pearson, "
        "De et al. 2022 App. A.2). A bound above the claimed ε proves a privacy bug. Phase I "
        "picks the canary and swept settings that separate best; phase II measures with "
        "fresh runs. δ defaults to 1/|D|.",
    )
    _add_run_arguments(audit)
    audit.add_argument(
        "--runs",
        type=_whole_number,
        default=1000,
        metavar="N",
        help="phase II: models trained on each of D and D' (default 1000)",
    )
    audit.add_argument(
        "--phase1-runs",
        type=_whole_number,
        default=100,
        metavar="N",
        help="phase I: models per side for each candidate (default 100)",
    )
    audit.add_argument(
        "--dataset-size",
        type=_whole_number,
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
        type=_whole_number,
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
        type=_positive_float,
        default=0.999,
        metavar="P",
        help="confidence of the lower bound (default 0.999)",
    )
    audit.add_argument(
        "--selection-fraction",
        type=_positive_float,
        default=0.1,
        metavar="F",
        help="share of phase II runs that choose the threshold (default 0.1)",
    )
    audit.add_argument("--histogram", metavar="FILE.png", help="write the loss histogram here")
    audit.add_argument("--quiet", action="store_true", help="no progress bar")
    audit.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="print the report as JSON (or write it to FILE)",
    )


def _run_audit(args: argparse.Namespace) -> None:

    # local import: start-up time
    from dpvision.audit import AuditSettings, audit_config, parse_sweep, run_audit, summary

    # local import: start-up time
    from dpvision.fileio import write_json_atomic

    for path in (args.histogram, None if args.json == "-" else args.json):
        folder = Path(path).parent if path else None
        if folder is not None and str(folder) and not folder.is_dir():
            raise DPVisionError(f"cannot write {path}: folder {folder} does not exist")
    config, default_sweep = audit_config(args.config, _flags(args), args.set)
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


def _accountants_for(sample_rate: float, chosen: str | None) -> list[Any]:
    # local import: start-up time
    from dpvision.accounting import Accountant

    if chosen is not None:
        return [Accountant(chosen)]
    return list(Accountant)


def _default_for(sample_rate: float, chosen: str | None) -> Any:
    # local import: start-up time
    from dpvision.accounting import Accountant

    if chosen is not None:
        return Accountant(chosen)
    return Accountant.GAUSSIAN if sample_rate == 1 else Accountant.PLD


def _not_applicable(accountant: Any, sample_rate: float) -> str | None:
    # local import: start-up time
    from dpvision.accounting import Accountant

    if accountant is Accountant.GAUSSIAN and sample_rate != 1:
        return "n/a (exact only for full batch, --sample-rate 1)"
    return None


def _print_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print(title)
    for row in [header, *rows]:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print(("  " + "  ".join(cells)).rstrip())


def _table_rows(
    accountants: list[Any], sample_rate: float, row: Callable[[Any], tuple[str, ...]]
) -> list[tuple[str, ...]]:
    """One row per accountant; an accountant that cannot answer gets its reason in the row.

    When none can answer, the first error is raised, so the command fails with exit code 2.
    """
    rows, errors = [], []
    for accountant in accountants:
        reason = _not_applicable(accountant, sample_rate)
        if reason:
            rows.append((accountant.value, reason))
            continue
        try:
            rows.append((accountant.value, *row(accountant)))
        except DPVisionError as error:
            errors.append(error)
            rows.append((accountant.value, f"n/a: {str(error).split(';')[0]}"))
    if len(errors) == len([a for a in accountants if not _not_applicable(a, sample_rate)]):
        raise errors[0]
    width = max(len(r) for r in rows)
    return [r + ("",) * (width - len(r)) for r in rows]


def _run_epsilon(args: argparse.Namespace) -> dict[str, Any] | None:
    # local import: start-up time
    from dpvision.accounting import compute_epsilon, poisson_gaussian_event

    event = poisson_gaussian_event(
        noise_multiplier=args.noise_multiplier, sample_rate=args.sample_rate, steps=args.steps
    )
    base = {
        "noise_multiplier": args.noise_multiplier,
        "sample_rate": args.sample_rate,
        "steps": args.steps,
        "delta": args.delta,
        "neighboring_relation": "add_or_remove_one",
    }
    if args.json:
        accountant = _default_for(args.sample_rate, args.accountant)
        epsilon = compute_epsilon(event, delta=args.delta, accountant=accountant)
        return {"epsilon": epsilon, "accountant": accountant.value, **base}
    rows = _table_rows(
        _accountants_for(args.sample_rate, args.accountant),
        args.sample_rate,
        lambda accountant: (
            _ceil_sig(compute_epsilon(event, delta=args.delta, accountant=accountant)),
        ),
    )
    _print_table(
        f"ε for σ = {args.noise_multiplier:g}, q = {args.sample_rate:g}, T = {args.steps}, "
        f"δ = {args.delta:g} (add/remove-one adjacency):",
        ("accountant", "epsilon"),
        rows,
    )
    return None


def _run_noise(args: argparse.Namespace) -> dict[str, Any] | None:
    # local import: start-up time
    from dpvision.accounting import (
        calibrate_noise_multiplier,
        compute_epsilon,
        poisson_gaussian_event,
    )

    def calibrate(accountant: Any) -> tuple[float, float]:
        sigma = calibrate_noise_multiplier(
            target_epsilon=args.epsilon,
            target_delta=args.delta,
            sample_rate=args.sample_rate,
            steps=args.steps,
            accountant=accountant,
        )
        event = poisson_gaussian_event(
            noise_multiplier=sigma, sample_rate=args.sample_rate, steps=args.steps
        )
        return sigma, compute_epsilon(event, delta=args.delta, accountant=accountant)

    if args.json:
        accountant = _default_for(args.sample_rate, args.accountant)
        sigma, epsilon = calibrate(accountant)
        return {
            "noise_multiplier": sigma,
            "epsilon": epsilon,
            "target_epsilon": args.epsilon,
            "delta": args.delta,
            "accountant": accountant.value,
            "sample_rate": args.sample_rate,
            "steps": args.steps,
            "neighboring_relation": "add_or_remove_one",
        }

    def row(accountant: Any) -> tuple[str, str]:
        sigma, _ = calibrate(accountant)
        # Show σ rounded up, and the ε of the σ shown, so copying it never overshoots.
        shown = _ceil_sig(sigma)
        event = poisson_gaussian_event(
            noise_multiplier=float(shown), sample_rate=args.sample_rate, steps=args.steps
        )
        return shown, _ceil_sig(compute_epsilon(event, delta=args.delta, accountant=accountant))

    rows = _table_rows(_accountants_for(args.sample_rate, args.accountant), args.sample_rate, row)
    _print_table(
        f"noise multiplier for ε ≤ {args.epsilon:g}, δ = {args.delta:g}, "
        f"q = {args.sample_rate:g}, T = {args.steps} (add/remove-one adjacency):",
        ("accountant", "noise_multiplier", "epsilon"),
        rows,
    )
    return None


def _run_steps(args: argparse.Namespace) -> dict[str, Any] | None:
    # local import: start-up time
    from dpvision.accounting import calibrate_steps, compute_epsilon, poisson_gaussian_event

    def solve(accountant: Any) -> tuple[int, float]:
        steps = calibrate_steps(
            target_epsilon=args.epsilon,
            target_delta=args.delta,
            noise_multiplier=args.noise_multiplier,
            sample_rate=args.sample_rate,
            accountant=accountant,
        )
        event = poisson_gaussian_event(
            noise_multiplier=args.noise_multiplier, sample_rate=args.sample_rate, steps=steps
        )
        return steps, compute_epsilon(event, delta=args.delta, accountant=accountant)

    if args.json:
        accountant = _default_for(args.sample_rate, args.accountant)
        steps, epsilon = solve(accountant)
        return {
            "steps": steps,
            "epsilon": epsilon,
            "target_epsilon": args.epsilon,
            "delta": args.delta,
            "accountant": accountant.value,
            "noise_multiplier": args.noise_multiplier,
            "sample_rate": args.sample_rate,
            "neighboring_relation": "add_or_remove_one",
        }

    def row(accountant: Any) -> tuple[str, str]:
        steps, epsilon = solve(accountant)
        return str(steps), _ceil_sig(epsilon)

    rows = _table_rows(_accountants_for(args.sample_rate, args.accountant), args.sample_rate, row)
    _print_table(
        f"steps within ε ≤ {args.epsilon:g}, δ = {args.delta:g} for σ = "
        f"{args.noise_multiplier:g}, q = {args.sample_rate:g} (add/remove-one adjacency):",
        ("accountant", "steps", "epsilon"),
        rows,
    )
    return None


_PRIVACY_QUERIES: dict[str, Callable[[argparse.Namespace], dict[str, Any] | None]] = {
    "epsilon": _run_epsilon,
    "noise": _run_noise,
    "steps": _run_steps,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command != "train" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise DPVisionError(
                f"`dpvision {args.command}` runs in one process; only `dpvision train` "
                "runs under torchrun"
            )
        if args.command == "privacy":
            result = _PRIVACY_QUERIES[args.query](args)
            if result is not None:
                print(json.dumps(result))
        elif args.command == "train":
            _run_train(args)
        elif args.command == "audit":
            _run_audit(args)
        elif args.command == "pretrain":
            _run_pretrain(args)
        elif args.command == "synth":
            _run_synth(args)
        elif args.command == "sweep":
            _run_sweep(args)
        elif args.command == "report":
            _run_report(args)
    except DPVisionError as error:
        print(f"dpvision: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("dpvision: interrupted", file=sys.stderr)
        return 130
    return 0
