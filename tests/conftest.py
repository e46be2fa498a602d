"""The whole suite runs in a scratch home: nothing is read from or written to the user's
``~/.cache/dpvision`` (datasets, the feature cache) or anywhere else under ``$HOME``.

Set at import, before any test module is collected, so subprocesses the tests start inherit
it too. ``DPVISION_DATA`` is kept: it is where CI's copy of Fashion-MNIST lives.
"""

import os
import tempfile
from pathlib import Path

REAL_HOME = Path.home()
SCRATCH_HOME = Path(tempfile.mkdtemp(prefix="dpvision-tests-home-"))
os.environ["DPVISION_TESTS_REAL_HOME"] = str(REAL_HOME)  # for tests/test_isolation.py
os.environ["HOME"] = str(SCRATCH_HOME)
os.environ["DPVISION_CACHE"] = str(SCRATCH_HOME / ".cache" / "dpvision" / "features")
os.environ.setdefault("MPLCONFIGDIR", str(SCRATCH_HOME / ".config" / "matplotlib"))
