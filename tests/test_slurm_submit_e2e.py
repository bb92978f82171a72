"""``zerorun submit`` / ``attach`` / ``show`` against a real SLURM cluster on loopback (tests/slurm_cluster.py:
slurmctld + two slurmd, the session's ``slurm_cluster`` fixture). One batch job of 2 nodes x 1 rank trains and
serves the asserts of submit, attach and show; the other cases submit nothing that runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")

pytestmark = pytest.mark.slow


def zerorun(cluster, tmp_path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = cluster.client_env(XDG_STATE_HOME=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "zerorun", *args], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_refused_unknown_and_pending_jobs(slurm_cluster, tmp_path):
    """sbatch's refusal and an unknown job id are one line each; attach on a held job says it is pending and
    Ctrl-C leaves the job queued."""
    out = zerorun(slurm_cluster, tmp_path, "submit", TINY, "--nodes", "2", "--partition", "nope")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("zerorun: error: sbatch refused the job: ") and "partition" in out.stderr
    assert "submit.sbatch)" in out.stderr  # the script stays, to edit and resubmit
    out = zerorun(slurm_cluster, tmp_path, "attach", "987654")
    assert out.returncode == 2 and out.stderr.startswith("zerorun: error: job 987654: unknown to SLURM")
    assert len(out.stderr.splitlines()) == 1

    out = zerorun(slurm_cluster, tmp_path, "submit", TINY, "--nodes", "2", "--", "--hold")
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.split("submitted job ", 1)[1].split(":", 1)[0]
    try:
        env = slurm_cluster.client_env(XDG_STATE_HOME=str(tmp_path / "state"))
        attach = subprocess.Popen([sys.executable, "-m", "zerorun", "attach", job_id], cwd=str(tmp_path), env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = attach.stdout.readline()
        assert first.startswith(f"zerorun: job {job_id} is pending (JobHeldUser); waiting for it to start"), first
        attach.send_signal(signal.SIGINT)
        rest, err = attach.communicate(timeout=30)
        assert attach.returncode == 130 and "still queued" in rest, (rest, err)
        assert job_id in slurm_cluster.jobs()
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
