"""Plain line-by-line progress for the launcher (the live dashboard builds on the same events), and the run
directory recorder: every event but ``progress`` to ``metrics.jsonl``, every line to ``output.log``."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import TextIO

from zerorun import runfolder
from zerorun.errors import ZerorunError
from zerorun.telemetry.events import Event, integer, number
from zerorun.telemetry.format import count, describe, human_bytes, human_rate  # noqa: F401 - human_*: used by others
from zerorun.telemetry.phases import slowest
from zerorun.telemetry.state import JobState
from zerorun.telemetry.summary import print_summary

#: a note a node's watcher printed (``zerorun: note: ...``), as the log tail shows it.
_NODE_NOTE = re.compile(r"\[node \d+\] zerorun: note: ")


class RunRecorder:
    """Writes ``metrics.jsonl`` (one event per line, as emitted; not ``progress`` events, whose every field is in
    the step events too) and ``output.log`` (every other line, prefixed ``[node N]``) in ``run_dir``; and the
    step and eval events to the ``recipe``'s ``log.trackers`` (Note [Trackers in the launcher]; ``job``: the
    launcher's job id, Note [Tracker resume]).

    Note [Run folder write failure]: a write that fails (a full disk, a quota, a file-size limit) is cut back to
    the file's size before it, so the file holds whole lines only, and sets :attr:`failed` to one line naming
    ``source`` (the field or flag that named the folder), the file and the reason (``log.dir: cannot write
    runs/tiny/.../metrics.jsonl: No space left on device``); nothing more is written. The launcher polls
    :attr:`failed` beside the model check's problem (launch/run.py): the job is stopped and fails with that line
    and exit code 2, as a rank's full ``checkpoint.dir`` does, never with a traceback.

    Note [Run folder removed]: a run folder removed while the job runs is no write failure (the open files take
    writes into their removed inodes): found at the next step event, it is said once on stderr and the job goes
    on; at its end ``job.json`` cannot be written, which a job that succeeded reports as a warning, not as the
    failure (exit code 2, "bad input") it was before a review.

    Raises:
        ZerorunError: a file cannot be opened (the same line).
    """

    def __init__(self, run_dir: str, recipe=None, source: str = "log.dir", job: str | None = None) -> None:
        self.source = source
        self.failed: str | None = None
        self.removed: str | None = None  # the run folder, once found removed (Note [Run folder removed])
        self.trackers = None
        self._fds: dict[str, int] = {}
        for name in (runfolder.METRICS, runfolder.OUTPUT):
            path = os.path.join(run_dir, name)
            try:
                os.makedirs(run_dir, exist_ok=True)
                self._fds[name] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            except OSError as e:
                self.close()
                raise ZerorunError(self._why(path, e)) from None
        self._paths = {name: os.path.join(run_dir, name) for name in self._fds}
        if recipe is not None and recipe.log.trackers:
            from zerorun.telemetry.trackers import TrackerSink

            self.trackers = TrackerSink(run_dir, recipe, job=job)

    def _why(self, path: str, e: OSError) -> str:
        return f"{self.source}: cannot write {path}: {e.strerror or e}"

    def _append(self, name: str, text: str) -> None:
        """Append ``text`` (whole lines) to the file ``name``, all of it or none (Note [Run folder write
        failure])."""
        if self.failed is not None:
            return
        fd, data = self._fds[name], text.encode("utf-8")
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError as e:
            self.failed = self._why(self._paths[name], e)
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass

    def event(self, event: Event) -> None:
        if self.trackers is not None:
            self.trackers.event(event)
        if event.kind == "progress":
            return
        if event.kind == "step" and not self.removed:
            self._check_removed()
        self._append(runfolder.METRICS, json.dumps(event.to_json(), separators=(",", ":")) + "\n")

    def _check_removed(self) -> None:
        """Note [Run folder removed]: the run's files were removed while the job runs (``rm -rf`` of the run
        folder): say so once on stderr; the job goes on, and its end is not a failure (launch/run.py)."""
        path = self._paths.get(runfolder.METRICS)
        try:
            gone = os.fstat(self._fds[runfolder.METRICS]).st_nlink == 0
        except (OSError, KeyError):
            return
        if gone:
            self.removed = os.path.dirname(path)
            sys.stderr.write(f"zerorun: warning: {self.source}: {self.removed} was removed while the job runs: its "
                             "record (metrics.jsonl, output.log, job.json) is lost from here; the job goes on\n")

    def line(self, node_rank: int, line: str) -> None:
        self._append(runfolder.OUTPUT, f"[node {node_rank}] {line}\n")

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}


class PlainView:
    """Plain one-line progress on ``out`` for when there is no terminal (CI, ``| tee``, ``--no-dashboard``):
    a job line from rank 0's step events at most every ``min_interval_s`` seconds (the first and last step
    always), and when step events are sparse (a large ``log.every``) a short ``step N/M  eta`` line from rank 0's
    progress events once no line was printed for ``quiet_s``; lifecycle lines (``format.describe``), every
    rank's own output, and the summary table at the end. The job's picture is kept in ``state`` (a
    :class:`~zerorun.telemetry.state.JobState`)."""

    def __init__(self, out: TextIO, state=None, min_interval_s: float = 2.0, quiet_s: float = 30.0) -> None:
        self.out = out
        self.state = state if state is not None else JobState()
        self.min_interval_s, self.quiet_s = min_interval_s, quiet_s
        self._last_print = time.monotonic()  # when the last progress line was printed
        self._allocators: dict[int, tuple[str, str]] = {}  # rank -> (allocator, host), from start events
        self._told: set[int] = set()
        self._phase: str | None = None  # the slowest rank's phase last printed (Note [Rank phases])

    def event(self, e: Event) -> None:
        self.state.update(e)
        d = e.data
        if e.kind == "step" and e.rank == 0:
            now = time.monotonic()
            if now - self._last_print >= self.min_interval_s or d.get("step") in (1, d.get("steps")):
                self._last_print = now
                self.print(self.progress_line(e))
        elif e.kind == "progress" and e.rank == 0:
            now = time.monotonic()
            if now - self._last_print >= self.quiet_s and integer(d, "step") is not None:
                self._last_print = now
                eta = self.state.eta_s()
                self.print(f"step {integer(d, 'step')}/{self.state.steps or '?'}"
                           + (f"  eta {eta:.0f} s" if eta is not None else ""))
        elif e.kind in ("eval", "checkpoint") or e.kind == "error" and not d.get("user_error"):
            for line in describe(e):  # user errors: the launcher's one line says it
                self.print(line)
        elif e.kind == "model_ready" and e.rank == 0:
            for line in describe(e):
                self.print(line.replace(f"[rank {e.rank}] model ready: ", "model: "))
        elif e.kind in ("log", "stopped") and e.rank == 0:
            for line in describe(e):
                self.print(line)
        elif e.kind == "start" and e.rank == 0:
            self.print(f"{count(d.get('world_size', '?'), 'rank')} started (torch {d.get('torch', '?')}"
                       + "".join(f", {d[k]}" for k in ("device", "allocator") if d.get(k)) + ")")
        if e.kind == "start" and d.get("allocator"):
            self._other_allocators(e)
        if e.kind == "phase":
            self._waiting(e.time)

    def _waiting(self, when: float) -> None:
        """A line when the slowest rank's phase changes (Note [Rank phases] in telemetry/phases.py): what the
        job waits for before its first step, once each."""
        waiting = slowest(self.state.ranks.values())
        if waiting is not None and waiting.phase not in (self._phase, "starting"):
            self._phase = waiting.phase
            self.print(waiting.line(when, self.state.started))

    def _other_allocators(self, e: Event) -> None:
        """A line for each rank whose allocator is not rank 0's (Note [Rank allocator]: each node preloads
        tcmalloc only if it has it), once rank 0's start event is in."""
        self._allocators[e.rank] = (str(e.data["allocator"]), str(e.data.get("host", "?")))
        if 0 not in self._allocators:
            return
        first = self._allocators[0][0]
        for rank, (allocator, host) in sorted(self._allocators.items()):
            if allocator != first and rank not in self._told:
                self._told.add(rank)
                self.print(f"rank {rank} on {host} runs under {allocator}, rank 0 under {first} "
                           "(install the same allocator on every node for comparable memory and speed)")

    def progress_line(self, e: Event) -> str:
        """``step 20/400  loss 3.1927  lr 1.50e-03  grad 1.799  156 ms/step  102.5 samples/s ...``: rank
        ``e.rank``'s step event, with the job-wide rates, ETA and any straggler or memory alert."""
        d, s = e.data, self.state
        steps = integer(d, "steps") or s.steps or "?"
        parts = [f"step {integer(d, 'step') or '?':>{len(str(steps))}}/{steps}"]
        for key, fmt in (("loss", "loss {:.4f}"), ("lr", "lr {:.2e}"), ("grad_norm", "grad {:.3f}")):
            if number(d, key) is not None:
                parts.append(fmt.format(number(d, key)))
        if number(d, "step_time_s"):
            parts.append(f"{number(d, 'step_time_s') * 1e3:.0f} ms/step")
        for key, unit in (("job_samples_per_s", "samples/s"), ("job_tokens_per_s", "tok/s")):
            if number(d, key) is not None and (number(d, key) or unit != "tok/s"):  # no token ids: no tok/s
                parts.append(f"{human_rate(number(d, key))} {unit}")
        if number(d, "rss_bytes") is not None:
            parts.append(f"rss {human_bytes(number(d, 'rss_bytes'))}")
        skipped, scale = integer(d, "skipped_steps"), number(d, "loss_scale")
        if skipped:  # fp16 overflows: a run whose every step was skipped looked normal (a review)
            parts.append(f"skipped {skipped}" + (f" (fp16 overflow, loss scale {scale:g})" if scale else ""))
        eta = s.eta_s()
        if eta is not None:
            parts.append(f"eta {eta:.0f} s")
        if s.straggler() is not None:
            parts.append(f"straggler: rank {s.straggler()}")
        if s.memory_alerts():
            parts.append("memory > 90%: rank " + ", ".join(map(str, sorted(s.memory_alerts()))))
        return "  ".join(parts)

    def line(self, node_rank: int, line: str) -> None:
        for shown in self.state.add_line(node_rank, line):  # torchrun's stop traceback folded (telemetry/logtail.py)
            # a node watcher's note (launch/node.py: the slow allocator fallback) is shown as rank output is
            if shown.startswith("[rank ") or " job interrupted: " in shown or _NODE_NOTE.match(shown):
                self.print(shown)

    def print(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        """Print the summary table (plain text when ``out`` is not a terminal)."""
        print_summary(self.state, self.out)
        self.out.flush()
