"""How the launcher's start-up time grows with the number of hosts.

Starts a loopback sshd (tests/sshd.py) on 127.0.0.2..127.0.0.(N+1), then for N in --hosts runs
``zerorun launch -H hostfile`` of a trivial job (1 rank per host: init the gloo process group, report one
step, barrier) and measures, from the launcher's start:

- ``preflight_s``: until the launcher prints its header (hostfile read, SSH connections opened and every
  host probed, in parallel; the plan built);
- ``ranks_up_s``: until the last rank reported its first step (every node's torchrun started over SSH,
  torch imported, rendezvous done);
- ``total_s``: until the launcher exited (the job ended and teardown verified nothing is left).

Configurations alternate order across rounds; the medians are printed as a Markdown table and written as
JSON. Every host is this machine, so CPU contention (N torchrun agents and N ranks importing torch on the
same cores) is part of what is measured.

    python benchmarks/launch_scaling.py --hosts 1,2,4,8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from sshd import LoopbackSshd  # noqa: E402

SCRIPT = """
import torch.distributed as dist
import zerorun
dist.init_process_group("gloo")
zerorun.report(1, 0.0, steps=1)
dist.barrier()
dist.destroy_process_group()
"""


def run_once(n: int, sshd: LoopbackSshd, folder: str) -> dict:
    hosts = os.path.join(folder, f"hosts{n}")
    with open(hosts, "w") as f:
        f.write("".join(f"127.0.0.{i + 2} slots=1\n" for i in range(n)))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "zerorun", "launch", "-H", hosts, "--ssh-config", sshd.config,
                             "--log-dir", os.path.join(folder, "runs"), os.path.join(folder, "trivial.py")],
                            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    header = proc.stdout.readline()
    t_header = time.time()
    rest, err = proc.communicate(timeout=600)
    t_end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{n} hosts: exit {proc.returncode}: {err.strip()}")
    run_dir = header.split("run dir ")[1].strip()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if '"event":"step"' in line]
    assert sorted(e["rank"] for e in steps) == list(range(n)), steps
    return {"preflight_s": t_header - t0, "ranks_up_s": max(e["time"] for e in steps) - t0, "total_s": t_end - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="1,2,4,8", help="comma-separated host counts (at most 200)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/launch_scaling.json"))
    args = parser.parse_args()
    counts = [int(x) for x in args.hosts.split(",")]
    folder = tempfile.mkdtemp(prefix="zerorun-launch-scaling-")
    with open(os.path.join(folder, "trivial.py"), "w") as f:
        f.write(SCRIPT)
    sshd = LoopbackSshd(os.path.join(folder, "sshd"), [f"127.0.0.{i + 2}" for i in range(max(counts))])
    results: dict[int, list[dict]] = {n: [] for n in counts}
    try:
        for r in range(args.rounds):
            for n in counts if r % 2 == 0 else reversed(counts):
                results[n].append(run_once(n, sshd, folder))
                print(f"round {r + 1}: {n} hosts: " + ", ".join(f"{k} {v:.2f}" for k, v in results[n][-1].items()),
                      file=sys.stderr)
    finally:
        sshd.stop()
    load = os.getloadavg()
    rows = {n: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for n, runs in results.items()}
    print(f"\n{args.rounds} rounds, medians in seconds; {os.cpu_count()} CPUs, load average {load[0]:.1f}\n")
    print("| hosts | preflight (s) | all ranks up (s) | total (s) |\n|---|---|---|---|")
    for n, row in rows.items():
        print(f"| {n} | {row['preflight_s']:.2f} | {row['ranks_up_s']:.2f} | {row['total_s']:.2f} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "cpus": os.cpu_count(), "loadavg_end": load,
                   "medians": rows, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
