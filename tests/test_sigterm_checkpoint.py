"""Note [Checkpoint on SIGTERM] (zerorun/rank/stopsignal.py) without SLURM: SIGTERM to the launcher of a local job
with checkpoint.dir set makes every rank save the same step and exit; the launcher names the checkpoint
(exit 143) and nothing is left. (Under SLURM, with --resume equal to an uninterrupted run:
tests/test_slurm_launch.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from test_train_e2e import ROOT, TINY, job_id, survivors
from zerorun.telemetry.jobfiles import load_run

pytestmark = pytest.mark.slow


def test_sigterm_to_the_launcher_saves_a_checkpoint_at_a_step_boundary(tmp_path):
    """Every rank saves the same step; the steps since the last step event are in one more (``log.every`` far
    off: before, steps 2 to the stop were in no event, no tracker, and the summary's rows said step 1)."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "zerorun", "train", TINY, "train.steps=100000",
                             "train.eval_every=0", "log.every=100000", f"log.dir={tmp_path / 'runs'}",
                             f"checkpoint.dir={ckpt}", 'launch.env={OMP_NUM_THREADS: "1"}', "--no-dashboard"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    header = proc.stdout.readline()
    job = job_id(header)
    for line in proc.stdout:
        if line.startswith("step"):
            break
    time.sleep(1.0)  # steps past step 1, the last logged one
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.time() - t0 < 15, out + err
    run_dir = re.search(r"run dir (\S+)", header).group(1)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        events = list(map(json.loads, f))
    stopped = [e for e in events if e["event"] == "stopped"]
    assert {e["rank"] for e in stopped} == {0, 1} and len({e["step"] for e in stopped}) == 1
    step = stopped[0]["step"]
    for rank in (0, 1):
        logged = [e for e in events if e["event"] == "step" and e["rank"] == rank]
        assert logged[-1]["step"] == step > 1 and sum(e["interval_steps"] for e in logged) == step, logged
    assert re.search(rf"localhost\s+0\s+stopped\s+{step}\s", out), out
    name = f"step-{step:08d}"
    assert sorted(os.listdir(ckpt)) == [name] and os.path.exists(ckpt / name / "COMPLETE")
    assert f"stopped by SIGTERM after step {step}: every rank saved checkpoint {ckpt / name} and exited" in err
    # issue 34 item 10: the stop's save is a checkpoint like any other, in metrics.jsonl and the summary
    assert [(e["step"], e["path"]) for e in events if e["event"] == "checkpoint"] == [(step, str(ckpt / name))]
    assert re.search(rf"last checkpoint\s+step {step}: ", out), out  # the path may wrap at the output's width
    assert load_run(run_dir)[0].checkpoints[-1]["path"] == str(ckpt / name)
    assert survivors(job) == []


def rank_process(job: str, rank: int) -> psutil.Process:
    """The worker process of ``rank`` in ``job``."""
    for p in psutil.process_iter():
        try:
            if p.environ().get("ZERORUN_JOB_ID") == job and p.environ().get("RANK") == str(rank) and \
                    "zerorun.rank.worker" in p.cmdline():
                return p
        except (psutil.Error, OSError):
            pass
    raise AssertionError(f"rank {rank} of job {job} not found")


def test_sigterm_to_one_rank_is_named_and_its_save_is_the_last_checkpoint(tmp_path):
    """Issue 34 items 9 and 10: SIGTERM to rank 1 alone (not the launcher) stops every rank at one step with a
    checkpoint; the error names rank 1 and its host, and the summary's last checkpoint is that save, not the
    periodic one before it."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "zerorun", "train", TINY, "train.steps=100000",
                             "train.eval_every=0", "log.every=1", f"log.dir={tmp_path / 'runs'}",
                             f"checkpoint.dir={ckpt}", "checkpoint.every=2",
                             'launch.env={OMP_NUM_THREADS: "1"}', "--no-dashboard"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    header = proc.stdout.readline()
    job = job_id(header)
    for line in proc.stdout:
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= 3:
            break
    rank_process(job, 1).send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, out + err
    run_dir = re.search(r"run dir (\S+)", header).group(1)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        events = list(map(json.loads, f))
    [step] = {e["step"] for e in events if e["event"] == "stopped"}
    path = str(ckpt / f"step-{step:08d}")
    assert err.startswith(f"zerorun: error: rank 1 on localhost: stopped by SIGTERM (sent to rank 1) after step "
                          f"{step}: every rank saved checkpoint {path} and exited"), err
    saved = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert saved == sorted(set(saved)) and saved[-1] == step and len(saved) >= 2, saved
    assert re.search(rf"last checkpoint\s+step {step}: ", out), out
    assert load_run(run_dir)[0].checkpoints[-1]["path"] == path
    assert survivors(job) == []
