"""The SLURM launcher against a real two-node cluster on loopback (tests/slurm_cluster.py): zerorun runs inside
``salloc -N2`` as a user runs it, one rank per node, node 127.0.0.11 and 127.0.0.12 (both this machine: SLURM
starts each node's task through that node's slurmd).

SLURM's time limit is stood in for by ``scancel JOB``: both end the job through slurmctld with the same
sequence on every node, SIGCONT and SIGTERM to every process of every step, SIGKILL KillWait seconds later
(5 s here); a real time limit cannot be shorter than a minute, and slurmctld checks it every 30 s."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import psutil
import pytest

from slurm_cluster import ENDLESS_SCRIPT, missing_binaries
from test_train_e2e import ROOT, TINY, job_id, survivors
# RECIPE: the tiny recipe, long enough (STEPS) to be stopped in the middle, no evaluation, a step event every
# step: that of the session's uninterrupted reference job (tests/tiny_reference.py, the ``tiny_reference`` fixture)
from tiny_reference import RECIPE, STEPS

pytestmark = [pytest.mark.slow, pytest.mark.slurm,
              pytest.mark.skipif(bool(missing_binaries()), reason="SLURM not installed (.ci/run installs "
                                                                    "slurmctld slurmd slurm-client munge)")]

ZR = [sys.executable, "-m", "zerorun"]


def salloc(cluster, command: list[str], **popen) -> subprocess.Popen:
    """``salloc -N2 COMMAND`` against ``cluster``, started (not waited for)."""
    return subprocess.Popen(["salloc", "-N2", *command], cwd=ROOT, env=cluster.client_env(OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out:\n{out}\n{err}")


def run_dir(log_dir) -> str:
    [path] = [os.path.join(root) for root, _, files in os.walk(log_dir) if "metrics.jsonl" in files]
    return path


def events(folder: str) -> list[dict]:
    try:
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def losses(folder: str) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(folder) if e["event"] == "step" and e["rank"] == 0}


def wait_for_step(log_dir, step: int, proc: subprocess.Popen, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, finish(proc)
        folders = [root for root, _, files in os.walk(log_dir) if "metrics.jsonl" in files]
        if folders and any(e["event"] == "step" and e.get("step", 0) >= step for e in events(folders[0])):
            return folders[0]
        time.sleep(0.1)
    pytest.fail(f"no step {step} in {timeout} s")


def steps_left(cluster, wait_s: float = 5.0) -> list[str]:
    """Job steps SLURM still lists, after up to ``wait_s`` for its records of ended steps to clear."""
    deadline = time.time() + wait_s
    while True:
        left = cluster.run("squeue", "-h", "--steps", "-o", "%i %T").stdout.splitlines()
        if not left or time.time() > deadline:
            return left
        time.sleep(0.2)


def test_the_allocations_task_counts_are_the_ranks(slurm_cluster, tmp_path):
    """Issue 34 item 11 under real salloc: ``-N2 -n3`` runs 3 ranks, 2 on the first node and 1 on the second
    (was 2 or 4, by the recipe); ``-N1`` (one CPU) and a recipe of 2 ranks per node is one line, exit 2 (was 2
    ranks on one CPU). The dry run shows what the job would start."""
    dry = [*ZR, "train", TINY, *RECIPE, "launch.procs_per_node=1", f"log.dir={tmp_path}", "--dry-run"]
    env = slurm_cluster.client_env(OMP_NUM_THREADS="1")
    out = subprocess.run(["salloc", "-N2", "-n3", *dry], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("2 nodes (127.0.0.11, 127.0.0.12), 3 ranks: 2, 1 per node (from SLURM_TASKS_PER_NODE=2,1; not the "
            "recipe's launch.procs_per_node 1)") in out.stderr
    assert "--nproc-per-node=2 --node-rank=0" in out.stdout and "--nproc-per-node=1 --node-rank=1" in out.stdout
    out = subprocess.run(["salloc", "-N1", *dry[:-2], "launch.procs_per_node=2", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("zerorun")]
    assert out.returncode == 2 and errors == [
        "zerorun: error: launch.procs_per_node 2: more ranks than the 1 CPU SLURM allocated on a node "
        "(SLURM_JOB_CPUS_PER_NODE=1); ask for the tasks (salloc/sbatch --ntasks-per-node=2), or give --num-procs"]


@pytest.fixture
def local_losses(tiny_reference):
    """The same job on this machine, 2 ranks, no SLURM: the reference, step by step (the session's
    ``tiny_reference``, run with this file's RECIPE)."""
    return tiny_reference


def test_salloc_job_equals_local_job(slurm_cluster, local_losses, tmp_path):
    """Inside salloc, zerorun train takes the allocation's two nodes (no -H, no --launcher) and one srun step;
    the losses equal the local job's step for step; the dry run prints the srun command; nothing is left."""
    log_dir = tmp_path / "runs"
    dry = [*ZR, "train", TINY, *RECIPE, "launch.procs_per_node=1", "--dry-run"]
    train = [*ZR, "train", TINY, *RECIPE, "launch.procs_per_node=1", f"log.dir={log_dir}", "--no-dashboard"]
    script = (f"{shlex.join(dry)} > {tmp_path}/dry.txt 2> {tmp_path}/dry.err; echo dry=$? > {tmp_path}/dry.rc; "
              f"{shlex.join(dry[:-1])} --launcher local --dry-run > {tmp_path}/local.txt 2>&1; "
              f"exec {shlex.join(train)}")
    proc = salloc(slurm_cluster, ["bash", "-c", script])
    out, err = finish(proc)
    assert proc.returncode == 0, out + err
    folder = run_dir(log_dir)
    assert losses(folder) == local_losses  # fp32 on gloo, the same two ranks: equal
    job = json.load(open(os.path.join(folder, "job.json")))
    assert job["rank_hosts"] == {"0": "127.0.0.11", "1": "127.0.0.12"} and job["status"] == "ok"
    assert "2 nodes (127.0.0.11, 127.0.0.12), 1 rank per node (from launch.procs_per_node)" in err
    commands = open(os.path.join(folder, "commands.sh")).read()
    srun_line = next(line for line in commands.splitlines() if line.startswith("#   ") and "srun" in line)
    for option in ("--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                   "--nodelist=127.0.0.11,127.0.0.12", "-m zerorun.launch.slurm_task"):
        assert option in srun_line
    assert survivors(job_id(out)) == [] and steps_left(slurm_cluster) == []
    dry_text = open(tmp_path / "dry.txt").read()
    assert open(tmp_path / "dry.rc").read().strip() == "dry=0", open(tmp_path / "dry.err").read()
    assert "--master-addr=127.0.0.11" in dry_text and "srun" in dry_text and "--node-rank=1" in dry_text
    assert "srun" not in open(tmp_path / "local.txt").read()




def test_killed_rank_ends_the_step_naming_rank_and_node(slurm_cluster, tmp_path):
    """SIGKILL of rank 1 (node 127.0.0.12): the launcher names rank 1 on 127.0.0.12, exits 1, and the step is gone
    on every node within 15 s, nothing of the job left."""
    script = tmp_path / "loop.py"
    script.write_text(ENDLESS_SCRIPT)
    proc = salloc(slurm_cluster, [*ZR, "launch", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "runs"),
                                  "--no-dashboard", str(script)])
    wait_for_step(tmp_path / "runs", 3, proc)
    marked = [p for p in psutil.process_iter() if _env(p).get("RANK") == "1" and "ZERORUN_JOB_ID" in _env(p)
              and str(script) in " ".join(p.cmdline())]
    assert len(marked) == 1
    job = _env(marked[0])["ZERORUN_JOB_ID"]
    t0 = time.time()
    marked[0].kill()
    out, err = finish(proc)
    elapsed = time.time() - t0
    assert proc.returncode == 1, out + err
    assert "rank 1 on 127.0.0.12: rank process ended (killed by SIGKILL)" in err, err
    assert elapsed < 15, elapsed
    assert survivors(job) == [] and steps_left(slurm_cluster) == []


def _env(p: psutil.Process) -> dict:
    try:
        return p.environ()
    except (psutil.Error, OSError):
        return {}


def test_time_limit_saves_a_checkpoint_and_resume_equals_uninterrupted(slurm_cluster, local_losses, tmp_path):
    """SLURM ends the job (scancel: SIGTERM to every process of the step, SIGKILL 5 s later, as at the time
    limit): the ranks agree on a step, save it, and the launcher says so (exit 143); --resume in a new
    allocation continues, and the losses of both runs together equal the uninterrupted local job's."""
    ckpt = tmp_path / "ckpt"
    args = [*ZR, "train", TINY, *RECIPE, "launch.procs_per_node=1", f"checkpoint.dir={ckpt}", "--no-dashboard"]
    first = salloc(slurm_cluster, [*args, f"log.dir={tmp_path / 'first'}"])
    folder = wait_for_step(tmp_path / "first", 5, first)
    [job] = [j for j in slurm_cluster.jobs()]
    t0 = time.time()
    slurm_cluster.run("scancel", job)
    out, err = finish(first)
    elapsed = time.time() - t0
    assert first.returncode == 143, out + err
    stopped = [e for e in events(folder) if e["event"] == "stopped"]
    assert {e["rank"] for e in stopped} == {0, 1} and len({e["step"] for e in stopped}) == 1
    step = stopped[0]["step"]
    assert 5 <= step < STEPS
    assert f"stopped by SIGTERM after step {step}: every rank saved checkpoint {ckpt}/step-{step:08d}" in err, err
    assert sorted(os.listdir(ckpt)) == [f"step-{step:08d}"] and os.path.exists(ckpt / f"step-{step:08d}" / "COMPLETE")
    assert elapsed < 15, elapsed
    first_losses = losses(folder)
    assert sorted(first_losses) == list(range(1, step + 1))

    second = salloc(slurm_cluster, [*args, f"log.dir={tmp_path / 'second'}", "--resume"])
    out, err = finish(second)
    assert second.returncode == 0, out + err
    resumed = losses(run_dir(tmp_path / "second"))
    assert sorted(resumed) == list(range(step + 1, STEPS + 1))
    assert {**first_losses, **resumed} == local_losses
    assert steps_left(slurm_cluster) == []
