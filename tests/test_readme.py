"""Every command in README.md runs, as written, and prints what the README shows.

``dpvision`` and ``python examples/...`` commands are run in a scratch folder that sees the
repository's ``configs/`` and ``examples/``, with an empty temporary ``HOME`` and feature
cache (only ``DPVISION_DATA``, where CI keeps Fashion-MNIST, comes from outside); commands
of one code block run in order in the same folder (``pretrain`` writes the encoder that
``train`` reads). A ``console`` block's
output must match the README line for line (timings excepted). The install, test and
documentation commands are what CI runs: they must appear verbatim in ``.ci/run``.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Commands CI runs itself (.ci/run), not this test.
CI_COMMANDS = ("python3.11 -m venv", "python -m pytest", "mkdocs build")
FULL = ("fashion_mnist", "fashion-mnist", "cifar10")  # minutes of ScatterNet and training
ACCURACY = re.compile(r"(accuracy) [0-9.]+ %")
TIMING = re.compile(r"^wall time [0-9.]+ s on \S+.*$")  # the device is checked elsewhere


def code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced code block."""
    return [
        (language, body.splitlines())
        for language, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    ]


def bash_commands(lines: list[str]) -> list[str]:
    """Commands of a bash block, continuation lines joined."""
    commands, current = [], ""
    for line in lines:
        current += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            if current and not current.startswith("#"):
                commands.append(current)
            current = ""
    return commands


def console_commands(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) of a console block."""
    out: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
    return out


def blocks() -> list[list[tuple[str, list[str] | None]]]:
    """The README's runnable blocks: each a list of (command, expected output or None)."""
    found = []
    for language, lines in code_blocks(README.read_text()):
        if language == "bash":
            found.append([(command, None) for command in bash_commands(lines)])
        elif language == "console":
            found.append([(command, list(out)) for command, out in console_commands(lines)])
    return [block for block in found if block]


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "dpvision":
        return [sys.executable, "-m", "dpvision", *words[1:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    raise AssertionError(f"README command of an unknown kind: {command}")


def _runnable() -> list[object]:
    params = []
    for block in blocks():
        commands = [command for command, _ in block]
        if any(command.startswith(CI_COMMANDS) for command in commands):
            continue
        full = any(word in command for command in commands for word in FULL)
        marks = [pytest.mark.full] if full else []
        params.append(pytest.param(block, id=commands[0][:60], marks=marks))
    return params


def test_the_readme_has_runnable_commands() -> None:
    assert len(_runnable()) >= 7


def test_install_test_and_docs_commands_are_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [c for block in blocks() for c, _ in block if c.startswith(CI_COMMANDS)]
    assert {c.split()[0] for c in commands} >= {"python3.11", "python", "mkdocs"}
    for command in commands:
        # The install line's pip part, the test command and the docs build, verbatim.
        essential = command.split("&& ")[-1] if command.startswith("python3.11") else command
        assert essential in ci, command


@pytest.mark.parametrize("block", _runnable())
def test_readme_command_runs(block: list[tuple[str, list[str] | None]], tmp_path: Path) -> None:
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    # A new user's machine: an empty home and feature cache, no downloads.
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "DPVISION_CACHE": str(cache), "DPVISION_OFFLINE": "1"}
    for command, expected in block:
        done = subprocess.run(
            _argv(command),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=1800,
            env=env,
        )
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
        if expected is not None:
            got = [_masked(line) for line in done.stdout.splitlines() if not TIMING.match(line)]
            want = [_masked(line) for line in expected if not TIMING.match(line)]
            assert got == want, command


def _masked(line: str) -> str:
    """A line with its accuracies masked: the noise is fresh every run (secret OS entropy),
    so a README's accuracy is one run's, not every run's."""
    return ACCURACY.sub(r"\1 … %", line)
