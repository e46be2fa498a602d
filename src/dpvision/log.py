"""Progress lines on stderr, the one voice of every command, through the ``dpvision`` logger.

Every message goes to ``logging.getLogger("dpvision")``. By default it is printed as
``[dpvision] message`` on stderr (looked up when printed, so redirections and captures see
it), whether or not stderr is a terminal; :func:`configure` sets how much is printed
(``-q``: warnings only, ``-v``: debug too) and adds a log file with timestamps. Programs
embedding dpvision can reconfigure the logger as any other.
"""

import logging
import sys

__all__ = ["configure", "logger", "progress", "say"]

logger = logging.getLogger("dpvision")


class _Stderr(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time of the message."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)


_console = _Stderr(logging.INFO)
_console.setFormatter(logging.Formatter("[dpvision] %(message)s"))
logger.addHandler(_console)
logger.setLevel(logging.DEBUG)
logger.propagate = False


def say(message: str, quiet: bool = False) -> None:
    """Logs ``message`` at INFO (printed as ``[dpvision] message``) unless ``quiet``."""
    if not quiet:
        logger.info(message)


def configure(verbosity: int = 0, log_file: str | None = None) -> None:
    """Console level: ``verbosity`` −1 warnings only, 0 progress (INFO), ≥ 1 debug. With
    ``log_file``, every message (DEBUG and up) is also appended there with a timestamp."""
    _console.setLevel(
        logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    )
    for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
        logger.removeHandler(handler)
        handler.close()
    if log_file:
        handler = logging.FileHandler(log_file, encoding="utf-8")
        handler.setLevel(logging.DEBUG)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)


def progress(done: int, total: int, seconds: float, first: int = 0) -> str:
    """``step 40/200, 12 s, about 48 s left``: the rate of the ``seconds`` since step
    ``first`` (where this process started), extrapolated."""
    left = seconds / (done - first) * (total - done) if done > first else float("nan")
    return f"step {done}/{total}, {_duration(seconds)}, about {_duration(left)} left"


def _duration(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "? s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
