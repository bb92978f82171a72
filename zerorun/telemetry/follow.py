"""Following a run folder that another process writes (``zerorun attach``: a SLURM batch job's ``zerorun
train``): its ``metrics.jsonl`` events and ``output.log`` lines are fed, as they are appended, to the same
views the launcher uses (the live dashboard or the plain lines, telemetry/dashboard.py ``open_view``).

Note [Following a run]: the files are read from the start, then polled (``poll_s``, 0.5 s by default): only
complete lines are taken (a line being written is read on the next poll). ``output.log``'s lines carry the
node they came from (``[node N] ...``, console.RunRecorder), which the view's log panel shows as the
launcher's own view does. Whether the job still runs is asked of ``running()`` every ``check_s`` seconds
(it may be a ``scontrol`` call); once it says no, the files are read to their end and following stops.
"""

from __future__ import annotations

import os
import re
import time
from typing import Callable

from zerorun import runfolder
from zerorun.telemetry.events import from_json
from zerorun.telemetry.jobfiles import run_header
from zerorun.telemetry.state import JobState

_NODE_LINE = re.compile(r"^\[node (-?\d+)\] ?(.*)$")


class Tail:
    """The complete lines appended to ``path`` since the last :meth:`read` (the file may not exist yet)."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def read(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in lines]


def new_state(run_dir: str, started: float | None = None) -> JobState:
    """A :class:`JobState` for a run that has not ended: name, stage, precision and steps from the run folder's
    ``recipe.yaml`` (:func:`~zerorun.telemetry.jobfiles.run_header`), started at ``started`` (Unix s; default
    now)."""
    return JobState(**run_header(run_dir), started=started)


def follow(run_dir: str, view, running: Callable[[], bool], *, poll_s: float = 0.5, check_s: float = 2.0,
           sleep: Callable[[float], None] = time.sleep) -> None:
    """Feed ``run_dir``'s events and lines to ``view`` (``event``/``line``) until ``running()`` says the job
    ended, then read the files to their end (Note [Following a run]). The view is not closed here.

    Raises:
        KeyboardInterrupt: Ctrl-C (the job goes on; the caller says so).
    """
    metrics, log = Tail(os.path.join(run_dir, runfolder.METRICS)), Tail(os.path.join(run_dir, runfolder.OUTPUT))

    def drain() -> None:
        for text in metrics.read():
            e = from_json(text)
            if e is not None:
                view.event(e)
        for text in log.read():
            m = _NODE_LINE.match(text)
            view.line(int(m.group(1)) if m else -1, m.group(2) if m else text)

    last_check = float("-inf")
    while True:
        drain()
        now = time.monotonic()
        if now - last_check >= check_s:
            last_check = now
            if not running():
                drain()
                return
        sleep(poll_s)
