"""The ``dpvision`` command line (also ``python -m dpvision``).

Commands:
  dpvision privacy epsilon  ε spent by T steps of the (Poisson-sampled) Gaussian mechanism
  dpvision privacy noise    the noise multiplier σ that meets a target (ε, δ)
  dpvision privacy steps    how many steps a noise multiplier allows within (ε, δ)
  dpvision train            train a private classifier and write its result JSON
  dpvision tune             private hyper-parameter selection, accounted in ε
  dpvision predict          classify images with a saved model (train --save)
  dpvision evaluate         a saved model's accuracy on a test split
  dpvision audit            an empirical ε lower bound by membership inference
  dpvision pretrain         DP-RandP Phase I: an encoder from synthetic images
  dpvision synth            a preview grid of synthetic images
  dpvision sweep, report    privacy-utility grids, tables and plots
  dpvision cache            list or clear the feature cache and downloaded datasets

One module per command (:mod:`dpvision.cli.train`, …), each with ``add_parser`` and ``run``.
:data:`COMMAND_TABLE` is the one registry: the parser and the dispatch are both built from it.

User errors (bad values, unreachable targets) print one line on stderr and exit with code 2.
"""

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dpvision.cli import audit, cache, model, pretrain, privacy, report, train, tune
from dpvision.cli.arguments import EXIT_USAGE, Parser, redact_secrets
from dpvision.cli.pretrain import SYNTHETIC_KINDS
from dpvision.errors import DPVisionError, Interrupted
from dpvision.log import configure, logger
from dpvision.version import __version__

__all__ = ["COMMANDS", "COMMAND_TABLE", "SYNTHETIC_KINDS", "build_parser", "main"]

Runner = Callable[[argparse.Namespace], None]

COMMAND_TABLE: tuple[tuple[Callable[[Any], None], dict[str, Runner]], ...] = (
    (privacy.add_parser, {"privacy": privacy.run}),
    (train.add_parser, {"train": train.run}),
    (tune.add_parser, {"tune": tune.run}),
    (audit.add_parser, {"audit": audit.run}),
    (pretrain.add_pretrain_parser, {"pretrain": pretrain.run_pretrain}),
    (pretrain.add_synth_parser, {"synth": pretrain.run_synth}),
    (report.add_parsers, {"sweep": report.run_sweep, "report": report.run_report}),
    (model.add_parsers, {"predict": model.run_predict, "evaluate": model.run_evaluate}),
    (cache.add_parser, {"cache": cache.run}),
)
"""Every command, in the order ``dpvision --help`` lists them: a function that adds the
parsers of one or more commands to the subparsers, and each of those commands' ``run``."""

COMMANDS: dict[str, Runner] = {name: run for _, runs in COMMAND_TABLE for name, run in runs.items()}
"""Command name → its ``run`` (from :data:`COMMAND_TABLE`)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command."""
    parser = Parser(
        prog="dpvision",
        description="Differentially private image classification.",
    )
    parser.add_argument("--version", action="version", version=f"dpvision {__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=Parser, metavar="COMMAND"
    )
    for add_parsers, runs in COMMAND_TABLE:
        before = set(commands.choices)
        add_parsers(commands)
        added = set(commands.choices) - before
        # The table names exactly the commands each function adds: none runs unlisted.
        assert added == set(runs), f"{add_parsers.__qualname__} added {sorted(added)}"
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.quiet = bool(getattr(args, "quiet", False))
    configure(-1 if args.quiet else getattr(args, "verbose", 0), getattr(args, "log_file", None))
    command = redact_secrets(sys.argv if argv is None else argv, args)
    logger.debug("dpvision %s: %s", __version__, " ".join(command))
    try:
        if args.command != "train" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise DPVisionError(
                f"`dpvision {args.command}` runs in one process; only `dpvision train` "
                "runs under torchrun"
            )
        COMMANDS[args.command](args)
    except DPVisionError as error:
        logger.debug("error: %s", error)
        print(f"dpvision: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as interrupt:  # an Interrupted says what is left to resume from
        said = f"; {interrupt}" if isinstance(interrupt, Interrupted) else ""
        print(f"dpvision: interrupted{said}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dpvision … | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        configure()  # the defaults again, the log file closed (main may be called again)
    return 0
