"""The progress display of long extractions: :class:`dpvision.log.Progress` (no dependency
on tqdm), re-exported here where the feature extractors and their callers import it.

On a terminal the line is redrawn in place; elsewhere (a log, a pipe, CI) a plain line is
logged when the phase starts and then at most every :data:`dpvision.log.LOG_INTERVAL`
seconds, so a captured run shows progress too.
"""

from dpvision.log import LOG_INTERVAL, Progress

__all__ = ["LOG_INTERVAL", "Progress"]
