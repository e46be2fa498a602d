"""Every code block of the documentation (``docs/**/*.md``) runs, as the README's do
(``tests/test_readme.py``, whose helpers this test reuses).

* **Python blocks** of one page run in order in one fresh interpreter, as a reader pastes
  them into one session: a later block may use what an earlier one defined. Each block is
  otherwise complete (its imports and its data).
* **Shell blocks** (``bash``, ``console``): every ``dpvision`` command parses, and a
  ``train`` command's config resolves and validates (``--config``, ``--set``), in the
  default suite; the command then runs, as written, in a scratch folder that sees
  ``configs/`` and ``examples/``, with an empty ``HOME`` and feature cache. A ``console``
  block's output of ``dpvision privacy`` (deterministic) must match line for line; a shown
  ``dpvision: error:`` line must be the command's error. Commands that take a minute run
  under ``-m slow``, the full-size ones (minutes each) under ``-m full``; a
  command the README also shows is run by ``tests/test_readme.py``.
* What cannot run here is skipped with its reason in :data:`CANNOT_RUN` (shown by
  ``pytest -rs``); a rule that no longer matches any block fails
  :func:`test_every_exception_is_used`, so the list cannot go stale silently.
"""

import glob
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from test_readme import (
    _argv,
    bash_commands,
    blocks,
    code_blocks,
    console_commands,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# (pattern searched in a block's text, why it cannot run here). First match wins.
CANNOT_RUN: list[tuple[str, str]] = [
    (r"pip install|python3\.11 -m venv|python -m pytest|mkdocs", "what CI runs (.ci/run)"),
    (r"--device cuda|torchrun|-m gpu|scripts/gpu-check", "needs a GPU or several processes"),
    (r"\btimm\b|timm:|torchvision:", "needs the models extra and its own environment"),
    (r"cifar10|cifar100|seed003/", "CIFAR runs take minutes to hours: benchmarks/cifar10.py"),
    (r"benchmarks/", "a benchmark: minutes; its results are in docs/results"),
    (r"run\.toml|photos/", "a placeholder for the reader's own files"),
]
# Full-size runs (Fashion-MNIST, audits, searches), minutes each on 2 cores: under -m full
# (the parse check stays default); other runs of a minute or less: under -m slow.
FULL = r"fashion-mnist|fashion_mnist|--runs \d{4}|dpvision audit(?! --one-run\s*$)|dpvision tune"
SLOW = r"--method dp-sgd"


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "results" not in p.relative_to(DOCS).parts)


def _reason(text: str) -> str | None:
    code = "\n".join(line.partition("#")[0] for line in text.splitlines())  # not comments
    return next((why for pattern, why in CANNOT_RUN if re.search(pattern, code)), None)


def python_pages() -> list[object]:
    params = []
    for page in pages():
        sources = [
            "\n".join(lines)
            for language, lines in code_blocks(page.read_text())
            if language == "python"
        ]
        if not sources:
            continue
        name = str(page.relative_to(DOCS))
        why = next(filter(None, map(_reason, sources)), None)
        marks = [pytest.mark.skip(reason=f"{name}: {why}")] if why else []
        params.append(pytest.param(sources, id=name, marks=marks))
    return params


def shell_blocks() -> list[tuple[str, list[tuple[str, list[str] | None]]]]:
    """(page, [(command, expected output or None)]) of every bash or console block."""
    found = []
    for page in pages():
        name = str(page.relative_to(DOCS))
        for language, lines in code_blocks(page.read_text()):
            if language == "bash" or (language == "console" and not _prompted(lines)):
                commands = [(command, None) for command in bash_commands(lines)]
            elif language == "console":
                commands = [(command, list(out)) for command, out in console_commands(lines)]
            else:
                continue
            if commands:
                found.append((name, commands))
    return found


def _prompted(lines: list[str]) -> bool:
    return any(line.startswith("$ ") for line in lines)


def _readme_commands() -> set[str]:
    return {command for block in blocks() for command, _ in block}


def runnable_shell_blocks() -> list[object]:
    params, readme = [], _readme_commands()
    for name, commands in shell_blocks():
        text = "\n".join(command for command, _ in commands)
        ident = f"{name}: {commands[0][0][:50]}"
        shows_error = any(
            line.startswith("dpvision: error:") for _, out in commands for line in out or []
        )
        why = None if shows_error else _reason(text)  # an error shown needs no data to show
        if why is None and all(command in readme for command, _ in commands):
            why = "the README shows the same commands: tests/test_readme.py runs them"
        if why is not None:
            marks = [pytest.mark.skip(reason=f"{name}: {why}")]
        elif re.search(FULL, text):
            marks = [pytest.mark.full]
        elif re.search(SLOW, text):
            marks = [pytest.mark.slow]
        else:
            marks = []
        params.append(pytest.param(commands, id=ident, marks=marks))
    return params


