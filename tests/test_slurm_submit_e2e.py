"""``zerorun submit`` / ``attach`` / ``show`` against a real SLURM cluster on loopback (tests/slurm_cluster.py:
slurmctld + two slurmd, the session's ``slurm_cluster`` fixture). One batch job of 2 nodes x 1 rank trains and
serves the asserts of submit, attach and show; the other cases submit nothing that runs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def zerorun(cluster, tmp_path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = cluster.client_env(XDG_STATE_HOME=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "zerorun", *args], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_refused_unknown_and_pending_jobs(slurm_cluster, tmp_path):
    """sbatch's refusal and an unknown job id are one line each; attach on a held job says it is pending and
    Ctrl-C leaves the job queued."""
    out = zerorun(slurm_cluster, tmp_path, "submit", TINY, "--nodes", "2", "--partition", "nope",
                  f"log.dir={tmp_path / 'refused'}")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("zerorun: error: sbatch refused the job: ") and "partition" in out.stderr
    assert not (tmp_path / "refused").exists()  # nothing queued: no run folder left (issue 34 item 15)
    # more nodes than the partition has: queued, pending for ever without a word (a review)
    before = slurm_cluster.jobs()
    for args in (["--nodes", "5"], ["--nodes", "3", "--", "--partition=debug"]):
        out = zerorun(slurm_cluster, tmp_path, "submit", TINY, *args[:2], f"log.dir={tmp_path / 'too-many'}",
                      *args[2:])
        assert out.returncode == 2 and out.stderr.splitlines() == [
            f"zerorun: error: --nodes {args[1]}: partition debug has 2 nodes, so the job could never start (SLURM "
            "would queue it pending for ever: PartitionConfig)"], out.stderr
    assert not (tmp_path / "too-many").exists() and slurm_cluster.jobs() == before
    # a node drained for maintenance: queued as before, to wait for it (a review of the first fix, sbatch
    # --test-only, which refused it)
    slurm_cluster.run("scontrol", "update", f"nodename={slurm_cluster.nodes[-1]}", "state=drain", "reason=maint")
    try:
        out = zerorun(slurm_cluster, tmp_path, "submit", TINY, "--nodes", "2", f"log.dir={tmp_path / 'drained'}",
                      "--", "--hold")
        assert out.returncode == 0 and "zerorun: submitted job " in out.stdout, out.stderr
        slurm_cluster.run("scancel", out.stdout.split("submitted job ")[1].split(":")[0], check=False)
    finally:
        slurm_cluster.run("scontrol", "update", f"nodename={slurm_cluster.nodes[-1]}", "state=resume", check=False)
    out = zerorun(slurm_cluster, tmp_path, "attach", "987654")
    assert out.returncode == 2 and out.stderr.startswith("zerorun: error: job 987654: unknown to SLURM")
    assert len(out.stderr.splitlines()) == 1

    # a job of your own sbatch script: attach waits for a zerorun train in it to record its run folder; this one
    # runs none, so once it ends that is one line
    other = slurm_cluster.run("sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 1").stdout.strip()
    out = zerorun(slurm_cluster, tmp_path, "attach", other, timeout=60)
    assert out.stdout.startswith(f"zerorun: job {other} is ") and "waiting for zerorun train" in out.stdout
    assert out.returncode == 2 and out.stderr == (f"zerorun: error: job {other} ended (COMPLETED) and no zerorun "
                                                  "train in it recorded a run folder\n")

    out = zerorun(slurm_cluster, tmp_path, "submit", TINY, "--nodes", "2", "--", "--hold")
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.split("submitted job ", 1)[1].split(":", 1)[0]
    try:
        env = slurm_cluster.client_env(XDG_STATE_HOME=str(tmp_path / "state"))
        # SIGINT as a terminal gives it, even where pytest itself runs with it ignored (a background job)
        attach = subprocess.Popen([sys.executable, "-m", "zerorun", "attach", job_id], cwd=str(tmp_path), env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        first = attach.stdout.readline()
        assert first.startswith(f"zerorun: job {job_id} is pending (JobHeldUser); waiting for it to start"), first
        attach.send_signal(signal.SIGINT)
        rest, err = attach.communicate(timeout=30)
        assert attach.returncode == 130 and "still queued" in rest, (rest, err)
        assert job_id in slurm_cluster.jobs()
    finally:
        slurm_cluster.run("scancel", job_id, check=False)


def test_submit_trains_on_two_nodes_and_attach_and_show_follow_it(slurm_cluster, tmp_path):
    """One batch job (2 nodes x 1 rank, 6 steps) from ``zerorun submit``: show on its run folder and attach,
    both started at once, wait for it and follow the steps of both ranks to the summary and exit 0; the job's
    metrics are in the run folder submit printed (a log.dir with a space and a % in it); show prints the same
    summary."""
    runs = tmp_path / "runs dir %x"
    out = zerorun(slurm_cluster, tmp_path, "submit", TINY, "--nodes", "2", "--procs-per-node", "1",
                  "train.steps=6", "log.every=1", f"log.dir={runs}", "--time", "00:05:00", "--", "-J", "zr e2e")
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    job_id = first.split("submitted job ", 1)[1].split(":", 1)[0]
    run_dir = first.split("; run dir ", 1)[1]
    assert run_dir.startswith(str(runs / "tiny")) and second == f"zerorun: follow it with: zerorun attach {job_id}"
    env = slurm_cluster.client_env(XDG_STATE_HOME=str(tmp_path / "state"))
    follow = subprocess.Popen([sys.executable, "-m", "zerorun", "show", run_dir], cwd=str(tmp_path), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # show follows it too
    try:
        attach = zerorun(slurm_cluster, tmp_path, "attach", job_id, timeout=150)
        followed, err = follow.communicate(timeout=30)
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
        follow.kill()
    assert follow.returncode == 0 and "step 6/6  loss" in followed, followed + err
    assert followed.splitlines()[-1] == "zerorun: the job finished (exit status 0)"
    assert attach.returncode == 0, attach.stdout + attach.stderr
    lines = attach.stdout.splitlines()
    assert f"zerorun: attached to job {job_id} (RUNNING on 127.0.0.[11-12]); run dir {run_dir}" in lines
    assert any(line.startswith("step 6/6  loss") for line in lines)
    assert lines[-1] == "zerorun: the job finished (exit status 0)"
    table = "\n".join(lines[lines.index("zerorun · tiny · summary"):])
    assert "127.0.0.11     0  done        6" in table and "127.0.0.12     1  done        6" in table

    info = slurm_cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    assert "JobName=zr e2e" in info and re.search(r"JobState=COMPLET(ED|ING) ", info) and "NumNodes=2" in info
    events = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = {(e["rank"], e["step"]) for e in events if e["event"] == "step"}
    assert steps == {(r, s) for r in (0, 1) for s in range(1, 7)}
    job = json.load(open(os.path.join(run_dir, "job.json")))
    assert job["status"] == "ok" and job["rank_hosts"] == {"0": "127.0.0.11", "1": "127.0.0.12"}
    assert job["slurm_job_id"] == job_id  # whose run this was: a folder submitted again holds another's
    assert os.path.isfile(os.path.join(run_dir, f"slurm-{job_id}.out"))  # #SBATCH --output, % kept literal

    show = zerorun(slurm_cluster, tmp_path, "show", run_dir)
    assert show.returncode == 0 and show.stdout.splitlines()[-1] == "zerorun: the job finished (exit status 0)"
    assert table.splitlines() == show.stdout.splitlines()  # the same summary, times and hosts included


def test_attach_to_a_job_that_scancel_stops_exits_143(slurm_cluster, tmp_path):
    """scancel puts the job in COMPLETING at once, while its zerorun train still stops and records how: attach
    follows until then and exits 143 (review: it reported "COMPLETING, exit code 0:0" and exited 0)."""
    import time

    runs = tmp_path / "runs"
    out = zerorun(slurm_cluster, tmp_path, "submit", TINY, "--nodes", "1", "--procs-per-node", "1",
                  "train.steps=100000", "log.every=1", f"log.dir={runs}")
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.split("submitted job ", 1)[1].split(":", 1)[0]
    run_dir = out.stdout.splitlines()[0].split("; run dir ", 1)[1]
    env = slurm_cluster.client_env(XDG_STATE_HOME=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    attach = subprocess.Popen([sys.executable, "-m", "zerorun", "attach", job_id, "--no-dashboard"],
                              cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (os.path.isfile(metrics) and '"step"' in open(metrics).read()):
            time.sleep(0.5)
        slurm_cluster.run("scancel", job_id, check=False)
        rest, err = attach.communicate(timeout=90)
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
        attach.kill()
    assert attach.returncode == 143, rest[-2000:] + err
    assert rest.splitlines()[-1].startswith("zerorun: the job was interrupted"), rest[-500:]
    assert json.load(open(os.path.join(run_dir, "job.json")))["slurm_job_id"] == job_id


def _wait(what: str, ready, timeout: float = 120.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = ready()
        if found:
            return found
        assert proc is None or proc.poll() is None, proc.communicate()
        time.sleep(0.3)
    pytest.fail(f"no {what} in {timeout:.0f} s")


def _events(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _stopped_steps(run_dir: str) -> list[int]:
    return [e["step"] for e in _events(run_dir) if e["event"] == "stopped" and e["rank"] == 0]


def _state(cluster, job_id: str) -> str:
    return cluster.run("scontrol", "show", "job", "-o", job_id).stdout.split("JobState=", 1)[1].split()[0]


def test_attach_across_a_requeue_and_the_early_save_signal(slurm_cluster, tmp_path):
    """Issue 34 items 14 and 15 on the cluster, one submitted job (2 nodes x 1 rank, checkpoints, --resume),
    attach following it from the start:
    1. SLURM requeues it mid-run (``scontrol requeue``): the ranks save, the job waits (BeginTime, cut short
       here with ``scontrol update StartTime=now``); attach keeps following (was: exit 143 while pending) into
       the next run, which resumes from that checkpoint;
    2. SIGUSR1 to the batch shell only (``scancel --batch --signal=USR1``: what ``--signal=B:USR1@S`` sends
       before the time limit) makes every rank save and stop (was: the launcher died of SIGUSR1, nothing
       saved): exit 143, the message naming the resubmit; attach exits with it.
    slurm-JOBID.out keeps both runs' lines (--open-mode=append); every step ran once."""
    steps, ck = 150, tmp_path / "ck"
    out = zerorun(slurm_cluster, tmp_path, "submit", TINY, "--nodes", "2", "--procs-per-node", "1",
                  f"train.steps={steps}", "train.eval_every=0", "log.every=1", f"log.dir={tmp_path / 'runs'}",
                  f"checkpoint.dir={ck}", "--resume")
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.split("submitted job ", 1)[1].split(":", 1)[0]
    run_dir = out.stdout.splitlines()[0].split("; run dir ", 1)[1]
    script = os.path.join(run_dir, "submit.sbatch")
    assert "#SBATCH --signal=B:USR1@120" in open(script).read()
    env = slurm_cluster.client_env(XDG_STATE_HOME=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    attach = subprocess.Popen([sys.executable, "-m", "zerorun", "attach", job_id, "--no-dashboard"],
                              cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait("step 3", lambda: any(e["event"] == "step" and e["step"] >= 3 for e in _events(run_dir)), 240, attach)
        slurm_cluster.run("scontrol", "requeue", job_id)
        _wait("the first run's save", lambda: _stopped_steps(run_dir), 60, attach)
        _wait("pending requeued job", lambda: _state(slurm_cluster, job_id) == "PENDING", 60, attach)
        time.sleep(3 * 1.0)  # three of attach's polls while the job is pending
        assert attach.poll() is None, attach.communicate()  # still following the job
        slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        [first] = _stopped_steps(run_dir)
        _wait("the second run's steps", lambda: any(e["event"] == "step" and e["step"] >= first + 3
                                                    for e in _events(run_dir)), 150, attach)
        slurm_cluster.run("scancel", "--batch", "--signal=USR1", job_id)
        rest, err = attach.communicate(timeout=120)
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
        attach.kill()
    assert attach.returncode == 143, rest[-3000:] + err
    assert f"zerorun: SLURM requeued job {job_id} (restart 1); following its next run" in rest
    assert rest.splitlines()[-1].startswith("zerorun: the job was interrupted"), rest[-1000:]
    first, second = _stopped_steps(run_dir)
    assert first < second < steps and sorted(os.listdir(ck))[-1] == f"step-{second:08d}"
    job = json.load(open(os.path.join(run_dir, "job.json")))
    assert job["exit_code"] == 143 and job["slurm_job_id"] == job_id
    assert (f"stopped by SIGUSR1 after step {second}: every rank saved checkpoint {ck}/step-{second:08d} and "
            f"exited; continue with sbatch {script}") in job["message"]
    done = [(e["rank"], e["step"]) for e in _events(run_dir) if e["event"] == "step"]
    assert sorted(done) == [(r, s) for r in (0, 1) for s in range(1, second + 1)]  # each step once, per rank
    output = open(os.path.join(run_dir, f"slurm-{job_id}.out")).read()
    assert f"stopped by SIGTERM after step {first}" in output and "DUE TO JOB REQUEUE" in output
    assert f"stopped by SIGUSR1 after step {second}" in output
