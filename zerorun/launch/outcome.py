"""How a job ended: :class:`Outcome`, the one result type of the supervisor (launch/supervisor.py), of
:func:`zerorun.launch.run_job` and of a job with restarts (launch/restart.py)."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from zerorun.errors import JobFailed


def describe_exit(code: int) -> str:
    """``exit code 7`` or ``killed by SIGSEGV`` for a process exit status (negative: signal)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class Outcome:
    """How a job ended: ``status`` ok | failed | interrupted; the ``exit_code`` zerorun exits with (0, 1 a
    failure, 2 bad input found by a rank or the model check, 130/143 interrupted); for a failure the failing
    ``rank`` (or None) and its ``host`` when known, and a one-line ``message`` (empty when ok; from
    :func:`~zerorun.launch.run_job` it names the rank and host and the logs); ``elapsed_s``, seconds from the
    nodes' start to the end; ``lost``: the failure is ``host``'s node lost for a reason of its own (SSH
    connection lost, watcher or agent killed: Note [Lost nodes] in launch/restart.py). Set by ``run_job``:
    ``run_dir`` (the run folder) and ``state`` (the job's :class:`~zerorun.telemetry.state.JobState`)."""

    status: str
    exit_code: int
    rank: int | None = None
    host: str | None = None
    message: str = ""
    elapsed_s: float = 0.0
    lost: bool = False
    run_dir: str = ""
    state: object = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def error(self) -> JobFailed:
        """The failure as a :class:`JobFailed` carrying ``exit_code`` (for the CLI's one line)."""
        err = JobFailed(self.message)
        err.exit_code = self.exit_code
        return err
