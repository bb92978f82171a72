"""Supervising a job: start every node, stream its lines, and on the first failure, Ctrl-C or SIGTERM stop
everything and verify that no process of the job is left.

Note [Teardown]: torchrun starts its workers in sessions of their own, a SIGKILLed torchrun orphans them, and
a surviving agent can wait in its exit barrier ignoring SIGTERM. So teardown does not rely on one signal path:
SIGTERM to each node's process group, a grace period while the lines keep draining, then SIGKILL to the group
and to every process marked with the job id (``JOB_ENV``), repeated until none is left. Nodes are signalled
in parallel (a remote node's signal is an SSH round trip, launch/remote.py), so teardown time does not grow
with the number of hosts.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from zerorun.launch.node import NOTE_PREFIX
from zerorun.launch.plan import LaunchPlan
from zerorun.launch.runner import LocalNode
from zerorun.telemetry.events import Event, parse_line

_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_TORCHRUN_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_RANK_LINE = re.compile(r"^\[rank (\d+)\]")
#: what a node's torchrun prints when it gets a signal itself (SLURM's scancel or time limit signals every process)
_AGENT_SIGNALLED = re.compile(r"Received (?:Signals\.)?\w+ death signal, shutting down workers")


def describe_exit(code: int) -> str:
    """``exit code 7`` or ``killed by SIGSEGV`` for a process exit status (negative: signal)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class JobResult:
    """How a job ended: ``status`` ok | failed | interrupted; for failures the failing ``rank`` (or None),
    its host, the ``exit_code`` zerorun exits with, and a one-line ``message``."""

    status: str
    exit_code: int
    rank: int | None = None
    host: str | None = None
    message: str = ""
    elapsed_s: float = 0.0
    #: the failure is a node lost for a reason of its own (SSH connection lost, watcher or agent killed) on ``host``
    lost: bool = False


