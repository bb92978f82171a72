"""``zerorun bench --nodes 1,2`` inside a SLURM allocation (issue 19): each count runs on that many of the
allocation's nodes through the slurm launcher, instead of hostfiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zerorun.bench import check_allocation, combinations, parse_nodes
from zerorun.errors import ZerorunError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")


def test_node_counts_and_where_they_may_run(monkeypatch):
    assert parse_nodes("1, 2,2") == [1, 2] and parse_nodes(None) == []
    with pytest.raises(ZerorunError, match="'0' is not a node count"):
        parse_nodes("0,1")
    combos = combinations([], [2], ["ddp"], [1, 2])
    assert [(c.hostfile, c.nodes, c.label) for c in combos] == [
        ("1 node", 1, "ddp"), ("1 node", 1, "stage 2"), ("2 nodes", 2, "ddp"), ("2 nodes", 2, "stage 2")]
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ZerorunError, match="--nodes: counts nodes of a SLURM allocation, and SLURM_JOB_ID is not set"):
        check_allocation([1], [])
    with pytest.raises(ZerorunError, match="--nodes and -H"):
        check_allocation([1], ["hosts"])
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # `srun zerorun bench --nodes 1` (review: hung silently)
    with pytest.raises(ZerorunError, match=r"started inside a SLURM job step \(SLURM_STEP_ID=0: under srun\)"):
        check_allocation([1], [])


@pytest.mark.slow
@pytest.mark.slurm
def test_bench_on_the_first_node_of_an_allocation(slurm_cluster, tmp_path):
    """Under ``salloc -N2``: a count above the allocation's nodes is one line before any job, and ``--nodes 1``
    runs on the allocation's first node through the slurm launcher (one job; the two-node launch is
    test_slurm_submit_e2e.py's and test_slurm_launch.py's)."""
    env = slurm_cluster.client_env(OMP_NUM_THREADS="1", XDG_STATE_HOME=str(tmp_path / "state"))
    out = subprocess.run(["salloc", "-N2", sys.executable, "-m", "zerorun", "bench", TINY, "--nodes", "1,3"],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "zerorun: error: --nodes 3: the allocation has 2 nodes" in out.stderr
    assert not (tmp_path / "runs").exists()  # refused before any job
    out = subprocess.run(["salloc", "-N2", "--ntasks-per-node=1", sys.executable, "-m", "zerorun", "bench", TINY,
                          "--nodes", "1", "--stages", "2", "--steps", "1", "--warmup", "0",
                          f"log.dir={tmp_path}"], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    (bench_dir,) = (tmp_path / "tiny").iterdir()
    rows = json.load(open(bench_dir / "bench.json"))["rows"]
    assert [(r["hostfile"], r["nodes"], r["status"], r["metrics"]["world_size"]["median"]) for r in rows] == [
        ("1 node", 1, "ok", 1)]
    hosts = [json.load(open(os.path.join(r["run_dirs"][0], "job.json")))["rank_hosts"] for r in rows]
    assert hosts == [{"0": "127.0.0.11"}]
    # every zerorun job inside an allocation records its run folder under the job's id, for zerorun attach
    (record,) = (tmp_path / "state" / "zerorun" / "slurm-jobs").iterdir()
    assert json.load(open(record))["run_dir"] == os.path.abspath(rows[-1]["run_dirs"][0])
