"""Running one node's command and streaming its output lines.

``LocalNode`` runs the node's torchrun command as a local subprocess in its own session (process group);
every line it prints (stdout and stderr merged) is put on a shared queue as a ``Line``, and its end as an
``Ended`` (Note [Node messages] in launch/nodes.py).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading

from zerorun.errors import ZerorunError
from zerorun.launch.marks import JOB_ENV, marked_processes, signal_marked, signal_name
from zerorun.launch.nodes import Ended, Line
from zerorun.launch.plan import NodeSpec


class LocalNode:
    """A node run on this machine without SSH (the ``Node`` protocol of launch/nodes.py)."""

    unverified: str | None = None  # this machine is always reachable

    def __init__(self, spec: NodeSpec, lines: "queue.Queue", cwd: str | None = None) -> None:
        self.spec = spec
        self.lines = lines
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.end_reason: str | None = None  # set when the node's watcher itself was killed

    def start(self) -> None:
        """Start the node's watcher (Note [Node watcher] in launch/node.py) with the node's spec on its standard
        input, which stays open while this process lives; a reader thread streams its lines to the queue."""
        try:
            self.proc = subprocess.Popen(watcher_argv(self.spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.PIPE, cwd=self.cwd, start_new_session=True,
                                         text=True, errors="replace", bufsize=1)
            self.proc.stdin.write(node_spec_json(self.spec) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise ZerorunError(f"node {self.spec.node_rank} ({self.spec.host.name}): cannot start "
                               f"{self.spec.argv[0]} in {self.cwd or os.getcwd()}: {e.strerror}") from None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(Line(self.spec.node_rank, line.rstrip("\n")))
        self.returncode = self.proc.wait()
        if self.returncode < 0:  # the watcher turns torchrun's signals into 128 + N: this one is its own
            self.end_reason = f"its watcher was killed by {signal_name(-self.returncode)}"
        self.lines.put(Ended(self.spec.node_rank, self.returncode, self.end_reason))

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the node's process group (torchrun and what stayed in its group)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> None:
        """Nothing to release."""

    def survivors(self) -> list:
        """Processes on this machine marked with this job's id (:func:`marked_processes`)."""
        return marked_processes(self.spec.env[JOB_ENV])

    def kill_survivors(self, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to every surviving process of the job; return how many there were."""
        return signal_marked(self.spec.env[JOB_ENV], sig)


def watcher_argv(spec: NodeSpec, spec_fd: int | None = None) -> list[str]:
    """The command line of a node's watcher (launch/node.py), with the node's interpreter: no values in it."""
    return [spec.argv[0], "-m", "zerorun.launch.node"] + (["--spec-fd", str(spec_fd)] if spec_fd is not None else [])


def node_spec_json(spec: NodeSpec) -> str:
    """The node's spec for its watcher, as one line of JSON: torchrun's argv, the node's env, its private files
    (the recipe) and its mark (Note [Node watcher])."""
    return json.dumps({"argv": spec.argv, "env": spec.env, "files": spec.files,
                       "mark": f"{spec.env[JOB_ENV]}:{spec.node_rank}"})
