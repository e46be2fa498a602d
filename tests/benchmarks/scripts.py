"""Loading a script of ``benchmarks/`` as a module, for its tests."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str, module_name: str | None = None) -> ModuleType:
    """``benchmarks/<name>.py``, executed as a new module (``module_name``: its name), with
    ``benchmarks/`` importable as it is when the script runs."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(module_name or name, BENCHMARKS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
