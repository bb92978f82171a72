"""One job at a time in a checkpoint folder (Note [Checkpoint folder lock] in zerorun/checkpoint/lock.py): the
lock file, its refusal in one line before any rank starts, and stale locks after a crash."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from zerorun.checkpoint import lock as checkpoint_lock
from zerorun.checkpoint.lock import LOCK
from zerorun.errors import ZerorunError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = ("import sys, time; from zerorun.checkpoint import lock as c; c.acquire(sys.argv[1], 'aaaaaaaaaaaa', 'first');"
        " print('held', flush=True); time.sleep(600)")


@pytest.fixture
def holder(tmp_path):
    """A process holding the lock of ``tmp_path/ckpt`` as job aaaaaaaaaaaa (recipe 'first')."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.stdout.readline().strip() == "held"
    yield folder, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_second_job_is_refused_naming_the_first(holder):
    folder, proc = holder
    with pytest.raises(ZerorunError) as e:
        checkpoint_lock.acquire(str(folder), "bbbbbbbbbbbb", "second")
    assert str(e.value).startswith(f"checkpoint.dir {folder}: in use by job aaaaaaaaaaaa (first) on host "
                                   f"{socket.gethostname()}, pid {proc.pid}, since "), str(e.value)
    assert f"remove {folder / LOCK}" in str(e.value) and "\n" not in str(e.value)
    assert json.loads((folder / LOCK).read_text())["job"] == "aaaaaaaaaaaa"  # the first job's lock untouched


def test_train_on_a_folder_in_use_exits_in_one_line_before_any_rank(holder, tmp_path):
    """`zerorun train` with the folder of a running job: exit 2 (as other bad input), one line, no run folder,
    nothing saved."""
    folder, proc = holder
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", "recipes/tiny.yaml", "--no-dashboard",
                          f"log.dir={tmp_path / 'runs'}", f"checkpoint.dir={folder}", "train.steps=2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().count("\n") == 0 and f"pid {proc.pid}" in out.stderr, out.stderr
    assert "in use by job aaaaaaaaaaaa (first)" in out.stderr
    assert not (tmp_path / "runs").exists() and os.listdir(folder) == [LOCK]
    resumed = subprocess.run([sys.executable, "-m", "zerorun", "train", "recipes/tiny.yaml", "--no-dashboard",
                              f"log.dir={tmp_path / 'runs'}", f"checkpoint.dir={folder}", "--resume"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    # refused before it says where it would start ("no checkpoint in ... yet: starting from step 0")
    assert resumed.returncode == 2 and resumed.stdout == "", resumed.stdout + resumed.stderr
    assert resumed.stderr.strip().count("\n") == 0 and "in use by job aaaaaaaaaaaa" in resumed.stderr


def test_lock_of_a_killed_job_is_stale_and_taken_over(holder, tmp_path):
    folder, proc = holder
    leftover = folder / ".step-00000010.aaaaaaaaaaaa.tmp"  # its save cut short
    leftover.mkdir()
    (folder / ".step-00000005.tmp").mkdir()  # a save of a zerorun before per-job names
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    path = checkpoint_lock.acquire(str(folder), "bbbbbbbbbbbb", "second")
    assert json.loads((folder / LOCK).read_text())["job"] == "bbbbbbbbbbbb"
    assert sorted(os.listdir(folder)) == [LOCK]  # the ended jobs' leftovers removed, nothing set aside
    checkpoint_lock.release(path, "bbbbbbbbbbbb")
    assert os.listdir(folder) == []


def _lock(folder, **fields) -> None:
    value = {"job": "cccccccccccc", "name": "other", "host": socket.gethostname(), "pid": os.getpid(),
             "pid_started": 0.0, "started": time.time(), "slurm_job": None, **fields}
    (folder / LOCK).write_text(json.dumps(value))


def test_reused_pid_another_host_and_a_requeued_slurm_job(tmp_path, monkeypatch):
    """A live pid that started after the lock was written is another process (stale); a job on another host
    cannot be checked from here (refused), nor another step of the same SLURM allocation; the same SLURM batch
    job, requeued on another node, takes it over."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    _lock(tmp_path, pid_started=1.0)  # this process's pid, but not this process
    checkpoint_lock.release(checkpoint_lock.acquire(str(tmp_path), "dddddddddddd", "x"), "dddddddddddd")
    _lock(tmp_path, host="node-that-is-not-this-one")
    with pytest.raises(ZerorunError, match="in use by job cccccccccccc .other. on host node-that-is-not-this-one"):
        checkpoint_lock.acquire(str(tmp_path), "dddddddddddd", "x")
    _lock(tmp_path, host="node-that-is-not-this-one", slurm_job="4242", slurm_restarts=0)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # another step of the same allocation: a job of its own
    with pytest.raises(ZerorunError, match="in use by job cccccccccccc"):
        checkpoint_lock.acquire(str(tmp_path), "dddddddddddd", "x")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the batch job requeued
    checkpoint_lock.acquire(str(tmp_path), "dddddddddddd", "x")
    assert json.loads((tmp_path / LOCK).read_text())["job"] == "dddddddddddd"


def test_release_leaves_another_jobs_lock(tmp_path):
    path = checkpoint_lock.acquire(str(tmp_path), "eeeeeeeeeeee", "x")
    _lock(tmp_path)  # replaced (by hand) with another job's
    checkpoint_lock.release(path, "eeeeeeeeeeee")
    assert json.loads((tmp_path / LOCK).read_text())["job"] == "cccccccccccc"


def test_unwritable_folder_is_one_line(tmp_path):
    with pytest.raises(ZerorunError, match=r"cannot create the lock file .*: No such file or directory"):
        checkpoint_lock.acquire(str(tmp_path / "missing"), "ffffffffffff", "x")
