"""Progress lines on stderr, the one voice of every command, through the ``dpvision`` logger.

Every message goes to ``logging.getLogger("dpvision")``. By default it is printed as
``[dpvision] message`` on stderr (looked up when printed, so redirections and captures see
it), whether or not stderr is a terminal; :func:`configure` sets how much is printed
(``-q``: warnings only, ``-v``: debug too) and adds a log file with timestamps. Programs
embedding dpvision can reconfigure the logger as any other.
"""

import logging
import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["LOG_INTERVAL", "Progress", "configure", "logger", "progress", "remaining", "say"]

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


def remaining(done: float, total: float, seconds: float) -> str:
    """``about 4.2 min left`` after ``seconds`` for ``done`` of ``total`` (the rate so far,
    extrapolated); ``""`` before anything is done."""
    if done <= 0 or total <= done:
        return ""
    return f"about {_duration(seconds / done * (total - done))} left"


LOG_INTERVAL = 10.0
"""Seconds between two plain progress lines where stderr is not a terminal (a log file, a
pipe, CI): tqdm redraws in place, which a log cannot show, so a line is logged instead."""


class Progress:
    r"""Progress of one long phase on stderr: ``desc: done/total unit (pct) 12 s, about
    48 s left``.

    On a terminal the line is redrawn in place (``\r``) at most every ``interval``
    seconds. Elsewhere (a log file, ``2>&1 | tee``, CI) a plain line goes through the
    ``dpvision`` logger at the start of the phase, then at most every ``log_interval``
    seconds and at its end, as scikit-learn's and Opacus's
    progress is logged: the first line comes when the phase starts, and ``-q`` silences it
    (on a terminal too).

    Use it as a context manager; the last state is shown on exit.

    >>> with Progress(10, "demo", enabled=False) as bar:
    ...     bar.update(4)
    ...     bar.done
    4

    Args:
        total: Amount of work expected (items, or any additive measure of work).
        desc: Label shown before the counts.
        unit: Name of one item.
        enabled: ``False`` turns the display off entirely.
        stream: Where to draw; defaults to ``sys.stderr`` (read when the bar is created).
            A stream that is not a terminal gets the plain lines written to it directly.
        interval: Minimum seconds between two redraws on a terminal.
        log_interval: Minimum seconds between two plain lines (default
            :data:`LOG_INTERVAL`).
        counts: ``False`` shows the percentage only (``total`` is then a measure of work,
            such as an estimate of floating-point operations, not a count to print).
        expected_seconds: an estimate of the whole phase's time, which the time left is
            taken from until a quarter of the work is done (the rate of the first, often
            cheaper, steps extrapolates badly), unless the phase is already slower than
            the estimate: then the rate since the start.

    Privacy:
        Prints the counts it is given and the time: callers pass public quantities only
        (the number of runs of an audit or a sweep, batches of public size, the work of a
        fit of public shape), never a statistic of private data.
    """

    open_bars = 0
    """Bars shown at the moment (a phase inside another's shows its own only when long)."""

    def __init__(
        self,
        total: float,
        desc: str,
        *,
        unit: str = "images",
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 0.2,
        log_interval: float | None = None,
        counts: bool = True,
        expected_seconds: float | None = None,
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.counts = counts
        self.expected_seconds = expected_seconds
        self._stream = stream
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.interval = float(interval)
        self.log_interval = float(LOG_INTERVAL if log_interval is None else log_interval)
        self.done: float = 0
        self._start = time.monotonic()
        self._last_draw = -float("inf")
        self._drawn = False
        self._logged = False
        self._logged_done: float = -1
        self._counted = False
        self._first: tuple[float, float] | None = None  # (seconds, done) at the first update
        self._tty = _is_tty(self.stream)
        shown = _console.level <= logging.INFO or (stream is not None and not self._tty)
        self.enabled = bool(enabled) and shown

    def __enter__(self) -> "Progress":
        """Starts the clock and shows the empty bar (the phase's first line)."""
        self._start = time.monotonic()
        self._first = None
        if self.enabled:
            Progress.open_bars += 1
            self._counted = True
        self._draw(force=True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Shows the final state and ends the line."""
        self.close()

    def update(self, count: float) -> None:
        """Records ``count`` more work done and shows it if its interval has passed."""
        if self._first is None and count > 0:  # the first item carries the phase's set-up
            self._first = (time.monotonic() - self._start, self.done + count)
        self.done += count
        self._draw(force=self._tty and self.done >= self.total)

    def close(self) -> None:
        """Shows the last state (once): a terminal's line ends with a newline, a log gets a
        last line when it had one before."""
        if self.enabled and self._tty and self._drawn:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
        if self._counted:
            Progress.open_bars -= 1
            self._counted = False
        if (
            self.enabled
            and not self._tty
            and self._logged
            and self._logged_done != self.done  # the last state is not shown yet: a log
            # that said "0/240" and nothing more would read as a phase that stalled
        ):
            self._draw(force=True)
        self.enabled = False

    def render(self) -> str:
        """The text of the progress line for the current state."""
        elapsed = time.monotonic() - self._start
        pct = 100.0 * self.done / self.total if self.total > 0 else 100.0
        if self.counts:
            text = f"{self.desc}: {self.done:g}/{self.total:g} {self.unit} ({pct:3.0f}%) "
        else:
            text = f"{self.desc}: {min(pct, 100.0):3.0f}%, "
        text += _duration(elapsed)
        left = ""
        if self._first is not None and self.done > self._first[1]:
            # The rate since the first item: its time holds the set-up (loading, the first
            # compilation), which extrapolated alone said "9 min left" of a 27 s phase.
            seconds, done = self._first
            left = remaining(self.done - done, self.total - done, elapsed - seconds)
        fraction = self.done / self.total if self.total > 0 else 1.0
        if self.expected_seconds is not None and fraction < 0.25:
            left = self._left_by_estimate(elapsed, fraction)
        return f"{text}, {left}" if left else text

    def _left_by_estimate(self, elapsed: float, fraction: float) -> str:
        """The time left from ``expected_seconds`` while the phase keeps to it; once it has
        taken longer than the estimate gives the work done (with a tenth of the estimate
        as slack for its set-up), the rate since the start, extrapolated ("5 s left" of a
        DP-LS fit that took 32 s: its solves were slower than the estimate's model)."""
        expected = float(self.expected_seconds or 0.0)
        if elapsed <= expected * (fraction + 0.1):
            return f"about {_duration(expected * (1 - fraction))} left"
        if fraction <= 0:
            return f"longer than the estimated {_duration(expected)}"
        return f"about {_duration(elapsed / fraction * (1 - fraction))} left"

    def _draw(self, *, force: bool = False) -> None:
        """Redraws the line in place (terminal) or logs a line, if enabled and due."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < (
            self.interval if self._tty else self.log_interval
        ):
            return
        self._last_draw = now
        if self._tty:
            self.stream.write("\r" + self.render() + "\x1b[K")
            self.stream.flush()
            self._drawn = True
        elif self._stream is not None:
            print(f"[dpvision] {self.render()}", file=self._stream, flush=True)
        else:
            logger.info(self.render())
        self._logged, self._logged_done = not self._tty, self.done


def _is_tty(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (False if it cannot tell)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _duration(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "? s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