def dpvision_commands() -> list[object]:
    params = []
    for name, commands in shell_blocks():
        page = [command for _, block in shell_blocks() if _ == name for command, _ in block]
        written = sorted(
            words[i + 1]
            for words in (shlex.split(c, comments=True) for c in page)
            for i, word in enumerate(words[:-1])
            if word in ("--out", "--save")
        )
        for command, _ in commands:
            if not command.startswith("dpvision "):
                continue
            why = _reason(command)
            marks = [pytest.mark.skip(reason=f"{name}: {why}")] if why else []
            params.append(pytest.param(command, written, id=f"{name}: {command[:60]}", marks=marks))
    return params


def _env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    cache = str(tmp_path / "cache")
    return {**os.environ, "HOME": str(home), "DPVISION_CACHE": cache, "DPVISION_OFFLINE": "1"}


def _scratch(tmp_path: Path) -> None:
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)


@pytest.mark.parametrize("sources", python_pages())
def test_python_blocks_run(sources: list[str], tmp_path: Path) -> None:
    _scratch(tmp_path)
    script = tmp_path / "blocks.py"
    script.write_text(
        "import sys\nnamespace = {'__name__': '__main__'}\n"
        f"for number, source in enumerate({sources!r}, 1):\n"
        "    exec(compile(source, f'python block {number}', 'exec'), namespace)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(("command", "written"), dpvision_commands())
def test_dpvision_commands_parse(
    command: str, written: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every flag of every ``dpvision`` command in the docs exists; a ``train`` command's
    options (``--config``, ``--set``) resolve into a valid config. Nothing runs; the files
    the page's commands write (``--out``, ``--save``) stand in as empty files."""
    from dpvision.cli import build_parser
    from dpvision.cli.arguments import run_flags
    from dpvision.config import resolve

    _scratch(tmp_path)
    for name in written:
        if name.endswith("/"):
            (tmp_path / name).mkdir(exist_ok=True)
        else:
            (tmp_path / name).touch()
    monkeypatch.chdir(tmp_path)
    words = [
        match
        for word in shlex.split(command, comments=True)[1:]
        for match in (sorted(glob.glob(word)) if "*" in word else [word])
    ]
    args = build_parser().parse_args(words)
    if words[0] == "train":
        sets = list(args.set)
        if args.phase2_fraction is not None:
            sets.append(f"learner.phase2_fraction={args.phase2_fraction!r}")
        config = resolve(args.config, run_flags(args), sets)
        if config.method in ("dp-sgd", "dp-randp"):
            assert config.dpsgd is not None  # the learner options validate


_FOLDERS: dict[str, Path] = {}


@pytest.mark.parametrize("commands", runnable_shell_blocks())
def test_shell_blocks_run(
    commands: list[tuple[str, list[str] | None]],
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # The blocks of one page share a folder, in order: a page's pretrain writes the encoder
    # that its next block's train reads.
    page = request.node.callspec.id.split(": ")[0]
    if page not in _FOLDERS:
        _FOLDERS[page] = tmp_path_factory.mktemp("docs-page")
        _scratch(_FOLDERS[page])
    tmp_path = _FOLDERS[page]
    env = _env(tmp_path)
    for command, expected in commands:
        done = subprocess.run(
            _argv(command.split(" #")[0].strip()),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=1800,
            env=env,
        )
        errors = [line for line in (expected or []) if line.startswith("dpvision: error:")]
        if errors:
            assert done.returncode == 2, command
            assert done.stderr.strip().splitlines()[-1] == errors[0], command
            continue
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
        if expected is not None and command.startswith("dpvision privacy"):
            got, want = done.stdout.splitlines(), expected
            if command.endswith("--json"):  # the last digits of a calibrated σ may differ
                got, want = json.loads(got[0]), json.loads(want[0])
                numbers = [key for key, value in want.items() if isinstance(value, float)]
                for key in numbers:
                    assert got.pop(key) == pytest.approx(want.pop(key), rel=1e-9), key
            assert got == want, command


def test_every_exception_is_used() -> None:
    texts = ["\n".join(lines) for page in pages() for _, lines in code_blocks(page.read_text())]
    for pattern, why in CANNOT_RUN:
        assert any(re.search(pattern, text) for text in texts), f"unused: {pattern} ({why})"


def test_the_docs_have_blocks_of_each_kind() -> None:
    assert len(python_pages()) >= 8
    assert len(dpvision_commands()) >= 30
    assert len(runnable_shell_blocks()) >= 25
