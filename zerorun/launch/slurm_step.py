"""The SLURM launcher's runner: one ``srun`` job step for every node of the job (Note [Slurm launcher] in
launch/slurm.py), seen by the supervisor as one :class:`SlurmNode` per node (the ``Node`` protocol of
launch/nodes.py).

Note [Slurm teardown]: srun handles SIGTERM (and a second SIGINT) by killing the step at once (SIGKILL, "srun:
forcing job termination"), so the ranks could not save a checkpoint. The launcher therefore signals the step
through SLURM: ``scancel --signal=TERM JOB.STEP`` reaches every process of the step on every node (as SLURM's
own time limit does), the ranks save and exit, srun ends. SIGKILL, after the supervisor's grace, is
``scancel --signal=KILL JOB.STEP`` and srun's own SIGKILL; "nothing left" is checked with SLURM
(``squeue --steps``), plus the job's marked processes on this machine (proctrack/linuxproc loses processes
that leave their process tree). srun runs in its own session, so a terminal's Ctrl-C reaches the launcher
only, and it gets SIGTERM if the launcher dies (``PR_SET_PDEATHSIG``): it then kills the step. With
``--kill-on-bad-exit`` a node that fails makes SLURM terminate the others (SIGTERM, KillWait, SIGKILL).
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time

from zerorun.errors import ZerorunError
from zerorun.launch.nodes import SCHEDULER_STOP, Ended, Line
from zerorun.launch.marks import JOB_ENV, signal_marked
from zerorun.launch.plan import NodeSpec
from zerorun.launch.runner import node_spec_json
from zerorun.launch.slurm_task import TASK_PREFIX

#: srun --label: ``N: text`` (the task number right-aligned when there are 10 tasks or more)
_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")
#: Note [Long lines through srun]: slurmstepd forwards a task's output in messages of at most 1024 bytes (SLURM's
#: MAX_MSG_LEN, src/common/io_hdr.h), and srun --label prints each as a line of its own, so a longer line (a
#: rank's error event with its traceback) arrives cut into 1024-byte pieces. A labelled piece of exactly that
#: size is joined to the task's next one (a line of exactly 1024 bytes is joined to the next line too: rare).
SLURM_IO_CHUNK = 1024
#: slurmstepd's line when SLURM ends a step: ``slurmstepd-NODE: error: *** STEP 5.0 ON NODE CANCELLED AT <time>
#: [DUE TO TIME LIMIT] ***`` (also after --kill-on-bad-exit and the launcher's own scancel: then not SLURM's doing)
_CANCELLED = re.compile(r"\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT .*\*\*\*")
#: srun's own report of a task: ``srun: error: HOST: task N: Killed`` / ``...: Exited with exit code 3``
_SRUN_TASK = re.compile(r"^srun: error: (\S+): tasks? (\d+)(?:-\d+)?: (.*)$")


def _die_with_launcher() -> None:
    """In srun: SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``): srun then kills the step."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


