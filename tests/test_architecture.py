"""The package's dependencies point one way: no import cycle, no import from a lower layer to
a higher one, and function-local imports only where they buy something.

``LAYERS`` is the contract, lowest first (README "Layout"). A module may import the modules
of its own package and of any *lower* layer, never a higher one nor another package of its
own layer. Function-level imports count as much as module-level ones (only ``if
TYPE_CHECKING:`` blocks are exempt): a cycle hidden in a function is still a cycle.
"""

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "dpvision"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "version"),
    ("fileio", "log", "distributed", "devices", "averaging", "profiling", "options", "seeds"),
    ("accounting",),
    ("mechanisms",),
    ("models", "data"),
    ("per_example",),
    ("features", "learners"),
    ("training", "recipes"),
    ("privacy_engine", "config"),
    ("runs",),
    ("audit", "report", "testing"),
    ("cli",),
    ("__main__",),
]
# The package face (``dpvision/__init__.py``) re-exports from above lazily; nothing imports it.
FACADE = "dpvision"
# A function-local import must say why it is not at the top of its module.
LOCAL_IMPORT_REASONS = ("optional dependency", "start-up time")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(SOURCE.rglob("*.py"))}


def _imports(name: str, path: Path) -> Iterator[tuple[str, ast.stmt, bool]]:
    """(imported dpvision name, the statement, whether it is inside a function)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    local: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for inner in ast.walk(node))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            local.update(id(inner) for inner in ast.walk(node) if inner is not node)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node, id(node) in local
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                yield f"{base}.{alias.name}", node, id(node) in local


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACADE


def _layer(unit: str) -> int:
    for index, units in enumerate(LAYERS):
        if unit in units:
            return index
    raise AssertionError(f"package dpvision.{unit} is in no layer of LAYERS: add it")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for target, _, _ in _imports(name, path):
            resolved = _resolve(target, modules) if target.startswith("dpvision") else None
            # A module's own package face (its __init__) is part of it, not a dependency.
            own_face = resolved != FACADE and name.startswith(f"{resolved}.")
            if resolved and resolved != name and not own_face:
                deps.add(resolved)
        graph[name] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import whose target is not in a strictly lower layer (nor the importer's package)."""
    found = []
    for name, deps in sorted(graph.items()):
        unit = _unit(name)
        for dep in sorted(deps):
            other = _unit(dep)
            if dep == FACADE:
                found.append(f"{name} -> {dep} (import the defining module, not the package face)")
            elif unit == FACADE or other == unit:
                continue
            elif _layer(other) >= _layer(unit):
                found.append(f"{name} (layer {_layer(unit)}) -> {dep} (layer {_layer(other)})")
    return found


def test_no_import_cycles() -> None:
    assert import_cycles(_graph()) == []


def test_no_upward_imports() -> None:
    assert upward_imports(_graph()) == []


def test_every_package_has_a_layer() -> None:
    for name in _modules():
        _layer(_unit(name)) if _unit(name) != FACADE else None


def _explained(lines: list[str], node: ast.stmt) -> bool:
    """Whether ``# local import: <reason>`` is on the import's lines or heads the run of
    import statements it belongs to."""
    block = [lines[i] for i in range(node.lineno - 1, node.end_lineno or node.lineno)]
    index = node.lineno - 2
    while index >= 0:
        text = lines[index].strip()
        block.append(text)
        if not (text.startswith(("from ", "import ", ")")) or text.endswith((",", "("))):
            break
        index -= 1
    return any(f"local import: {reason}" in " ".join(block) for reason in LOCAL_IMPORT_REASONS)


def _module_reason(lines: list[str]) -> bool:
    """Whether the module states the rule once, on a top-level line
    ``# local imports: <reason>`` (start-up time: the command-line and reporting modules
    import torch, matplotlib and friends inside the functions that use them)."""
    return any(
        line.startswith(f"# local imports: {reason}")
        for line in lines
        for reason in LOCAL_IMPORT_REASONS
    )


def test_local_imports_say_why() -> None:
    """A function-local import carries ``# local import: <reason>`` (one of
    LOCAL_IMPORT_REASONS) on its line or above the run of imports it belongs to, or its
    module states the reason once for all of them (``# local imports: <reason>``)."""
    unexplained = []
    for name, path in _modules().items():
        lines = path.read_text().splitlines()
        if _module_reason(lines):
            continue
        seen = set()
        for _, node, local in _imports(name, path):
            if not local or id(node) in seen:
                continue
            seen.add(id(node))
            if not _explained(lines, node):
                unexplained.append(f"{path.relative_to(SOURCE.parent)}:{node.lineno}")
    assert unexplained == [], f"{len(unexplained)} function-local imports without a reason"


def test_the_checks_catch_a_cycle_and_an_upward_import() -> None:
    graph = {
        "dpvision.accounting.a": {"dpvision.training.t"},
        "dpvision.training.t": {"dpvision.accounting.a"},
    }
    assert import_cycles(graph) == [["dpvision.accounting.a", "dpvision.training.t"]]
    assert upward_imports(graph) == [
        "dpvision.accounting.a (layer 2) -> dpvision.training.t (layer 7)"
    ]


@pytest.mark.parametrize("unit", [unit for units in LAYERS for unit in units])
def test_layers_name_real_packages(unit: str) -> None:
    assert any(_unit(name) == unit for name in _modules()), f"dpvision.{unit} does not exist"


@pytest.mark.parametrize("module", ["dpvision", "dpvision.cli", "dpvision.accounting"])
def test_start_up_imports_no_torch(module: str) -> None:
    """What the local imports marked "start-up time" buy: `dpvision --help` and the privacy
    calculator start without importing torch."""
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# --- size: modules and composition roots ----------------------------------------------------
MODULE_LINES = 500
ROOT_BODY_LINES = 60
# Composition roots: the functions that wire a whole command or call together (Opacus'
# make_private is a ~60-line body over _prepare_* helpers); a `run*` function of any module
# is one too.
ROOTS = {"make_private", "report", "sweep", "start", "pretrain", "pretrain_supervised", "train"}


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body after its docstring."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return 0 if not body else (node.end_lineno or node.lineno) - body[0].lineno + 1


def test_no_module_is_over_500_lines() -> None:
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MODULE_LINES
    }
    assert long == {}


def test_no_composition_root_is_over_60_lines() -> None:
    long = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            is_root = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (
                node.name.startswith("run") or node.name in ROOTS
            )
            if is_root and (lines := _body_lines(node)) > ROOT_BODY_LINES:
                long[f"{name}.{node.name}"] = lines
    assert long == {}
