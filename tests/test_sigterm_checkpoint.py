"""Note [Checkpoint on SIGTERM] (zerorun/stopsignal.py) without SLURM: SIGTERM to the launcher of a local job
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

import pytest

from test_train_e2e import ROOT, TINY, job_id, survivors

pytestmark = pytest.mark.slow


def test_sigterm_to_the_launcher_saves_a_checkpoint_at_a_step_boundary(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "zerorun", "train", TINY, "train.steps=100000",
                             "train.eval_every=0", "log.every=1", f"log.dir={tmp_path / 'runs'}",
                             f"checkpoint.dir={ckpt}", 'launch.env={OMP_NUM_THREADS: "1"}', "--no-dashboard"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    header = proc.stdout.readline()
    job = job_id(header)
    for line in proc.stdout:
        if line.startswith("step"):
            break
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.time() - t0 < 15, out + err
    run_dir = re.search(r"run dir (\S+)", header).group(1)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        stopped = [e for e in map(json.loads, f) if e["event"] == "stopped"]
    assert {e["rank"] for e in stopped} == {0, 1} and len({e["step"] for e in stopped}) == 1
    step = stopped[0]["step"]
    name = f"step-{step:08d}"
    assert sorted(os.listdir(ckpt)) == [name] and os.path.exists(ckpt / name / "COMPLETE")
    assert f"stopped by SIGTERM after step {step}: every rank saved checkpoint {ckpt / name} and exited" in err
    assert survivors(job) == []
