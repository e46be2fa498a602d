"""The command line: the DESIGN.md contract, readable tables, one-line errors with exit 2."""

import json
import subprocess
import sys

import pytest

from dpvision.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


EPSILON_ARGS = (
    "privacy",
    "epsilon",
    "--noise-multiplier",
    "4",
    "--sample-rate",
    "0.02048",
    "--steps",
    "10000",
    "--delta",
    "1e-5",
)


def test_epsilon_json_rdp_anchor(capsys):
    code, out, _ = _run(capsys, *EPSILON_ARGS, "--accountant", "rdp", "--json")
    result = json.loads(out)
    assert code == 0
    assert result["accountant"] == "rdp"
    assert result["delta"] == 1e-5
    assert 2.27535 * (1 - 1e-3) <= result["epsilon"] <= 2.27535


def test_epsilon_json_pld_anchor(capsys):
    _, out, _ = _run(capsys, *EPSILON_ARGS, "--accountant", "pld", "--json")
    assert json.loads(out)["epsilon"] == pytest.approx(2.09245, rel=1e-3)


def test_epsilon_table_lists_all_accountants(capsys):
    code, out, _ = _run(capsys, *EPSILON_ARGS)
    assert code == 0
    for name in ("pld", "rdp", "gaussian", "classic-rdp"):
        assert name in out
    assert "2.09246" in out
    assert "2.64603" in out
    assert "n/a" in out


def test_noise_then_epsilon_round_trip(capsys):
    _, out, _ = _run(
        capsys,
        "privacy",
        "noise",
        "--epsilon",
        "3",
        "--delta",
        "1e-5",
        "--sample-rate",
        "0.02",
        "--steps",
        "2000",
        "--json",
    )
    noise = json.loads(out)
    assert noise["accountant"] == "pld"
    assert noise["epsilon"] <= 3
    _, out, _ = _run(
        capsys,
        "privacy",
        "epsilon",
        "--noise-multiplier",
        repr(noise["noise_multiplier"]),
        "--sample-rate",
        "0.02",
        "--steps",
        "2000",
        "--delta",
        "1e-5",
        "--accountant",
        "pld",
        "--json",
    )
    assert 0.99 * 3 <= json.loads(out)["epsilon"] <= 3


def test_noise_full_batch_defaults_to_exact_gaussian(capsys):
    _, out, _ = _run(
        capsys,
        "privacy",
        "noise",
        "--epsilon",
        "1",
        "--delta",
        "1e-5",
        "--sample-rate",
        "1",
        "--steps",
        "10",
        "--json",
    )
    assert json.loads(out)["accountant"] == "gaussian"


def test_table_row_explains_an_accountant_that_cannot_reach_the_target(capsys):
    # PLD and exact GDP reach ε = 0.001 here; classic RDP (orders ≤ 4096) cannot.
    code, _out, _ = _run(
        capsys,
        "privacy",
        "noise",
        "--epsilon",
        "0.001",
        "--delta",
        "1e-10",
        "--sample-rate",
        "1",
        "--steps",
        "100000",
        "--accountant",
        "classic-rdp",
    )
    assert code == 2


def test_noise_table_shows_sigma_rounded_up(capsys):
    code, out, _ = _run(
        capsys,
        "privacy",
        "noise",
        "--epsilon",
        "3",
        "--delta",
        "1e-5",
        "--sample-rate",
        "1",
        "--steps",
        "100",
    )
    assert code == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    for _sigma, epsilon in rows.values():
        assert float(epsilon) <= 3.0


def test_steps_json(capsys):
    _, out, _ = _run(
        capsys,
        "privacy",
        "steps",
        "--noise-multiplier",
        "2.15",
        "--epsilon",
        "3",
        "--delta",
        "1e-5",
        "--sample-rate",
        str(2048 / 60000),
        "--accountant",
        "classic-rdp",
        "--json",
    )
    result = json.loads(out)
    assert result["steps"] == 1158
    assert result["epsilon"] <= 3


BAD_INPUTS = [
    (
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "0",
        "--sample-rate",
        "0.1",
        "--steps",
        "10",
        "--delta",
        "1e-5",
    ),
    (
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "-2",
        "--sample-rate",
        "0.1",
        "--steps",
        "10",
        "--delta",
        "1e-5",
    ),
    (
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "1",
        "--sample-rate",
        "0",
        "--steps",
        "10",
        "--delta",
        "1e-5",
    ),
    (
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "1",
        "--sample-rate",
        "1.01",
        "--steps",
        "10",
        "--delta",
        "1e-5",
    ),
    (
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "1",
        "--sample-rate",
        "0.1",
        "--steps",
        "10",
        "--delta",
        "0",
    ),
    (
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "1",
        "--sample-rate",
        "0.1",
        "--steps",
        "10",
        "--delta",
        "1",
    ),
    (
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "1",
        "--sample-rate",
        "0.1",
        "--steps",
        "0",
        "--delta",
        "1e-5",
    ),
    (
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "1",
        "--sample-rate",
        "0.1",
        "--steps",
        "1.5",
        "--delta",
        "1e-5",
    ),
    (
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "abc",
        "--sample-rate",
        "0.1",
        "--steps",
        "1",
        "--delta",
        "1e-5",
    ),
    (
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "1",
        "--sample-rate",
        "0.1",
        "--steps",
        "1",
        "--delta",
        "1e-5",
        "--accountant",
        "prv",
    ),
    (
        "privacy",
        "noise",
        "--epsilon",
        "0.001",
        "--delta",
        "1e-10",
        "--sample-rate",
        "1",
        "--steps",
        "100000",
        "--json",
    ),
    (
        "privacy",
        "noise",
        "--epsilon",
        "1e-4",
        "--delta",
        "1e-10",
        "--sample-rate",
        "1",
        "--steps",
        "1000000",
    ),
    (
        "privacy",
        "noise",
        "--epsilon",
        "0",
        "--delta",
        "1e-5",
        "--sample-rate",
        "0.1",
        "--steps",
        "10",
    ),
    (
        "privacy",
        "noise",
        "--epsilon",
        "nan",
        "--delta",
        "1e-5",
        "--sample-rate",
        "0.1",
        "--steps",
        "10",
        "--json",
    ),
    ("privacy",),
    (),
]


@pytest.mark.parametrize("argv", BAD_INPUTS, ids=lambda a: " ".join(a) or "no-arguments")
def test_bad_input_is_one_line_and_exit_2(argv):
    # Run as a real process: exit code and stderr exactly as a user sees them.
    proc = subprocess.run(
        [sys.executable, "-m", "dpvision", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    # Progress lines ("[dpvision] searching …") may come first; the error is one line.
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("[dpvision]")]
    assert len(lines) == 1, proc.stderr
    assert "error" in lines[0]


def test_unreachable_target_message_says_what_to_do():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpvision",
            "privacy",
            "noise",
            "--epsilon",
            "0.001",
            "--delta",
            "1e-10",
            "--sample-rate",
            "1",
            "--steps",
            "100000",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no noise multiplier up to 10000" in proc.stderr
    assert "raise the target" in proc.stderr


def test_console_script_is_installed():
    proc = subprocess.run(["dpvision", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.startswith("dpvision ")
