"""The accounting package must stay usable without torch."""

import subprocess
import sys


def test_accounting_does_not_import_torch():
    code = (
        "import sys, dpvision.accounting as a; "
        "a.compute_epsilon(a.gaussian_event(noise_multiplier=1.0), delta=1e-5); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
