"""Errors that zerorun reports to the user as one clear line instead of a traceback, and the bound of the integers
it takes (:data:`INT64_MAX`).

Note [Integer bounds]: Python's integers have no bound, but every integer zerorun takes ends up in a C integer
(torch's tensors and ``range``-like loops in C, the SLURM and OS limits) or a JSON number that other readers
hold as a 64-bit value; ``train.steps: 99999999999999999999999`` was accepted, rounded, and ran forever.
Whatever a field's own bound, no integer is taken beyond :data:`INT64_MAX` (the recipe: ``Strict``'s validator
in recipe/values.py; the CLI: ``max=`` of every integer option), and the message names the field or flag.
"""

#: the largest integer zerorun takes anywhere (a signed 64-bit integer's largest).
INT64_MAX = 2**63 - 1


class ZerorunError(Exception):
    """A problem with the user's input or environment, reported as one line.

    ``exit_code`` is what the CLI exits with: 2 for bad input (recipe, hostfile, flags, model module,
    checkpoint), 1 for a job that failed while running.
    """

    exit_code = 2


class JobFailed(ZerorunError):
    """A launched job ended with a failure (a rank crashed, a node was lost, or it was interrupted)."""

    exit_code = 1
