"""Privacy audit of dpvision itself: empirical ε lower bounds for DP-SGD and DP-LS.

Seed 003 (De et al. 2022, App. A.2, Table 9) audits its DP-SGD at ε ∈ {1, 2, 4, 8},
δ = 1/|D|, with |D| = 100 MNIST images and a LeNet. This script runs the same two-phase
procedure with ``dpvision audit`` on dpvision's ``dp-sgd`` (a tanh MLP with 32 hidden units
on scikit-learn's 8×8 digits, batch 64, 50 steps; the MLP makes thousands of trainings
fit on a 2-core CPU) and ``dp-ls`` (pixels), |D| = 100 digits, and writes the lower bound,
membership AUC and advantage beside the claimed ε and beside seed 003's Table 9.

Per audit: phase I tries the three canaries (blank, noise, mislabeled) × the default sweep
with ``--phase1-runs`` models per side each; phase II trains ``--runs`` fresh models per
side, chooses the threshold on 10 % of them and bounds ε on the rest at 99.9 % confidence.
Seed 003 used 500,000 models per side; a Clopper-Pearson bound from 900 evaluation runs per
side cannot exceed about ln(900/7.6) ≈ 4.8 whatever the separation, so the bounds here are
looser than the paper's at large ε by construction; the check that matters is that no bound
exceeds the claim.

Run:  python benchmarks/audit_lower_bounds.py            (about 25 minutes on 2 cores)
      (--methods dp-ls, --epsilons 1 8, --runs 500, --report-only to rebuild the table)
Writes benchmarks/results/audit/<method>-eps<E>.{json,png} and
benchmarks/results/audit_lower_bounds.{json,md}.
"""

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dpvision.audit import AuditSettings, audit_config, run_audit
from dpvision.audit.canaries import CANARIES
from dpvision.fileio import write_json_atomic

RESULTS = Path(__file__).parent / "results"
FOLDER = RESULTS / "audit"
# Seed 003, Table 9, |D| = 100: (ε lower bound, AUC, advantage, advantage upper bound).
PAPER = {1: (0.361, 0.59, 0.13, 0.47), 2: (0.837, 0.66, 0.22, 0.76),
         4: (2.461, 0.79, 0.43, 0.96), 8: (4.327, 0.91, 0.67, 1.00)}  # fmt: skip


def audit_one(method: str, epsilon: float, args: argparse.Namespace) -> dict[str, Any]:
    config, sweep = audit_config(None, {"method": method, "epsilon": epsilon}, [])
    settings = AuditSettings(
        dataset_size=100,
        canaries=CANARIES,
        sweep=sweep,
        phase1_runs=args.phase1_runs,
        runs=args.runs,
        seed=args.seed,
    )
    stem = f"{method}-eps{epsilon:g}"
    report = run_audit(config, settings, progress=True, histogram=FOLDER / f"{stem}.png")
    report["histogram"] = f"audit/{stem}.png"
    write_json_atomic(FOLDER / f"{stem}.json", report)
    return report


def refresh_statistics(report: dict[str, Any]) -> None:
    """Recomputes every statistic of a stored report from its canary losses (no training)."""
    import numpy as np

    from dpvision.audit import advantage_upper_bound, audit_scores

    result = audit_scores(
        np.asarray(report["losses_without"]),
        np.asarray(report["losses_with"]),
        delta=report["delta"],
        confidence=report["confidence"],
        selection_fraction=report["selection_runs"] / report["runs_per_side"],
    )
    report.update(
        epsilon_lower_bound=result.epsilon_lower_bound,
        membership_auc=result.auc,
        membership_advantage=result.max_advantage,
        advantage_at_threshold=result.advantage,
        advantage_upper_bound=advantage_upper_bound(report["claimed_epsilon"], report["delta"]),
        violation=result.epsilon_lower_bound > report["claimed_epsilon"],
        fpr=result.fpr,
        tpr=result.tpr,
        fpr_upper=result.fpr_upper,
        tpr_lower=result.tpr_lower,
        threshold=result.threshold,
    )