class SlurmStep:
    """One ``srun`` (``argv``, launch/slurm.py ``srun_argv``) running the nodes of ``specs``; their lines go to
    ``lines`` as ``Line``, a node's end as ``Ended`` (launch/nodes.py)."""

    def __init__(self, argv: list[str], specs: list[NodeSpec], lines: "queue.Queue", cwd: str | None = None) -> None:
        self.argv, self.specs, self.lines, self.cwd = argv, specs, lines, cwd
        self.proc: subprocess.Popen | None = None
        self.step: str | None = None  # "JOB.STEP", from the tasks' first line
        self.task_node: dict[int, int] = {}
        self.ended: dict[int, int] = {}
        self.end_reasons: dict[int, str] = {}
        self.unverified: str | None = None
        #: slurmstepd's line when SLURM itself ended the step (time limit, scancel, preemption), else None
        self.cancelled: str | None = None
        self._task_failed = False
        self._srun_killed = False  # then SLURM is asked whether the step is gone (srun no longer waits for it)
        self._lock = threading.Lock()
        self._signalled: set[int] = set()
        self._checked = (0.0, 0)

    def start(self) -> None:
        """Start srun once (every node's ``start`` calls it) and write the nodes' specs on its standard input,
        which stays open while this process lives (the nodes' launcher watch)."""
        with self._lock:
            if self.proc is not None:
                return
            payload = {"nodes": {s.host.name: {"node_rank": s.node_rank, "spec": json.loads(node_spec_json(s))}
                                 for s in self.specs}}
            try:
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, cwd=self.cwd, start_new_session=True,
                                             text=True, errors="replace", bufsize=1, preexec_fn=_die_with_launcher)
                try:
                    self.proc.stdin.write(json.dumps(payload) + "\n")
                    self.proc.stdin.flush()
                except BrokenPipeError:  # srun ended before it read its input (it refused the step): its own
                    pass  # output, read below, says why, and its exit ends every node
            except OSError as e:
                raise ZerorunError(f"cannot start {self.argv[0]}: {e.strerror}") from None
        threading.Thread(target=self._read, daemon=True).start()

    def _end(self, node: int, code: int) -> None:
        if node not in self.ended:
            self.ended[node] = code
            self.lines.put(Ended(node, code, self.end_reason(node)))

    def end_reason(self, node: int) -> str | None:
        """Why node ``node`` ended when it could not say itself: SLURM ended the step (its time limit, scancel),
        or srun's report of its task; else None."""
        if self.cancelled:
            return f"{SCHEDULER_STOP}: {self.cancelled}"
        return self.end_reasons.get(node)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        partial: dict[int, str] = {}  # task -> the start of a line srun split
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            m = _LABEL.match(line)
            if m is None:  # srun's own line
                t = _SRUN_TASK.match(line)
                self._task_failed |= bool(t) or "Terminating StepId" in line
                node = self.task_node.get(int(t.group(2))) if t else None
                if node is not None and node not in self.ended:  # it could not report its end itself
                    self.end_reasons.setdefault(node, f"its srun task on {t.group(1)}: {t.group(3)}")
                self.lines.put(Line(0, line))
                continue
            task, text = int(m.group(1)), partial.pop(int(m.group(1)), "") + m.group(2)
            if len(m.group(2).encode()) == SLURM_IO_CHUNK:  # Note [Long lines through srun]
                partial[task] = text
                continue
            c = _CANCELLED.search(text)
            if c and self.cancelled is None and not self._signalled and not self._task_failed:
                self.cancelled = c.group(0)
            if text.startswith(TASK_PREFIX):
                try:
                    note = json.loads(text[len(TASK_PREFIX):])
                except ValueError:
                    note = {}
                if "step" in note:
                    self.task_node[task] = int(note["node_rank"])
                    self.step = str(note["step"])
                    continue
                if "exit" in note:
                    self._end(int(note["node_rank"]), int(note["exit"]))
                    continue
            self.lines.put(Line(self.task_node.get(task, task), text))
        code = self.proc.wait()
        for spec in self.specs:  # a node that could not report its end: killed, or never started
            reason = self.end_reasons.get(spec.node_rank)
            own = -signal.SIGKILL if reason and reason.endswith("Killed") else None
            self._end(spec.node_rank, own if own is not None else (code if code != 0 else 1))

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _scancel(self, sig: str) -> None:
        if self.step is None:
            return
        try:
            subprocess.run(["scancel", f"--signal={sig}", self.step], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.unverified = f"scancel --signal={sig} {self.step}: {e}"

    def send(self, sig: int) -> None:
        """Note [Slurm teardown]: SIGTERM/SIGINT through ``scancel --signal=TERM`` (srun itself while the step's
        tasks have not reported yet), SIGKILL through ``scancel --signal=KILL`` and to srun. Once per signal."""
        with self._lock:
            if sig in self._signalled or self.proc is None:
                return
            self._signalled.add(sig)
        if sig == signal.SIGKILL:
            if self.running:
                self._srun_killed = True
                self._scancel("KILL")
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            return
        if not self.running:
            return
        if self.step is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # nothing runs yet: srun kills the step it makes
            except (ProcessLookupError, PermissionError):
                pass
        else:
            self._scancel("TERM")

    def step_alive(self) -> bool:
        """True while SLURM still lists the step (``squeue --steps``); sets ``unverified`` when it cannot say."""
        if self.step is None:
            return False
        job = self.step.split(".")[0]
        try:
            out = subprocess.run(["squeue", "-h", "--steps", f"--jobs={job}", "-o", "%i"], capture_output=True,
                                 text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.unverified = f"squeue: {e}"
            return False
        if out.returncode != 0:
            if "Invalid job id" in out.stderr:  # the job itself is gone
                return False
            self.unverified = f"squeue: {out.stderr.strip() or out.returncode}"
            return False
        return self.step in out.stdout.split()

    def kill_survivors(self, sig: int = signal.SIGKILL) -> int:
        """Kill what is left of the step (srun, the step in SLURM, the job's marked processes on this machine)
        with ``sig``; return how many things were left (0: nothing). Every node calls it: answered once per
        0.2 s."""
        with self._lock:
            last, count = self._checked
            if time.time() - last < 0.2:
                return count
            count = 0
            if self.running:
                count += 1
                self._srun_killed = True
                self._scancel("KILL")
                try:
                    os.killpg(self.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            elif self._srun_killed and self.step_alive():  # srun ended on its own only after every task
                count += 1
                self._scancel("KILL")
            count += signal_marked(self.specs[0].env[JOB_ENV], sig)
            self._checked = (time.time(), count)
            return count


class SlurmNode:
    """One node of a :class:`SlurmStep`, for the supervisor (the ``Node`` protocol of launch/nodes.py)."""

    def __init__(self, spec: NodeSpec, step: SlurmStep) -> None:
        self.spec, self.step = spec, step

    def start(self) -> None:
        self.step.start()

    @property
    def returncode(self) -> int | None:
        return self.step.ended.get(self.spec.node_rank)

    @property
    def end_reason(self) -> str | None:
        """Why the node ended when it could not say itself (:meth:`SlurmStep.end_reason`), else None."""
        return self.step.end_reason(self.spec.node_rank)

    @property
    def unverified(self) -> str | None:
        return self.step.unverified

    def send_signal(self, sig: int) -> None:
        self.step.send(sig)

    def kill_survivors(self, sig: int = signal.SIGKILL) -> int:
        return self.step.kill_survivors(sig)

    def close(self) -> None:
        """Nothing to release (srun ends with the step)."""
