"""Errors that dpvision reports to its users.

Every user-facing mistake (bad parameter, unreachable privacy target, malformed file) is a
:class:`DPVisionError`. The command line turns it into one line on stderr and exit code 2;
library callers can catch it like the ``ValueError`` it derives from.
"""


class DPVisionError(ValueError):
    """A problem with the user's input, described in one line that says what to do."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run, with what it leaves to resume from in words (the command line
    prints ``dpvision: interrupted; <that>`` and exits with 130)."""


class PrivacyWarning(UserWarning):
    """A use of dpvision whose privacy guarantee is not what it seems (e.g. a scikit-learn
    search over private data, which no ledger accounts for)."""