class Supervisor:
    """Runs ``nodes`` of ``plan``; calls ``on_event(event)`` for telemetry and ``on_line(node_rank, line)`` for
    every other line. Nodes are :class:`LocalNode` or ``launch.remote.RemoteNode`` objects. With
    ``require_finish`` (training), a rank that ends without a finish event fails the job; without it (user
    scripts, ``zerorun launch``), exit codes alone decide. ``check()``, polled while the job runs, returns a
    one-line problem found beside the job (the model check, zerorun/rank/modelcheck.py) or None: a problem stops the
    job as bad input (exit code 2) unless a rank has failed already. ``on_stopping()``, when given, is called
    once before the supervisor itself signals nodes that still run (a failure or a problem, not a Ctrl-C or
    SIGTERM it received): the views then do not show the nodes' stop lines as an interruption."""

    def __init__(self, plan: LaunchPlan, nodes: list[LocalNode], lines: "queue.Queue",
                 on_event: Callable[[Event], None], on_line: Callable[[int, str], None],
                 grace_s: float = 5.0, require_finish: bool = True,
                 check: Callable[[], str | None] | None = None,
                 on_stopping: Callable[[], None] | None = None) -> None:
        self.plan, self.nodes, self.lines = plan, nodes, lines
        self.check, self.on_stopping = check, on_stopping
        self.on_event, self.on_line = on_event, on_line
        self.grace_s = grace_s
        self.require_finish = require_finish
        self.unverified: dict[str, str] = {}  # host -> why teardown could not check it
        self._tails: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=3))
        self._stop: str | None = None
        self._save: str | None = None  # SIGUSR1's name once it came: Note [Early save signal] (zerorun/slurm/sbatch.py)
        self._save_sent = False
        self._errors: dict[int, Event] = {}
        self._rank_exits: dict[int, int] = {}  # global rank -> exit code, from torchrun's failure summary
        self._last_rank: int | None = None
        self._in_root_cause = False
        self._root_causes: list[int] = []  # torchrun's "Root Cause (first observed failure)" rank per node
        self._finished: set[int] = set()
        self._stopped: dict[int, Event] = {}  # ranks that saved a checkpoint on SIGTERM (zerorun/rank/stopsignal.py)
        self._ended: dict[int, int] = {}
        self._notes: dict[int, str] = {}  # node rank -> why its watcher says it ended (launch/node.py)
        self._own_exits: dict[int, int] = {}  # global rank -> exit code, as its torchrun saw it end (Note [Rank exits])
        self._agent_signalled = False  # a node's torchrun said it got a signal (not only some rank)
        self._heard: dict[int, float] = {}  # global rank -> when its last line or event arrived (time.time())
        self._finish_time: dict[int, float] = {}
        self._error_arrival: dict[int, float] = {}
        #: global rank -> exit code of ranks that ended on their own, before any teardown (torchrun's summary)
        self.rank_exits: dict[int, int] = {}

    def _handle_signal(self, signum, _frame) -> None:
        self._stop = signal.Signals(signum).name

    def _handle_save(self, signum, _frame) -> None:
        self._save = signal.Signals(signum).name

    def _ask_to_save(self) -> None:
        """Note [Early save signal] in zerorun/slurm/sbatch.py: SIGTERM to every node still running, without a
        deadline (the ranks save at their next step and stop; the time limit itself still ends the job)."""
        self._save_sent = True
        running = [n for n in self.nodes if n.spec.node_rank not in self._ended]
        if running:
            with ThreadPoolExecutor(len(running)) as pool:
                list(pool.map(lambda n: n.send_signal(signal.SIGTERM), running))

    def run(self) -> JobResult:
        """Start the nodes and wait until all end, one fails, or a signal arrives; always tears down."""
        t0 = time.time()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._handle_signal)
            previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._handle_save)
        try:
            for node in self.nodes:
                node.start()
            result = self._watch()
        finally:
            self._teardown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if result.status == "interrupted" and self._stopped and "checkpoint" not in result.message:
            result.message = self._stopped_message(self._stop or "SIGTERM")  # the ranks saved during the teardown
        result.elapsed_s = time.time() - t0
        return result

    def _stopped_message(self, sig: str, to: str = "") -> str:
        """What the ranks that stopped on SIGTERM saved (Note [Checkpoint on SIGTERM] in zerorun/rank/stopsignal.py):
        the step, the checkpoint, and how to continue; ``to`` names where the signal went (``" (sent to rank
        1)"``)."""
        e = self._stopped.get(0) or next(iter(self._stopped.values()))  # the save is collective: one is enough
        again = os.environ.get("ZERORUN_CONTINUE") or "zerorun train ... --resume"  # a submitted job's: its resubmit
        return (f"stopped by {sig}{to} after step {e.data.get('step')}: every rank saved checkpoint "
                f"{e.data.get('path')} and exited; continue with {again}")

    def _stopped_result(self) -> JobResult:
        """Every rank stopped on SIGTERM and saved. When neither the launcher nor a node's torchrun got the
        signal (SLURM's scancel and time limit signal every process of the step, torchrun included), it went
        to a rank alone (``kill`` of one process), which the ranks agreed on and name (``signalled_rank``,
        zerorun/rank/stopsignal.py): the result names it and its host. A save the launcher asked for (SIGUSR1 from
        SLURM before the time limit) is job-wide and named by that signal."""
        e = self._stopped.get(0) or next(iter(self._stopped.values()))
        by = e.data.get("signalled_rank")
        if (self._save is None and self._stop is None and not self._agent_signalled and isinstance(by, int)
                and not isinstance(by, bool)):
            node = self.plan.node_of_rank(by)
            return JobResult("interrupted", 143, by, node.host.name if node else None,
                             self._stopped_message("SIGTERM", f" (sent to rank {by})"))
        return JobResult("interrupted", 143, message=self._stopped_message(self._save or "SIGTERM"))

    def _drain(self, timeout: float) -> None:
        try:
            item = self.lines.get(timeout=timeout)
        except queue.Empty:
            return
        node_rank, line = item[0], item[1]
        if line is None:
            self._ended[node_rank] = item[2]
            return
        if line.startswith(NOTE_PREFIX):
            self._note(node_rank, line[len(NOTE_PREFIX):])
            return
        event = parse_line(line)
        if event is not None:
            self._heard[event.rank] = time.time()
            if event.kind == "error":
                self._errors.setdefault(event.rank, event)
                self._error_arrival.setdefault(event.rank, time.time())
            elif event.kind == "finish":
                self._finished.add(event.rank)
                self._finish_time[event.rank] = time.time()
            elif event.kind == "stopped":
                self._stopped[event.rank] = event
            self.on_event(event)
            return
        m = _RANK_LINE.match(line)
        if m:
            self._heard[int(m.group(1))] = time.time()
        if line.startswith("Root Cause"):
            self._in_root_cause = True
        if _AGENT_SIGNALLED.search(line):
            self._agent_signalled = True
        m = _TORCHRUN_RANK.match(line)
        if m:
            self._last_rank = int(m.group(1))
            if self._in_root_cause:
                self._root_causes.append(self._last_rank)
                self._in_root_cause = False
        m = _TORCHRUN_EXIT.match(line)
        if m and self._last_rank is not None:
            self._rank_exits.setdefault(self._last_rank, int(m.group(1)))
        if line.strip() and not line.startswith("[rank "):
            self._tails[node_rank].append(line.strip())
        self.on_line(node_rank, line)

    def _note(self, node_rank: int, text: str) -> None:
        """A node watcher's or torchrun's ``@zerorun-node`` line: why the node ended (launch/node.py), or a rank
        that ended on its own and its exit code (Note [Rank exits] in launch/torchrun.py)."""
        try:
            note = json.loads(text)
        except ValueError:
            return
        if not isinstance(note, dict):
            return
        if isinstance(note.get("reason"), str):
            self._notes[node_rank] = note["reason"]
        rank, code = note.get("rank"), note.get("exit_code")
        if isinstance(rank, int) and isinstance(code, int) and not isinstance(code, bool):
            self._own_exits.setdefault(rank, code)

    def _exits(self) -> dict[int, int]:
        """Global rank -> exit code of every rank that ended on its own: torchrun's failure summary, and the
        ranks its poll saw end (exit code 0 included, Note [Rank exits])."""
        return {**self._own_exits, **self._rank_exits}

    def _exited_early(self, rank: int) -> bool:
        """``rank`` exited 0 without a finish event (``os._exit(0)`` in the middle of the job)."""
        return self._own_exits.get(rank) == 0 and rank not in self._finished

    def _watch(self) -> JobResult:
        while True:
            if self._stop:
                return JobResult("interrupted", 130 if self._stop == "SIGINT" else 143,
                                 message=f"stopped by {self._stop}: every rank was terminated")
            if self._save and not self._save_sent:
                self._ask_to_save()
            self._drain(0.1)
            failed = [n for n, rc in self._ended.items() if rc != 0]
            if failed and self._stopped and not self._errors:  # the other ranks' events may still be on the way
                deadline = time.time() + 5.0
                while len(self._stopped) < self.plan.world_size and not self._errors and time.time() < deadline:
                    self._drain(0.1)
            if len(self._stopped) == self.plan.world_size and not self._errors:
                return self._stopped_result()
            if failed and self._save_sent and not self._stopped and not self._errors:  # no checkpoint.dir: none saved
                return JobResult("interrupted", 143, message=f"stopped by {self._save}: every rank was asked to "
                                 "stop (SIGTERM) and none saved a checkpoint (no checkpoint.dir)")
            if failed or self._errors:
                return self._failure(failed[0] if failed else None)
            early = [r for r in sorted(self._own_exits) if self._exited_early(r)] if self.require_finish else []
            if early:  # training needs every rank to the end; its peers may wait a collective timeout for it
                node = self.plan.node_of_rank(early[0])
                return JobResult("failed", 1, early[0], node.host.name if node else None,
                                 "rank exited before finishing training (exit code 0, no finish event)")
            problem = self.check() if self.check is not None else None
            if problem:
                return JobResult("failed", 2, message=problem)
            if len(self._ended) == len(self.nodes):
                missing = sorted(set(range(self.plan.world_size)) - self._finished)
                if missing and self.require_finish:
                    node = self.plan.node_of_rank(missing[0])
                    return JobResult("failed", 1, missing[0], node.host.name if node else None,
                                     "rank exited before finishing training (no finish event)")
                return JobResult("ok", 0)

    def _failure(self, node_rank: int | None) -> JobResult:
        """Name the rank that failed first. Note [Blame]: when a rank dies, its peers fail too, inside a
        collective ("connection reset by peer"); those errors are marked ``peer_failure`` by the worker and
        blamed last. A rank that died without an error event (a crash, a signal, ``os._exit``) is found in
        torchrun's failure summary, so the failing node is given a few seconds to end and print it."""
        t0 = time.time()
        while time.time() < t0 + 10.0:
            if node_rank is None:
                failed = [n for n, rc in self._ended.items() if rc != 0]
                node_rank = failed[0] if failed else None
            if node_rank is not None and node_rank in self._ended:
                # Multi-node: the first node to end may only have seen peer failures; the node of the rank that
                # died prints its own summary moments later, so wait a little for a cause.
                if self._has_cause(node_rank) or len(self._ended) >= len(self.nodes) or time.time() > t0 + 5.0:
                    break
            self._drain(0.1)
        exits = self._exits()
        self.rank_exits = exits  # before teardown: what happened, not how it was stopped
        own = [e for e in self._errors.values() if not e.data.get("peer_failure")]
        # torchrun's first observed failure first, then ranks that were not merely stopped by a teardown
        silent = sorted((r for r, code in exits.items() if code != 0 and r not in self._errors),
                        key=lambda r: (r not in self._root_causes, exits[r] in (-signal.SIGTERM, -signal.SIGKILL), r))
        # a node that ended for a reason of its own, e.g. a lost SSH connection (launch/remote.py) or a killed
        # torchrun agent (launch/node.py): its ranks could not report, and what the others report is a consequence
        reason_node, reason = self._end_reason(node_rank)
        if own:
            event = min(own, key=lambda e: e.time)
        elif silent and not reason:
            rank = silent[0]
            node = self.plan.node_of_rank(rank)
            return JobResult("failed", 1, rank, node.host.name if node else None,
                             f"rank process ended ({describe_exit(exits[rank])})")
        elif reason:
            node = self.plan.nodes[reason_node]
            where = "" if node.host.name in reason else f" on {node.host.name}"
            return JobResult("failed", 1, None, node.host.name, f"node {reason_node}{where} ended ({reason})",
                             lost=True)
        elif self._errors and self._quiet_rank() is not None:
            return self._quiet_rank()
        elif self._errors:
            event = min(self._errors.values(), key=lambda e: e.time)
        else:
            node = self.plan.nodes[node_rank] if node_rank is not None else None
            code = self._ended.get(node_rank) if node_rank is not None else None
            what = describe_exit(code) if code is not None else "unknown cause"
            tail = self._tails.get(node_rank)
            return JobResult("failed", 1, None, node.host.name if node else None,
                             f"node {node_rank} ended ({what})" + (f": {tail[-1]}" if tail else ""))
        node = self.plan.node_of_rank(event.rank)
        user = bool(event.data.get("user_error"))
        msg = event.data.get("message", "")
        if not user:
            msg = f"{event.data.get('type', 'Error')}: {msg}"
            if event.data.get("where"):
                msg += f" (at {event.data['where']})"
        return JobResult("failed", 2 if user else 1, event.rank, node.host.name if node else None, msg)

    def _end_reason(self, node_rank: int | None) -> tuple[int | None, str | None]:
        """The node that ended for a reason of its own (``node_rank`` first, then in order) and that reason."""
        order = ([node_rank] if node_rank is not None else []) + list(range(len(self.nodes)))
        for n in order:
            if n not in range(len(self.nodes)):
                continue
            reason = getattr(self.nodes[n], "end_reason", None) or self._notes.get(n)
            if reason:
                return n, reason
        return None, None

    def _quiet_rank(self) -> JobResult | None:
        """Note [Blame], continued: when every error is a peer failure (a timeout, a reset connection), the
        rank to blame is one that went quiet first: one that reported no error and did not finish (hung, e.g.
        SIGSTOP, or exited without a word), or that finished while its peers still needed it, the one last
        heard from earliest."""
        first_error = min(self._heard_error_times(), default=time.time())
        failed = {r for r, code in self._exits().items() if code != 0}
        quiet = [r for r in range(self.plan.world_size) if r not in self._errors and r not in failed
                 and (r not in self._finished or self._finish_time.get(r, first_error) < first_error)]
        if not quiet:
            return None
        rank = min(quiet, key=lambda r: (not self._exited_early(r), r in self._finished, self._heard.get(r, 0.0), r))
        node = self.plan.node_of_rank(rank)
        peer = min(self._errors.values(), key=lambda e: e.time)
        if rank in self._finished:
            what = f"rank {rank} finished while its peers still needed it"
        elif self._exited_early(rank) or node is not None and self._ended.get(node.node_rank) == 0:
            what = f"rank {rank} exited (exit code 0) in the middle of the job"
        else:
            heard = self._heard.get(rank)
            when = f"last heard {first_error - heard:.1f} s before" if heard is not None else "no word from it before"
            what = f"rank {rank} stopped responding ({when} rank {peer.rank} failed)"
        detail = f"{peer.data.get('type', 'Error')}: {peer.data.get('message', '')}"
        return JobResult("failed", 1, rank, node.host.name if node else None,
                         f"{what}; rank {peer.rank} then failed: {detail}")

    def _heard_error_times(self) -> list[float]:
        return [self._error_arrival.get(r, e.time) for r, e in self._errors.items()]

    def _has_cause(self, node_rank: int) -> bool:
        """True once a failure is explained by more than peer failures (Note [Blame])."""
        return (any(not e.data.get("peer_failure") for e in self._errors.values())
                or any(r not in self._errors for r in self._rank_exits)
                or any(self._exited_early(r) for r in self._own_exits)
                or self._end_reason(node_rank)[1] is not None)

    def _teardown(self) -> None:
        """Note [Teardown]."""
        running = [n for n in self.nodes if n.spec.node_rank not in self._ended]
        if not self.nodes:
            return
        if running and self._stop is None and self.on_stopping is not None:
            self.on_stopping()
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(lambda n: n.send_signal(signal.SIGTERM), running))
            deadline = time.time() + self.grace_s
            while time.time() < deadline and len(self._ended) < len(self.nodes):
                self._drain(0.1)

            def kill(node) -> int:
                node.send_signal(signal.SIGKILL)
                return node.kill_survivors(signal.SIGKILL)

            for _ in range(20):
                if not sum(pool.map(kill, self.nodes)):
                    break
                time.sleep(0.1)
        self.unverified = {n.spec.host.name: n.unverified for n in self.nodes if getattr(n, "unverified", None)}
        deadline = time.time() + 10.0
        while len(self._ended) < len(self.nodes) and time.time() < deadline:
            self._drain(0.2)
