"""How a job under the SLURM launcher ends under each fault, on a throwaway two-node loopback cluster
(tests/slurm_cluster.py; needs slurmctld, slurmd, slurm-client and munge, as root).

``salloc -N2 zerorun launch --nproc-per-node 1 loop.py`` (a script that all-reduces every 0.05 s); once rank 1
reported step 3, the fault is applied; measured from the fault: when the launcher exited, when SLURM listed
no step and no process of the job was left on this machine; the exit code and zerorun's line.

    python benchmarks/slurm_teardown.py --out benchmarks/results/slurm_teardown.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from slurm_cluster import ENDLESS_SCRIPT, start_cluster  # noqa: E402

FAULTS = ["kill -9 of rank 1", "launcher SIGINT", "launcher SIGTERM", "launcher SIGUSR1", "launcher SIGKILL",
          "scancel of the job (as the time limit)"]


def _env(p) -> dict:
    try:
        return p.environ()
    except (psutil.Error, OSError):
        return {}


def marked(job: str | None) -> list[psutil.Process]:
    return [p for p in psutil.process_iter() if job and _env(p).get("ZERORUN_JOB_ID") == job]


def one(cluster, folder: str, fault: str) -> dict:
    logs = os.path.join(folder, "runs")
    proc = subprocess.Popen(["salloc", "-N2", sys.executable, "-m", "zerorun", "launch", "--nproc-per-node", "1",
                             "--log-dir", logs, "--no-dashboard", os.path.join(folder, "loop.py")], cwd=ROOT,
                            env=cluster.client_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    ranks = []
    deadline = time.time() + 180
    while time.time() < deadline and not ranks:
        ranks = [p for p in psutil.process_iter() if _env(p).get("RANK") == "1" and "ZERORUN_JOB_ID" in _env(p)
                 and "loop.py" in " ".join(p.cmdline())]
        time.sleep(0.2)
    job = _env(ranks[0]).get("ZERORUN_JOB_ID")
    time.sleep(2.0)  # a few steps
    launcher = [p for p in psutil.Process(proc.pid).children() if "zerorun" in " ".join(p.cmdline())][0]
    t0 = time.time()
    if fault.startswith("kill -9"):
        ranks[0].kill()
    elif fault == "launcher SIGINT":
        launcher.send_signal(signal.SIGINT)
    elif fault == "launcher SIGTERM":
        launcher.send_signal(signal.SIGTERM)
    elif fault == "launcher SIGUSR1":  # the early save signal (--signal=B:USR1@S); loop.py saves nothing
        launcher.send_signal(signal.SIGUSR1)
    elif fault == "launcher SIGKILL":
        launcher.send_signal(signal.SIGKILL)
    else:
        cluster.run("scancel", cluster.jobs()[0])
    launcher.wait(120)
    exited = time.time() - t0
    code = proc.wait(60)  # salloc: the launcher's exit code (or -9's 137)
    left_at_exit = len(marked(job))
    while marked(job) or cluster.run("squeue", "-h", "--steps", "-o", "%i").stdout.split():
        time.sleep(0.1)
    gone = time.time() - t0
    out, err = proc.communicate(timeout=60)
    line = next((x for x in err.splitlines() if x.startswith("zerorun: error:")), "-")
    return {"fault": fault, "launcher_exited_s": round(exited, 2), "all_gone_s": round(gone, 2),
            "exit_code": code, "left_at_exit": left_at_exit, "line": line}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--only", default=None, help="run only the faults whose names contain this text")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="zr-slurm-bench-") as folder:
        with open(os.path.join(folder, "loop.py"), "w") as f:
            f.write(ENDLESS_SCRIPT)
        cluster = start_cluster(os.path.join(folder, "cluster"), nodes=2, cpus_per_node=2)
        rows = []
        try:
            for fault in [f for f in FAULTS if args.only is None or args.only in f]:
                rows.append(one(cluster, folder, fault))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            cluster.stop()
    load = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"load_average": load, "rows": rows}, f, indent=1)
    print(f"load average {load[0]:.1f}")


if __name__ == "__main__":
    main()
