"""The last lines of a job's log, as the views show them (the full output stays in the run folder's
``output.log``, written by ``console.RunRecorder``).

Note [Interrupted job]: when a job is stopped (Ctrl-C in the terminal, SIGTERM, or the launcher's teardown
after a failure), each node's torchrun raises ``SignalException`` and prints a 30-line traceback, after
``Received 2 death signal, shutting down workers`` and one ``Sending process N closing signal SIGTERM`` per
rank. That says one thing: the job was interrupted. So the tail keeps one line saying so, once per job, and
drops those lines and that traceback (a traceback ending in any other exception is kept whole). When the
launcher stops the job itself (a rank failed, or the model check found a problem: :meth:`LogTail.stopping`),
not even that line: it would read as a signal from outside, and the launcher's own error line says why. Lines are
folded per stream (a node's own lines, or one rank's ``[rank R]`` lines) so interleaved nodes and ranks do not
mix their tracebacks.

No rich here: the tail is data (telemetry/state.py holds one).
"""

from __future__ import annotations

import re
import signal
from collections import deque
from typing import Iterator

from zerorun.telemetry.events import Event

_RANK_PREFIX = re.compile(r"^(\[rank \d+\]) ?")
_DEATH = re.compile(r"Received (?:Signals\.)?(\w+) death signal, shutting down workers")
_CLOSING = re.compile(r"Sending process \d+ closing signal SIG\w+")
_SIGNAL_EXC = re.compile(r"SignalException: Process \d+ got signal: (\w+)")
_TB_START = "Traceback (most recent call last):"
_TB_JOINS = ("During handling of the above exception, another exception occurred:",
             "The above exception was the direct cause of the following exception:")


def signal_name(value: str) -> str:
    """``"15"`` or ``"SIGTERM"`` -> ``SIGTERM``; anything else unchanged."""
    if value.isdigit():
        try:
            return signal.Signals(int(value)).name
        except ValueError:
            return f"signal {value}"
    return value


class LogTail:
    """The last ``maxlen`` entries of a job's log: lines (``str``) and lifecycle events (:class:`Event`, turned
    into text by ``format.describe``), with torchrun's interruption noise folded into one line (Note
    [Interrupted job]). Iterating gives the entries, oldest first."""

    def __init__(self, maxlen: int = 8) -> None:
        self.entries: deque[str | Event] = deque(maxlen=maxlen)
        self.interrupted: str | None = None  # the signal's name once a node said it was stopped
        self._launcher_stop = False  # the launcher stops the job itself (stopping())
        self._tracebacks: dict[tuple[int, str], list[str]] = {}  # stream -> its traceback lines so far

    def __iter__(self) -> Iterator[str | Event]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def add_event(self, e: Event) -> None:
        self.entries.append(e)

    def add_line(self, node_rank: int, line: str) -> list[str]:
        """Add a line node ``node_rank`` printed (a rank's own line starts with ``[rank R]``; others get
        ``[node N]``); returns the lines this adds to the tail now (none while a traceback is being read)."""
        m = _RANK_PREFIX.match(line)
        prefix, body = (m.group(1), line[m.end():]) if m else (f"[node {node_rank}]", line)
        key = (node_rank, prefix)
        shown = line if m else f"{prefix} {line}"
        buffered = self._tracebacks.get(key)
        if buffered is not None:
            if not body.strip() or body[:1].isspace() or body.startswith(_TB_START) or body.strip() in _TB_JOINS:
                buffered.append(shown)
                return []
            del self._tracebacks[key]
            sig = _SIGNAL_EXC.search(body)
            if sig or body.startswith("KeyboardInterrupt"):
                return self._interrupted(prefix, signal_name(sig.group(1)) if sig else "SIGINT")
            return self._add(buffered + [shown])
        if body.startswith(_TB_START):
            self._tracebacks[key] = [shown]
            return []
        death = _DEATH.search(body)
        if death:
            return self._interrupted(prefix, signal_name(death.group(1)))
        if (self.interrupted or self._launcher_stop) and _CLOSING.search(body):
            return []
        return self._add([shown])

    def flush(self) -> list[str]:
        """Add the lines of tracebacks still being read (a stream that ended inside one); returns them."""
        lines = [line for buffered in self._tracebacks.values() for line in buffered]
        self._tracebacks.clear()
        return self._add(lines)

    def stopping(self) -> None:
        """The launcher is stopping the job itself (a rank failed, or a problem was found beside the job): the
        nodes' signal lines and tracebacks that follow are dropped without the "job interrupted" line (Note
        [Interrupted job]); the launcher's error line says why the job stopped."""
        self._launcher_stop = True

    def _interrupted(self, prefix: str, name: str) -> list[str]:
        if self.interrupted or self._launcher_stop:
            self.interrupted = self.interrupted or name
            return []
        self.interrupted = name
        return self._add([f"{prefix} job interrupted: torchrun got {name} and stops every rank (full output: "
                          "the run folder's output.log)"])

    def _add(self, lines: list[str]) -> list[str]:
        self.entries.extend(lines)
        return lines
