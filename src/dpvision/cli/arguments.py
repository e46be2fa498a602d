"""Argument types and the arguments several commands share."""

# local imports: start-up time (heavy modules are imported in the functions using them)
import argparse
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) and exit code 2.

    Every command (and ``dpvision`` itself) takes ``-v/--verbose``, ``-q/--quiet`` and
    ``--log-file``; they are absent from the namespace unless given (``main`` reads them).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        output = self.add_argument_group("output")
        output.add_argument(
            "-v",
            "--verbose",
            action="count",
            default=argparse.SUPPRESS,
            help="debugging detail on stderr too",
        )
        output.add_argument(
            "-q",
            "--quiet",
            action="store_true",
            default=argparse.SUPPRESS,
            help="no progress lines; warnings and errors only",
        )
        output.add_argument(
            "--log-file",
            type=output_file,
            default=argparse.SUPPRESS,
            metavar="FILE",
            help="also append every message, with a timestamp, to FILE",
        )

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def ceil_sig(value: float, digits: int = 6) -> str:
    """Formats ``value`` with ``digits`` significant digits, rounded *up* (never understates)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    exponent = math.floor(math.log10(abs(value))) - digits + 1
    scale = 10.0**exponent
    rounded = math.ceil(value / scale - 1e-9) * scale
    return f"{rounded:.{digits}g}"


def positive_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def whole_number(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)


def secret_number(text: str) -> int:
    """``--secret-seed``: a whole number in [0, 2**256); the error never repeats the value."""
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("expected a whole number") from None
    if not 0 <= value < 2**256:
        raise argparse.ArgumentTypeError("expected a whole number in [0, 2**256)")
    return value


def redact_secrets(argv: Sequence[str], args: argparse.Namespace | None = None) -> list[str]:
    """The command line with every secret seed hidden (for the log file): the value given
    to ``--secret-seed`` (under any abbreviation argparse accepts) or ``--set
    secret_seed=...``, wherever it appears in a token."""
    secrets: set[str] = set()
    if args is not None and getattr(args, "secret_seed", None) is not None:
        secrets.add(str(args.secret_seed))
    for item in getattr(args, "set", None) or []:
        key, _, value = str(item).partition("=")
        if key.strip() == "secret_seed" and value.strip():
            secrets.add(value.strip())
    out: list[str] = []
    for position, item in enumerate(argv):
        previous = argv[position - 1] if position else ""
        if previous.startswith("--sec") and "=" not in previous:  # --secret-seed N, --secret N
            out.append("<secret>")
            continue
        for secret in sorted(secrets, key=len, reverse=True):
            item = item.replace(secret, "<secret>")
        if item.startswith("--sec") and "=" in item:
            item = item.split("=", 1)[0] + "=<secret>"
        if "secret_seed" in item and "=" in item:
            item = item[: item.index("secret_seed")] + "secret_seed=<secret>"
        out.append(item)
    return out


def output_file(text: str) -> str:
    """An argparse type for a file a command writes, checked before any work starts: not
    a folder, in a folder that exists and can be written to."""
    path = Path(text).expanduser()
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give the path of a file")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def output_folder(text: str) -> str:
    """An argparse type for a folder a command writes into (made if missing): not a file."""
    path = Path(text).expanduser()
    if not text or (path.exists() and not path.is_dir()):
        raise argparse.ArgumentTypeError(f"{text!r} is a file; give a folder")
    return text


def input_file(text: str) -> str:
    """An argparse type for a file a command reads: it exists and is not a folder."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give the path of a file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def add_accountant_argument(parser: argparse.ArgumentParser) -> None:
    from dpvision.accounting import Accountant

    parser.add_argument(
        "--accountant",
        choices=[a.value for a in Accountant],
        default=None,
        help="privacy accountant (default: all side by side in the table; in --json the "
        "tightest valid one: gaussian for full batch, else pld)",
    )


