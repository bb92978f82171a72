"""The SLURM test fixture itself: two clusters run at once on their own free ports, jobs reach both nodes,
and stop() leaves no daemon and no job process behind."""

from __future__ import annotations

import subprocess

import psutil
import pytest

from slurm_cluster import missing_binaries, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.slurm,
              pytest.mark.skipif(bool(missing_binaries()), reason="SLURM not installed (.ci/run installs "
                                                                    "slurmctld slurmd slurm-client munge)")]


def test_two_clusters_at_once_and_stop_leaves_nothing(tmp_path, slurm_cluster):
    other = start_cluster(str(tmp_path / "other"), nodes=1, cpus_per_node=1)
    try:
        assert set(other.pids()) == {"munged", "slurmctld", "slurmd-127.0.0.11"}
        assert other.ctld_port != slurm_cluster.ctld_port
        assert not set(other.slurmd_ports) & set(slurm_cluster.slurmd_ports)
        for cluster, nodes in ((slurm_cluster, 2), (other, 1)):
            out = subprocess.run(["srun", f"-N{nodes}", f"-n{nodes}", "printenv", "SLURMD_NODENAME"],
                                 env=cluster.client_env(), capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert sorted(out.stdout.split()) == cluster.nodes
        marker = f"zr-fixture-{tmp_path.name}"
        job = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", f"exec -a {marker} sleep 300"],
                             env=other.client_env(), capture_output=True, text=True, timeout=30, check=True)
        # the srun above may still be listed, completing, on a loaded machine (seen: ['1', '2'])
        assert job.stdout.strip().split(";")[0] in other.jobs()
        daemons = list(other.pids().values())
    finally:
        other.stop()
    assert not [pid for pid in daemons if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and marker in p.info["cmdline"][0]]
    # the session's cluster is untouched by the other's stop
    assert slurm_cluster.run("scontrol", "ping").stdout.count("is UP") == 1
