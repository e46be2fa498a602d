"""The examples run as a user would run them, and reach what their docstrings say."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_custom_model_learns_digits_within_its_budget():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_custom_model.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", result.stdout).group(1))
    epsilon = float(re.search(r"ε = ([0-9.]+)", result.stdout).group(1))
    # 0.92-0.95 over seeds 0-5; chance is 0.1.
    assert 0.85 < accuracy <= 1.0, result.stdout
    assert 0.99 * 3.0 <= epsilon <= 3.0, result.stdout
