"""Errors that zerorun reports to the user as one clear line instead of a traceback."""


class ZerorunError(Exception):
    """A problem with the user's input or environment, reported as one line.

    ``exit_code`` is what the CLI exits with: 2 for bad input (recipe, hostfile, flags, model module,
    checkpoint), 1 for a job that failed while running.
    """

    exit_code = 2


class JobFailed(ZerorunError):
    """A launched job ended with a failure (a rank crashed, a node was lost, or it was interrupted)."""

    exit_code = 1
