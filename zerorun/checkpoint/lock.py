"""One job at a time in a checkpoint folder: the launcher's lock file (saving itself is ``saving.py``'s).

Note [Checkpoint folder lock]: two jobs saving into one ``checkpoint.dir`` (two runs of a recipe name share the
default ``<log.dir>/<name>/checkpoints``) replace each other's ``step-N`` folders without a word, and
``--resume`` then continues the other job's model. So ``zerorun train`` takes the folder before any rank
starts: it creates ``.zerorun-lock`` in it with ``O_CREAT | O_EXCL`` (atomic on local file systems and on
NFSv3+, where checkpoint folders of multi-node jobs live), holding the job id, recipe name, host, pid and the
process's start time, and removes it when the job ends, however it ends (Ctrl-C, SIGTERM, a failed rank). A
second job finding the file is refused in one line naming the other job, its host and pid, unless that job is
known to be gone:

* on this host, no process with that pid and start time (a launcher killed with SIGKILL, a crashed machine
  that rebooted; the start time tells a reused pid apart);
* the same SLURM job id as this job with fewer restarts (``SLURM_RESTART_COUNT``: the batch job requeued
  after its node failed, now on another node); two job steps of one allocation on one folder are two jobs.

A stale lock is moved aside with ``os.rename`` (of two jobs taking it over at once, one rename succeeds) and
the job takes the folder. A job on another host cannot be checked from here: the message says to remove the
file once that job is gone. Taking the folder, the job also removes what saves of ended jobs left
(``.step-N.<job>.tmp``: Note [Atomic checkpoints]); while it runs, a save removes only its own job's leftovers.
``--resume`` of a job is allowed once the job ended, since its lock is gone or stale then.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import time
from contextlib import contextmanager
from typing import Any, Iterator

from zerorun.errors import ZerorunError

LOCK = ".zerorun-lock"
_LEFTOVER = re.compile(r"\.step-\d+(\.[\w-]+)?(\.old)?\.tmp")  # fullmatch: a save's folder (saving.py)


def _started(pid: int) -> float | None:
    """The start time of process ``pid`` on this host (seconds since the epoch), ``None`` when there is none."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:  # another user's process: it exists
        return 0.0


def _restarts() -> int:
    """How often SLURM requeued this batch job (``SLURM_RESTART_COUNT``; 0 outside SLURM)."""
    text = os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(text) if text.isdigit() else 0


def _gone(holder: dict[str, Any]) -> bool:
    """Whether the job of the lock ``holder`` has certainly ended (Note [Checkpoint folder lock])."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        started = _started(holder["pid"])
        return started is None or (bool(started) and abs(started - float(holder.get("pid_started") or 0)) > 1.0)
    slurm, restarts = os.environ.get("SLURM_JOB_ID"), holder.get("slurm_restarts")
    return bool(slurm) and holder.get("slurm_job") == slurm and isinstance(restarts, int) and restarts < _restarts()


def _read(path: str) -> dict[str, Any] | None:
    """The lock file's content; ``None`` while it is missing, being written or not a zerorun lock."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "a job whose lock file cannot be read"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started") or 0)))
    return (f"job {holder.get('job')} ({holder.get('name')}) on host {holder.get('host')}, pid {holder.get('pid')}, "
            f"since {since}")


def acquire(folder: str, job_id: str, name: str) -> str:
    """Take the checkpoint folder ``folder`` (made already) for job ``job_id`` of recipe ``name``, then remove
    the leftovers of ended jobs' saves (Note [Checkpoint folder lock]).

    Returns:
        The lock file's path.

    Raises:
        ZerorunError: one line: the folder is in use by another job (named), or the lock cannot be written.
    """
    path = os.path.join(folder, LOCK)
    me = {"job": job_id, "name": name, "host": socket.gethostname(), "pid": os.getpid(),
          "pid_started": _started(os.getpid()), "started": time.time(),
          "slurm_job": os.environ.get("SLURM_JOB_ID"), "slurm_restarts": _restarts()}
    for _ in range(20):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None or not _gone(holder):
                if holder is None and time.time() - _mtime(path) < 2.0:
                    time.sleep(0.1)  # being written by a job starting this moment
                    continue
                raise ZerorunError(f"checkpoint.dir {folder}: in use by {_describe(holder)}: one job at a time "
                                   f"saves into a folder (if that job is gone, remove {path})")
            _take_over(path, holder)
            continue
        except OSError as e:
            raise ZerorunError(f"checkpoint.dir {folder}: cannot create the lock file {path}: {e.strerror}") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(me, f)
        _remove_leftovers(folder)
        return path
    raise ZerorunError(f"checkpoint.dir {folder}: cannot take the lock {path}: other jobs keep changing it")


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def _take_over(path: str, holder: dict[str, Any]) -> None:
    """Move the stale lock ``path`` (of ``holder``) aside; a lock that changed in between is put back."""
    aside = f"{path}.stale-{socket.gethostname()}-{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another job took it over first
        return
    if _read(aside) != holder:  # a fresh lock written in between: not ours to remove
        with contextlib.suppress(OSError):
            os.link(aside, path)
    with contextlib.suppress(OSError):
        os.remove(aside)


def _remove_leftovers(folder: str) -> None:
    """Remove the ``.step-N.<job>.tmp`` folders of saves of ended jobs (the lock is held: no other job saves)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if _LEFTOVER.fullmatch(name):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def release(path: str, job_id: str) -> None:
    """Remove the lock file ``path`` if it is still job ``job_id``'s from this process."""
    holder = _read(path)
    if holder is not None and holder.get("job") == job_id and holder.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            os.remove(path)


@contextmanager
def held(folder: str | None, job_id: str, name: str) -> Iterator[None]:
    """Hold the lock of checkpoint folder ``folder`` (nothing when ``None``) for the ``with`` block.

    Raises:
        ZerorunError: as :func:`acquire`.
    """
    if not folder:
        yield
        return
    path = acquire(folder, job_id, name)
    try:
        yield
    finally:
        release(path, job_id)