def add_device_arguments(
    parser: argparse.ArgumentParser, *, default: str | None = "auto", precision: bool = True
) -> None:
    """``--device`` (and ``--precision``): checked for spelling here, for presence when the
    command resolves it (:mod:`dpvision.devices`), both before any work."""
    parser.add_argument(
        "--device",
        type=_device,
        default=default,
        metavar="DEVICE",
        help="auto (CUDA when present, else the CPU), cpu, cuda or cuda:N"
        + ("" if default is None else f" (default: {default})"),
    )
    if precision:
        parser.add_argument(
            "--precision",
            type=_precision,
            default=None if default is None else "fp32",
            metavar="P",
            help="fp32 (default) or bf16: forward and backward passes under autocast; "
            "per-example norms, clipping and noise stay in float32",
        )


def _device(text: str) -> str:
    from dpvision.devices import parse_device
    from dpvision.errors import DPVisionError

    try:
        return parse_device(text)
    except DPVisionError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _precision(text: str) -> str:
    from dpvision.devices import parse_precision
    from dpvision.errors import DPVisionError

    try:
        return parse_precision(text)
    except DPVisionError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_common_arguments(
    parser: argparse.ArgumentParser, *, sigma: bool, epsilon: bool, steps: bool
) -> None:
    if sigma:
        parser.add_argument(
            "--noise-multiplier",
            type=positive_float,
            required=True,
            metavar="S",
            help="σ: noise std divided by the clipping norm",
        )
    if epsilon:
        parser.add_argument(
            "--epsilon", type=positive_float, required=True, metavar="E", help="target ε"
        )
    parser.add_argument(
        "--delta",
        type=positive_float,
        required=True,
        metavar="D",
        help="δ, in (0, 1); commonly below 1/N for N training examples",
    )
    parser.add_argument(
        "--sample-rate",
        type=positive_float,
        required=True,
        metavar="Q",
        help="Poisson sampling rate q = batch size / N; 1 means full batch",
    )
    if steps:
        parser.add_argument(
            "--steps", type=whole_number, required=True, metavar="T", help="number of noisy steps"
        )
    add_accountant_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that describe a training run (shared by ``train`` and ``audit``)."""
    parser.add_argument(
        "--config", type=input_file, metavar="FILE.toml", help="a TOML run configuration"
    )
    parser.add_argument(
        "--dataset",
        help="digits, mnist, fashion-mnist, cifar10, cifar10-jpeg, cifar100, "
        "dermamnist, npz:PATH, npy:DIR or imagefolder:PATH",
    )
    parser.add_argument("--data-dir", metavar="DIR", help="folder with the dataset's files")
    parser.add_argument(
        "--method",
        help="auto (the default recipe, docs/guide/recipes.md), dp-ls, dp-newton, dp-fc, "
        "dp-sgd-linear (features), dp-sgd (deep models) or dp-randp (Phases II and III from "
        "a synthetic-data encoder)",
    )
    parser.add_argument(
        "--features",
        help="auto (the default), pixels, scatternet, encoder:path=FILE or "
        "precomputed:path=DIR (vectors in "
        "x_train.npy, y_train.npy, x_test.npy, y_test.npy) (e.g. scatternet:pool=2)",
    )
    parser.add_argument(
        "--epsilon",
        type=positive_float,
        metavar="E",
        help="target ε of the whole run (inf: no noise)",
    )
    parser.add_argument("--delta", type=positive_float, metavar="D", help="target δ")
    parser.add_argument(
        "--noise-multiplier",
        type=positive_float,
        metavar="S",
        help="a fixed σ instead of a target ε (0: no noise)",
    )
    add_accountant_argument(parser)
    parser.add_argument(
        "--seed",
        type=whole_number,
        metavar="N",
        help="public seed: initialisation, augmentation (published with the config)",
    )
    parser.add_argument(
        "--secret-seed",
        type=secret_number,
        metavar="N",
        help="replay the secret randomness (noise, sampling, splits) for research; never "
        "written to any output (default: fresh OS entropy every run)",
    )
    add_device_arguments(parser, default=None)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config field, e.g. --set learner.epochs=20",
    )


def run_flags(args: argparse.Namespace) -> dict[str, Any]:
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
        "secret_seed": args.secret_seed,
        "device": args.device,
        "precision": args.precision,
    }


def number_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def whole_list(text: str) -> list[int]:
    values = number_list(text)
    if not all(v.is_integer() for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}")
    return [int(v) for v in values]
