"""What the nodes of a job said so far: each message from the node group (Note [Node messages] in
launch/nodes.py) parsed once, into the facts that the supervisor's lifecycle and blame (launch/blame.py) read.

Three kinds of line carry facts: a rank's telemetry event (zerorun/telemetry/events.py: errors, finishes,
stops on SIGTERM), a node's ``@zerorun-node`` note (JSON: why its watcher says it ended, launch/node.py; a rank
that ended on its own, Note [Rank exits]; torchrun's failure report, Note [Failure report], both in
launch/torchrun.py), and a torchrun log line saying that its agent got a signal. Every other line is shown.
"""

from __future__ import annotations

import collections
import json
import re
import time

from zerorun.launch.marks import NOTE_PREFIX
from zerorun.launch.nodes import Ended, Line, Message
from zerorun.telemetry.events import Event, parse_line

_RANK_LINE = re.compile(r"^\[rank (\d+)\]")
#: a rank's last words before an abort: C++'s std::terminate (gloo's "what():  [enforce fail at pair.cc:446] ...
#: Received data size doesn't match expected size"), CPython's "Fatal Python error: ..."; a leading [file:line] goes
_WORDS = r"(?:what\(\):\s+(?:\[[^\]]*\]\s*)?(.+)|(Fatal Python error: .+))"
_LAST_WORDS = re.compile(r"^\[rank (\d+)\]:?\s+" + _WORDS)
#: the same written by C++ straight to the rank's standard error, with no rank in front (gloo's abort: a review)
_NODE_LAST_WORDS = re.compile(r"^\s*" + _WORDS)
#: what a node's torchrun prints when it gets a signal itself (SLURM's scancel or time limit signals every process)
_AGENT_SIGNALLED = re.compile(r"Received (?:Signals\.)?\w+ death signal, shutting down workers")


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Observed:
    """The facts of a job's messages so far; :meth:`take` adds one. Times are ``time.time()`` seconds."""

    def __init__(self) -> None:
        self.tails: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=3))
        self.errors: dict[int, Event] = {}  # global rank -> its first error event
        self.error_arrival: dict[int, float] = {}
        self.finished: set[int] = set()
        self.finish_time: dict[int, float] = {}
        self.stopped: dict[int, Event] = {}  # ranks that saved a checkpoint on SIGTERM (zerorun/rank/stopsignal.py)
        self.ended: dict[int, int] = {}  # node rank -> exit status
        self.end_reasons: dict[int, str] = {}  # node rank -> why it ended, from its Ended message
        self.notes: dict[int, str] = {}  # node rank -> why its watcher says it ended (launch/node.py)
        self.own_exits: dict[int, int] = {}  # global rank -> exit code, as its torchrun saw it end (Note [Rank exits])
        self.rank_exits: dict[int, int] = {}  # global rank -> exit code, from torchrun's failure report
        self.root_causes: list[int] = []  # the failure report's first observed failure, per node
        self.agent_signalled = False  # a node's torchrun said it got a signal (not only some rank)
        self.heard: dict[int, float] = {}  # global rank -> when its last line or event arrived
        self.last_words: dict[int, str] = {}  # global rank -> its abort's message (_LAST_WORDS), for blame
        self.node_last_words: dict[int, str] = {}  # node rank -> an abort's message no rank is named in
        self.last_line: dict[int, str] = {}  # global rank -> the last line it printed (a SystemExit's message)

    def take(self, message: Message) -> Event | Line | None:
        """Record ``message``; return the telemetry event it carries, the :class:`Line` to show, or None (a
        node's end or note)."""
        if isinstance(message, Ended):
            self.ended[message.node_rank] = message.status
            if message.reason:
                self.end_reasons[message.node_rank] = message.reason
            return None
        line = message.text
        if line.startswith(NOTE_PREFIX):
            self._note(message.node_rank, line[len(NOTE_PREFIX):])
            return None
        event = parse_line(line)
        if event is not None:
            self._event(event)
            return event
        m = _RANK_LINE.match(line)
        if m:
            self.heard[int(m.group(1))] = time.time()
            text = line[m.end():].strip(" :")
            if text:
                self.last_line[int(m.group(1))] = text[:200]
            words = _LAST_WORDS.match(line)
            if words:
                self.last_words[int(words.group(1))] = (words.group(2) or words.group(3)).strip()[:200]
        if _AGENT_SIGNALLED.search(line):
            self.agent_signalled = True
        if line.strip() and not line.startswith("[rank "):
            self.tails[message.node_rank].append(line.strip())
            words = _NODE_LAST_WORDS.match(line)
            if words:
                self.node_last_words[message.node_rank] = (words.group(1) or words.group(2)).strip()[:200]
        return message

    def _event(self, event: Event) -> None:
        now = time.time()
        self.heard[event.rank] = now
        if event.kind == "error":
            self.errors.setdefault(event.rank, event)
            self.error_arrival.setdefault(event.rank, now)
        elif event.kind == "finish":
            self.finished.add(event.rank)
            self.finish_time[event.rank] = now
        elif event.kind == "stopped":
            self.stopped[event.rank] = event

    def _note(self, node_rank: int, text: str) -> None:
        """A ``@zerorun-node`` note: why the node's watcher says it ended (``reason``), a rank that ended on
        its own (``rank``, ``exit_code``), or torchrun's failure report (``failures``, ``root_cause``)."""
        try:
            note = json.loads(text)
        except ValueError:
            return
        if not isinstance(note, dict):
            return
        if isinstance(note.get("reason"), str):
            self.notes[node_rank] = note["reason"]
        rank, code = note.get("rank"), note.get("exit_code")
        if _int(rank) and _int(code):
            self.own_exits.setdefault(rank, code)
        for failure in note.get("failures") or ():
            if isinstance(failure, dict) and _int(failure.get("rank")) and _int(failure.get("exit_code")):
                self.rank_exits.setdefault(failure["rank"], failure["exit_code"])
        if _int(note.get("root_cause")):
            self.root_causes.append(note["root_cause"])

    def end_reason(self, node_rank: int) -> str | None:
        """Why node ``node_rank`` ended, when its exit status does not say: its own message's reason, else its
        watcher's note; else None."""
        return self.end_reasons.get(node_rank) or self.notes.get(node_rank)

    def exits(self) -> dict[int, int]:
        """Global rank -> exit code of every rank that ended on its own: torchrun's failure report, and the
        ranks its poll saw end (exit code 0 included, Note [Rank exits])."""
        return {**self.own_exits, **self.rank_exits}

    def exited_early(self, rank: int) -> bool:
        """``rank`` exited 0 without a finish event (``os._exit(0)`` in the middle of the job)."""
        return self.own_exits.get(rank) == 0 and rank not in self.finished
