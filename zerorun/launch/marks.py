"""The names that the launcher and the node side (the watcher, launch/node.py; torchrun's wrapper,
launch/torchrun.py) share: the variables that mark a job's processes, the node folder's placeholder, the
``@zerorun-node`` note prefix, and finding and signalling marked processes. Imports nothing of zerorun, so
both sides import it without a circle."""

from __future__ import annotations

import os
import signal

import psutil

#: environment variable that marks every process of one job (teardown finds them by it).
JOB_ENV = "ZERORUN_JOB_ID"

#: environment variable marking every process of one node of one job (``JOB_ID:NODE_RANK``): on a machine that
#: runs several nodes of a job, stopping one node must not stop the others.
NODE_ENV = "ZERORUN_NODE"

#: in a spec's argv, replaced by the node's private folder (recipe file, torchrun's logs).
NODE_DIR = "{node_dir}"

#: prefix of a node's note line (JSON): why its watcher says it ended (``reason``, launch/node.py), a rank that
#: ended on its own, torchrun's failure report (Note [Rank exits], Note [Failure report] in launch/torchrun.py).
NOTE_PREFIX = "@zerorun-node "


def signal_name(sig: int) -> str:
    """``SIGKILL`` for 9; ``signal 99`` for a number that names no signal."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def marked_processes(job_id: str, key: str = JOB_ENV) -> list[psutil.Process]:
    """Processes on this machine marked with ``job_id`` in their environment (variable ``key``, default
    :data:`JOB_ENV`), however they were started: torchrun starts its workers in sessions of their own, so a
    process group alone misses them."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(key) == job_id:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def signal_marked(job_id: str, sig: int) -> int:
    """Send ``sig`` to every process marked with ``job_id``; return how many there were (0: none left)."""
    procs = marked_processes(job_id)
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return len(procs)
