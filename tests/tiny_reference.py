"""The uninterrupted reference job that several end-to-end tests compare their jobs with, run once per session
(the ``tiny_reference`` fixture in conftest.py): recipes/tiny.yaml on this machine, 2 local ranks, no SLURM, no
SSH, no checkpoint, with :data:`RECIPE`. A job that compares itself with it trains with :data:`RECIPE` too
(its own launcher, hosts or interruptions on top), so that only what the test varies differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

STEPS = 80
#: the tiny recipe, long enough to be stopped in the middle (steps of 15-50 ms: test_slurm_launch's scancel after
#: step 5 must land before the last step, which 40 steps left to about half a second on an idle machine; a step
#: costs the other users little), no evaluation, a step event every step, one OMP thread per rank (2 ranks on
#: 2 cores)
RECIPE = [f"train.steps={STEPS}", "train.eval_every=0", "log.every=1", 'launch.env={OMP_NUM_THREADS: "1"}']

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")


def run(log_dir: str) -> dict[int, float]:
    """Train the reference job into ``log_dir``; rank 0's loss of every step, by step."""
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", TINY, *RECIPE, "launch.procs_per_node=2",
                          f"log.dir={log_dir}", "--launcher", "local", "--no-dashboard"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240,
                         env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert out.returncode == 0, out.stdout + out.stderr
    [metrics] = [os.path.join(root, "metrics.jsonl") for root, _, files in os.walk(log_dir)
                 if "metrics.jsonl" in files]
    with open(metrics) as f:
        events = [json.loads(line) for line in f]
    found = {e["step"]: e["loss"] for e in events if e["event"] == "step" and e["rank"] == 0}
    assert sorted(found) == list(range(1, STEPS + 1))
    return found
