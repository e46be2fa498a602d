"""What a benchmark's page records of the code that made it."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """HEAD, with ``+local`` when ``src/`` differs from it (what ran is then not what was
    committed)."""
    head = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True)
    return (head or "unknown") + ("+local" if dirty.stdout.strip() else "")
