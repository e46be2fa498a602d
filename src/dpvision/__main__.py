"""Entry point for ``python -m dpvision``.

Under ``torchrun`` (``WORLD_SIZE`` > 1) the process ends with :func:`os._exit` once its
output is flushed and the process group is gone: gloo's worker threads were seen to abort
the interpreter's normal exit after all work was done and written ("terminate called
without an active exception", SIGABRT, about one two-process run in twenty), which torchrun
reports as a failed run.
"""

import logging
import os
import sys

from dpvision.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1") or "1") > 1:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
raise SystemExit(code)
