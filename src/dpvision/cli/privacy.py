"""``dpvision privacy epsilon | noise | steps``: the privacy calculator's command line."""

# local imports: start-up time (heavy modules are imported in the functions using them)
import argparse
import json
from collections.abc import Callable
from typing import Any

from dpvision.cli.arguments import (
    Parser,
    add_common_arguments,
    ceil_sig,
)
from dpvision.errors import DPVisionError
from dpvision.log import say


def _accountants_for(sample_rate: float, chosen: str | None) -> list[Any]:
    from dpvision.accounting import Accountant

    if chosen is not None:
        return [Accountant(chosen)]
    return list(Accountant)


def _default_for(sample_rate: float, chosen: str | None) -> Any:
    from dpvision.accounting import Accountant

    if chosen is not None:
        return Accountant(chosen)
    return Accountant.GAUSSIAN if sample_rate == 1 else Accountant.PLD


def _not_applicable(accountant: Any, sample_rate: float) -> str | None:
    from dpvision.accounting import Accountant

    if accountant is Accountant.GAUSSIAN and sample_rate != 1:
        return "n/a (exact only for full batch, --sample-rate 1)"
    return None


def _print_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """The rows under ``header`` in aligned columns; a row that is a note (``n/a …`` and
    nothing after it) runs on past the columns instead of widening them."""

    def note(row: tuple[str, ...]) -> bool:
        return row[1].startswith("n/a") and not any(row[2:])

    table = [header, *(row for row in rows if not note(row))]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print(title)
    for row in [header, *rows]:
        if note(row):
            print(f"  {row[0].ljust(widths[0])}  {row[1]}")
            continue
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print(("  " + "  ".join(cells)).rstrip())


def _table_rows(
    accountants: list[Any],
    sample_rate: float,
    row: Callable[[Any], tuple[str, ...]],
    search: bool = False,
) -> list[tuple[str, ...]]:
    """One row per accountant; an accountant that cannot answer gets its reason in the row.

    When none can answer, the first error is raised, so the command fails with exit code 2.
    ``search``: each row is a search over σ or T (seconds each), announced on stderr.
    """
    rows, errors = [], []
    for accountant in accountants:
        reason = _not_applicable(accountant, sample_rate)
        if reason:
            rows.append((accountant.value, reason))
            continue
        if search:
            say(f"searching with the {accountant.value} accountant…")
        try:
            rows.append((accountant.value, *row(accountant)))
        except DPVisionError as error:
            errors.append(error)
            rows.append((accountant.value, f"n/a: {str(error).split(';')[0]}"))
    applicable = [a for a in accountants if not _not_applicable(a, sample_rate)]
    if not applicable:
        raise DPVisionError(
            f"--accountant {accountants[0].value} is exact only for full batch "
            f"(--sample-rate 1), not q = {sample_rate:g}; use pld or rdp"
        )
    if len(errors) == len(applicable):
        raise errors[0]
    width = max(len(r) for r in rows)
    return [r + ("",) * (width - len(r)) for r in rows]


def _run_epsilon(args: argparse.Namespace) -> dict[str, Any] | None:
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
            ceil_sig(compute_epsilon(event, delta=args.delta, accountant=accountant)),
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
        say(f"searching with the {accountant.value} accountant…")
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
        shown = ceil_sig(sigma)
        event = poisson_gaussian_event(
            noise_multiplier=float(shown), sample_rate=args.sample_rate, steps=args.steps
        )
        return shown, ceil_sig(compute_epsilon(event, delta=args.delta, accountant=accountant))

    rows = _table_rows(
        _accountants_for(args.sample_rate, args.accountant), args.sample_rate, row, search=True
    )
    _print_table(
        f"noise multiplier for ε ≤ {args.epsilon:g}, δ = {args.delta:g}, "
        f"q = {args.sample_rate:g}, T = {args.steps} (add/remove-one adjacency):",
        ("accountant", "noise_multiplier", "epsilon"),
        rows,
    )
    return None


def _run_steps(args: argparse.Namespace) -> dict[str, Any] | None:
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
        say(f"searching with the {accountant.value} accountant…")
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
        return str(steps), ceil_sig(epsilon)

    rows = _table_rows(
        _accountants_for(args.sample_rate, args.accountant), args.sample_rate, row, search=True
    )
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


def add_parser(commands: Any) -> None:
    """``dpvision privacy`` and its three queries."""
    privacy = commands.add_parser(
        "privacy",
        help="privacy calculator: ε, noise multiplier or steps for the Gaussian mechanism",
        description="Privacy calculator for T steps of the Poisson-sampled Gaussian mechanism "
        "(DP-SGD) or, with --sample-rate 1, of the full-batch Gaussian mechanism. "
        "Add/remove-one adjacency.",
    )
    queries = privacy.add_subparsers(
        dest="query", required=True, parser_class=Parser, metavar="QUERY"
    )
    add_common_arguments(
        queries.add_parser("epsilon", help="ε for given σ, q, T, δ"),
        sigma=True,
        epsilon=False,
        steps=True,
    )
    add_common_arguments(
        queries.add_parser("noise", help="σ that meets a target (ε, δ) for given q, T"),
        sigma=False,
        epsilon=True,
        steps=True,
    )
    add_common_arguments(
        queries.add_parser("steps", help="largest T within a target (ε, δ) for given σ, q"),
        sigma=True,
        epsilon=True,
        steps=False,
    )


def run(args: argparse.Namespace) -> None:
    result = _PRIVACY_QUERIES[args.query](args)
    if result is not None:
        print(json.dumps(result))
