"""``benchmarks/audit_one_run.py`` as a module, for the audit tests: its users' loops, Dirac
canaries and planted bugs (patched into dpvision only inside its ``planted()`` and
``noise_scaled()`` blocks), so that the tests check exactly what the benchmark measures."""

import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "audit_one_run.py"
_SPEC = importlib.util.spec_from_file_location("audit_one_run", PATH)
assert _SPEC is not None
assert _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)
