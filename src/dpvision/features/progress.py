r"""A one-line progress display on stderr for long extractions (no dependency on tqdm).

The line is redrawn in place with ``\r`` at most every ``interval`` seconds, and only when
stderr is a terminal, so logs and captured output stay clean.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Counts processed items and shows ``desc: done/total (pct) elapsed, ETA`` on stderr.

    Use it as a context manager; the line is finished with a newline on exit.

    >>> with Progress(10, "demo", enabled=False) as bar:
    ...     bar.update(4)
    ...     bar.done
    4

    Args:
        total: Number of items expected.
        desc: Label shown before the counts.
        unit: Name of one item.
        enabled: ``False`` turns the display off entirely.
        stream: Where to draw; defaults to ``sys.stderr`` (read when the bar is created).
        interval: Minimum seconds between two redraws.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        unit: str = "images",
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 0.2,
    ) -> None:
        self.total = int(total)
        self.desc = desc
        self.unit = unit
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.interval = float(interval)
        self.done = 0
        self._start = time.monotonic()
        self._last_draw = -float("inf")
        self._drawn = False
        self.enabled = bool(enabled) and _is_tty(self.stream)

    def __enter__(self) -> Progress:
        """Starts the clock and draws the empty bar."""
        self._start = time.monotonic()
        self._draw(force=True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Draws the final state and ends the line."""
        self.close()

    def update(self, count: int) -> None:
        """Records ``count`` more processed items and redraws if ``interval`` has passed."""
        self.done += int(count)
        self._draw(force=self.done >= self.total)

    def close(self) -> None:
        """Draws the last state and moves to a new line (once)."""
        if self.enabled and self._drawn:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
        self.enabled = False

    def render(self) -> str:
        """The text of the progress line for the current state."""
        elapsed = time.monotonic() - self._start
        pct = 100.0 * self.done / self.total if self.total > 0 else 100.0
        text = f"{self.desc}: {self.done}/{self.total} {self.unit} ({pct:3.0f}%) {elapsed:.0f} s"
        if 0 < self.done < self.total:
            remaining = elapsed * (self.total - self.done) / self.done
            text += f", ETA {remaining:.0f} s"
        return text

    def _draw(self, *, force: bool = False) -> None:
        """Redraws the line in place if enabled and due."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < self.interval:
            return
        self._last_draw = now
        self.stream.write("\r" + self.render() + "\x1b[K")
        self.stream.flush()
        self._drawn = True


def _is_tty(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (False if it cannot tell)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
