"""Supervising a job, its lifecycle: start every node, take the nodes' messages (launch/observed.py), and on
the first failure (blamed as Note [Blame] in launch/blame.py), Ctrl-C or SIGTERM stop everything and verify
that no process of the job is left (Note [Teardown] in launch/teardown.py).
"""

from __future__ import annotations

import os
import queue
import shlex
import signal
import sys
import threading
import time
from typing import Callable

from zerorun.launch import blame
from zerorun.launch.nodes import SCHEDULER_STOP, Line, Node
from zerorun.launch.observed import Observed
from zerorun.launch.outcome import Outcome
from zerorun.launch.plan import LaunchPlan
from zerorun.launch.teardown import signal_running, teardown
from zerorun.recipe.text import MASK
from zerorun.telemetry.events import Event


def continue_command(argv: list[str]) -> str:
    """The command line that continues a stopped ``zerorun train`` from its latest checkpoint: ``argv`` (this
    launcher's) with a bare ``--resume`` in place of any other, ``launch.env`` values masked (the line is kept
    in job.json); ``zerorun train ... --resume`` for another command (found by review: the user rebuilt it)."""
    words = list(argv[1:])
    if words[:1] != ["train"]:
        return "zerorun train ... --resume"
    out = []
    for i, w in enumerate(words):
        if w.startswith("--resume=") or w == "--resume" or (i and words[i - 1] == "--resume" and "=" not in w
                                                             and not w.startswith("-")):
            continue
        out.append(f"{w.split('=', 1)[0]}={MASK}" if w.startswith("launch.env") and "=" in w else w)
    return shlex.join(["zerorun", *out, "--resume"])