def render(reports: list[dict[str, Any]]) -> str:
    lines = [
        "# Privacy audit: empirical ε lower bounds (`benchmarks/audit_lower_bounds.py`)",
        "",
        "Two-phase membership-inference audit (seed 003, App. A.2) of dpvision's own "
        "training code on |D| = 100 digits, δ = 1/|D| = 0.01, bounds at 99.9 % confidence. "
        "Seed 003's Table 9 (|D| = 100 MNIST, LeNet, 500K models per side) is beside.",
        "",
        "| method | claimed ε | ε lower bound | AUC | max advantage | advantage bound "
        "| canary, chosen settings | runs/side (eval) | wall s | seed 003: ε LB / AUC / adv. |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        target = r["target_epsilon"]
        paper = PAPER.get(int(target)) if target and float(target).is_integer() else None
        paper_text = f"{paper[0]} / {paper[1]} / {paper[2]}" if paper else "–"
        settings = ", ".join(s.split(".", 1)[-1] for s in r["chosen_set"]) or "–"
        lines.append(
            f"| {r['method']} | {r['claimed_epsilon']:.3f} | **{r['epsilon_lower_bound']:.3f}** "
            f"| {r['membership_auc']:.3f} | {r['membership_advantage']:.3f} "
            f"| {r['advantage_upper_bound']:.3f} | {r['canary']}, {settings} "
            f"| {r['runs_per_side']} ({r['evaluation_runs']}) | {r['wall_seconds']:.0f} "
            f"| {paper_text} |"
        )
    violations = [r for r in reports if r["epsilon_lower_bound"] > r["claimed_epsilon"]]
    lines += [
        "",
        f"Violations (lower bound above the claimed ε): {len(violations)} of {len(reports)}.",
        "",
        "Claimed ε is the ledger's ε of one audited run (PLD for dp-sgd, the exact Gaussian "
        "accountant for dp-ls), at most the target. The lower bound of a Clopper-Pearson "
        "audit is capped by the number of runs (about ln(n/7.6) with n evaluation runs per "
        "side at 99.9 %), which is why it stays far below the claim at large ε here and in "
        "seed 003. AUC and max advantage (the best TPR − FPR of any threshold) are "
        "descriptive statistics of the evaluation runs, as in seed 003. Histograms of the "
        "canary losses: `results/audit/<method>-eps<E>.png`.",
        "",
        "Runtime on this 2-core CPU, one thread per audit: a dp-sgd audit (12 phase-I "
        "candidates × 100 models per side, then 1000 per side: 4,400 trainings of a 2,410-"
        "parameter MLP, 50 steps each) takes the wall seconds above, about 80 ms per "
        "training; a dp-ls audit (6 candidates) takes about 15 s. The default "
        "`dpvision audit` (dp-ls, ε = 3) took 20.6 s.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=["dp-sgd", "dp-ls"])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--phase1-runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    FOLDER.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if not args.report_only:
        for method in args.methods:
            for epsilon in args.epsilons:
                report = audit_one(method, epsilon, args)
                print(
                    f"{method} ε={epsilon:g}: lower bound {report['epsilon_lower_bound']:.3f} "
                    f"(claimed {report['claimed_epsilon']:.3f}), {report['wall_seconds']:.0f} s",
                    file=sys.stderr,
                )
    reports = []
    for path in sorted(FOLDER.glob("*.json")):
        report = json.loads(path.read_text())
        if args.report_only:  # the statistics are a function of the stored losses
            refresh_statistics(report)
            write_json_atomic(path, report)
        report.pop("losses_without", None)
        report.pop("losses_with", None)
        reports.append(report)
    reports.sort(key=lambda r: (r["method"] != "dp-sgd", r["method"], r["target_epsilon"]))
    summary = {
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "wall_seconds_this_invocation": time.perf_counter() - started,
        "audits": reports,
        "violations": sum(r["epsilon_lower_bound"] > r["claimed_epsilon"] for r in reports),
        "all_bounds_finite": all(math.isfinite(r["epsilon_lower_bound"]) for r in reports),
    }
    write_json_atomic(RESULTS / "audit_lower_bounds.json", summary)
    (RESULTS / "audit_lower_bounds.md").write_text(render(reports))
    print(render(reports))


if __name__ == "__main__":
    main()
