"""Progress lines on stderr, the one voice of every command."""

import sys


def say(message: str, quiet: bool = False) -> None:
    """Prints ``[dpvision] message`` on stderr (flushed) unless ``quiet``."""
    if not quiet:
        print(f"[dpvision] {message}", file=sys.stderr, flush=True)