class Supervisor:
    """Runs ``nodes`` of ``plan`` (the ``Node`` protocol of launch/nodes.py, their messages on ``lines``);
    calls ``on_event(event)`` for telemetry and ``on_line(node_rank, line)`` for every other line. With
    ``require_finish`` (training), a rank that ends without a finish event fails the job; without it (user
    scripts, ``zerorun launch``), exit codes alone decide. ``check()``, polled while the job runs, returns a
    one-line problem found beside the job (the model check, zerorun/rank/modelcheck.py) or None: a problem stops the
    job as bad input (exit code 2) unless a rank has failed already. ``on_stopping()``, when given, is called
    once before the supervisor itself signals nodes that still run (a failure or a problem, not a Ctrl-C or
    SIGTERM it received): the views then do not show the nodes' stop lines as an interruption."""

    def __init__(self, plan: LaunchPlan, nodes: list[Node], lines: "queue.Queue",
                 on_event: Callable[[Event], None], on_line: Callable[[int, str], None],
                 grace_s: float = 5.0, require_finish: bool = True,
                 check: Callable[[], str | None] | None = None,
                 on_stopping: Callable[[], None] | None = None) -> None:
        self.plan, self.nodes, self.lines = plan, nodes, lines
        self.check, self.on_stopping = check, on_stopping
        self.on_event, self.on_line = on_event, on_line
        self.grace_s = grace_s
        self.require_finish = require_finish
        self.seen = Observed()
        self.unverified: dict[str, str] = {}  # host -> why teardown could not check it
        self._stop: str | None = None
        self._save: str | None = None  # SIGUSR1's name once it came: Note [Early save signal] (zerorun/slurm/sbatch.py)
        self._save_sent = False
        #: global rank -> exit code of ranks that ended on their own, before any teardown (torchrun's report)
        self.rank_exits: dict[int, int] = {}

    def _handle_signal(self, signum, _frame) -> None:
        self._stop = signal.Signals(signum).name

    def _handle_save(self, signum, _frame) -> None:
        self._save = signal.Signals(signum).name

    def run(self) -> Outcome:
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
        if result.status == "interrupted" and self.seen.stopped and "checkpoint" not in result.message:
            result.message = self._stopped_message(self._stop or "SIGTERM")  # the ranks saved during the teardown
        result.elapsed_s = time.time() - t0
        return result

    def _drain(self, timeout: float) -> None:
        """Take one message from the nodes (waiting up to ``timeout`` s) and pass on what it shows."""
        try:
            message = self.lines.get(timeout=timeout)
        except queue.Empty:
            return
        shown = self.seen.take(message)
        if isinstance(shown, Line):
            self.on_line(shown.node_rank, shown.text)
        elif shown is not None:
            self.on_event(shown)

    def _stopped_message(self, sig: str, to: str = "") -> str:
        """What the ranks that stopped on SIGTERM saved (Note [Checkpoint on SIGTERM] in zerorun/rank/stopsignal.py):
        the step, the checkpoint, and how to continue; ``to`` names where the signal went (``" (sent to rank
        1)"``)."""
        e = self._stop_event()
        again = os.environ.get("ZERORUN_CONTINUE") or continue_command(sys.argv)  # a submitted job's: its resubmit
        return (f"stopped by {sig}{to} after step {e.data.get('step')}: every rank saved checkpoint "
                f"{e.data.get('path')} and exited; continue with {again}")

    def _stopped_result(self) -> Outcome:
        """Every rank stopped on SIGTERM and saved. When neither the launcher nor a node's torchrun got the
        signal (SLURM's scancel and time limit signal every process of the step, torchrun included), it went
        to a rank alone (``kill`` of one process), which the ranks agreed on and name (``signalled_rank``,
        zerorun/rank/stopsignal.py): the result names it and its host. A save the launcher asked for (SIGUSR1 from
        SLURM before the time limit) is job-wide and named by that signal."""
        e = self._stop_event()
        lost = self._lost_node() if self._save is None and self._stop is None else None
        if lost is not None:
            return lost
        by = e.data.get("signalled_rank")
        if (self._save is None and self._stop is None and not self.seen.agent_signalled and isinstance(by, int)
                and not isinstance(by, bool)):
            node = self.plan.node_of_rank(by)
            return Outcome("interrupted", 143, by, node.host.name if node else None,
                           self._stopped_message("SIGTERM", f" (sent to rank {by})"))
        return Outcome("interrupted", 143, message=self._stopped_message(self._save or "SIGTERM"))

    def _stop_event(self) -> Event:
        """A ``stopped`` event of the ranks that saved on SIGTERM (rank 0's where it came): the save is collective,
        so one says its step and checkpoint for all."""
        return self.seen.stopped.get(0) or next(iter(self.seen.stopped.values()))

    def _lost_node(self) -> Outcome | None:
        """A stop nobody asked for: a node whose torchrun agent or watcher died stopped its ranks (SIGTERM from the
        watcher or the kernel: Note [Node watcher] in launch/node.py), which saved a checkpoint with their peers
        and exited. That is a failure (Note [Blame]; ``launch.max_restarts`` restarts from that checkpoint), not a
        stop; before, it ended the job as "stopped by SIGTERM", never restarted. The nodes are given a few seconds
        to end and say why (the watcher's note comes once its ranks are gone). None: no node ended for a reason
        of its own (a SIGTERM sent to a rank), or SLURM ended the step (its time limit, scancel)."""
        deadline = time.time() + 10.0
        while len(self.seen.ended) < len(self.nodes) and time.time() < deadline:
            self._drain(0.1)
        reasons = [self.seen.end_reason(n) for n in range(len(self.nodes))]
        if not any(reasons) or any(r and r.startswith(SCHEDULER_STOP) for r in reasons):
            return None  # no node lost, or SLURM stopped the step (its time limit): a stop from outside
        out, e = blame.failure(self.seen, self.plan, None), self._stop_event()
        out.message += f"; every rank saved checkpoint {e.data.get('path')} after step {e.data.get('step')} first"
        return out

    def _watch(self) -> Outcome:
        seen = self.seen
        while True:
            if self._stop:
                return Outcome("interrupted", 130 if self._stop == "SIGINT" else 143,
                               message=f"stopped by {self._stop}: every rank was terminated")
            if self._save and not self._save_sent:
                self._save_sent = True  # Note [Early save signal]: the ranks save at their next step and stop
                signal_running(self.nodes, seen.ended, signal.SIGTERM)
            self._drain(0.1)
            failed = [n for n, rc in seen.ended.items() if rc != 0]
            if failed and seen.stopped and not seen.errors:  # the other ranks' events may still be on the way
                deadline = time.time() + 5.0
                while len(seen.stopped) < self.plan.world_size and not seen.errors and time.time() < deadline:
                    self._drain(0.1)
            result = self._verdict(failed)
            if result is not None:
                return result

    def _verdict(self, failed: list[int]) -> Outcome | None:
        """How the job ended given what was seen so far (``failed``: node ranks that ended non-zero), or None
        while it runs on."""
        seen = self.seen
        if len(seen.stopped) == self.plan.world_size and not seen.errors:
            return self._stopped_result()
        if failed and self._save_sent and not seen.stopped and not seen.errors:  # no checkpoint.dir: none saved
            return Outcome("interrupted", 143, message=f"stopped by {self._save}: every rank was asked to "
                           "stop (SIGTERM) and none saved a checkpoint (no checkpoint.dir)")
        if failed or seen.errors:
            return self._failure(failed[0] if failed else None)
        early = [r for r in sorted(seen.own_exits) if seen.exited_early(r)] if self.require_finish else []
        if early:  # training needs every rank to the end; its peers may wait a collective timeout for it
            node = self.plan.node_of_rank(early[0])
            return Outcome("failed", 1, early[0], node.host.name if node else None,
                           "rank exited before finishing training (exit code 0, no finish event)")
        problem = self.check() if self.check is not None else None
        if problem:
            return Outcome("failed", 2, message=problem)
        if len(seen.ended) == len(self.nodes):
            missing = sorted(set(range(self.plan.world_size)) - seen.finished)
            if missing and self.require_finish:
                node = self.plan.node_of_rank(missing[0])
                return Outcome("failed", 1, missing[0], node.host.name if node else None,
                               "rank exited before finishing training (no finish event)")
            return Outcome("ok", 0)
        return None

    def _failure(self, node_rank: int | None) -> Outcome:
        """Name the rank that failed first (Note [Blame] in launch/blame.py), the failing node given a few
        seconds to end and send torchrun's failure report."""
        seen, nodes = self.seen, len(self.nodes)
        t0 = time.time()
        while time.time() < t0 + 10.0:
            if node_rank is None:
                failed = [n for n, rc in seen.ended.items() if rc != 0]
                node_rank = failed[0] if failed else None
            if node_rank is not None and node_rank in seen.ended:
                # Multi-node: the first node to end may only have seen peer failures; the node of the rank that
                # died sends its own report moments later, so wait a little for a cause.
                if blame.has_cause(seen, nodes, node_rank) or len(seen.ended) >= nodes or time.time() > t0 + 5.0:
                    break
            self._drain(0.1)
        stopped = blame.torn_down_by_torchrun(seen)  # shown as stopped, as zerorun's own teardown's (a review)
        self.rank_exits = {r: c for r, c in seen.exits().items() if r not in stopped}  # what happened, not the stop
        return blame.failure(seen, self.plan, node_rank)

    def _teardown(self) -> None:
        """Note [Teardown]: the views are told first when the supervisor itself stops nodes that still run."""
        running = [n for n in self.nodes if n.spec.node_rank not in self.seen.ended]
        if running and self._stop is None and self.on_stopping is not None:
            self.on_stopping()
        self.unverified = teardown(self.nodes, self.seen.ended, self._drain, self.grace_s)
