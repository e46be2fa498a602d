"""Where the test suite's time goes: tables by kind and by file from pytest's JUnit XML.

    python -m pytest --junitxml=/tmp/default.xml          # the default suite
    python -m pytest -m slow --junitxml=/tmp/slow.xml     # the slow set
    python benchmarks/test_durations.py /tmp/default.xml [/tmp/slow.xml]

Prints Markdown (docs/development.md, "Where the time goes"). The times are each test's
setup, call and teardown, summed over pytest-xdist's workers: the wall time of a run with
``-n 2`` is about half their sum.
"""

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path

# Kind of each test file, by the first matching prefix of its path.
KINDS = [
    ("src/", "doctests"),
    ("tests/test_validation_first", "validation-first CLI cases (in-process)"),
    ("tests/test_readme", "docs, README and examples, end to end"),
    ("tests/test_docs_code", "docs, README and examples, end to end"),
    ("tests/test_examples", "docs, README and examples, end to end"),
    ("tests/test_opacus_examples", "docs, README and examples, end to end"),
    ("tests/test_configs", "configs: load, validate, a few steps"),
    ("tests/accounting/", "accounting (property tests)"),
    ("tests/test_cli_fuzz", "property tests of the CLI (fuzzing)"),
    ("tests/test_threat_model", "privacy: neighbouring datasets, adversaries, refusals"),
    ("tests/test_released_outputs", "privacy: neighbouring datasets, adversaries, refusals"),
    ("tests/test_sensitivity", "privacy: neighbouring datasets, adversaries, refusals"),
    ("tests/test_privacy_engine", "privacy: neighbouring datasets, adversaries, refusals"),
    ("tests/learners/test_privacy", "privacy: neighbouring datasets, adversaries, refusals"),
    ("tests/mechanisms/", "privacy: neighbouring datasets, adversaries, refusals"),
    ("tests/distributed/", "privacy: neighbouring datasets, adversaries, refusals"),
    ("tests/audit/", "the auditor"),
    ("tests/test_", "CLI end-to-end runs and their outputs"),
    ("tests/training/test_train_cli", "CLI end-to-end runs and their outputs"),
    ("tests/", "trainings and units (training, features, learners, models, data)"),
    ("", "other"),
]


def _path(case: ET.Element) -> str:
    parts = (case.get("classname") or case.get("name") or "").split(".")
    modules = [p for p in parts if not p[:1].isupper()]
    return "/".join(modules) + ".py"


def load(junit: Path) -> list[tuple[str, str, float]]:
    """(file, test name, seconds) of every test case in a JUnit XML report."""
    root = ET.parse(junit).getroot()
    cases = root.iter("testcase")
    return [(_path(c), c.get("name") or "", float(c.get("time") or 0)) for c in cases]


def kind(path: str) -> str:
    return next(label for prefix, label in KINDS if path.startswith(prefix))


def table(cases: list[tuple[str, str, float]], key, title: str, top: int | None = None) -> str:
    seconds: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for path, _, time in cases:
        seconds[key(path)] += time
        counts[key(path)] += 1
    total = sum(seconds.values())
    lines = [f"| {title} | tests | seconds | share |", "|---|---:|---:|---:|"]
    for name, time in seconds.most_common(top):
        lines.append(f"| {name} | {counts[name]} | {time:.0f} | {100 * time / total:.0f} % |")
    lines.append(f"| **all** | {len(cases)} | {total:.0f} | 100 % |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JUnit XML files")
    parser.add_argument("--top", type=int, default=15, help="files in the by-file table")
    args = parser.parse_args()
    for report in args.reports:
        cases = load(report)
        print(f"### {report.name}\n")
        print(table(cases, kind, "kind") + "\n")
        print(table(cases, lambda p: f"`{p}`", "file", top=args.top) + "\n")
        longest = sorted(cases, key=lambda c: -c[2])[:10]
        print("| longest tests | seconds |\n|---|---:|")
        for path, name, time in longest:
            print(f"| `{path}::{name}` | {time:.1f} |")
        print()


if __name__ == "__main__":
    main()
