"""Reliability figures: how the launcher ends a 2-host job under each fault.

Two loopback hosts (127.0.0.2 and 127.0.0.3, one rank each) behind a throwaway sshd (tests/sshd.py) run a
script that all-reduces forever (`zerorun launch`, collective timeout 30 s); once rank 0 reported a step, one
fault is applied and the launcher's end is measured: seconds from the fault until the launcher exited and
until no process of the job was left on any host, the exit code, the rank (or node) its error names, and the
processes of the job still alive on each host when the launcher exited.

    python benchmarks/reliability.py --out benchmarks/results/reliability.json

The last row (``--only 12``) is no fault of a running job but a second ``zerorun train`` of the same recipe
name, another learning rate, started on the first job's checkpoint.dir 4 s after its first step; the row also
says how the first job ended and whose learning rate its checkpoints hold.

Every host is this machine, so "processes left on a host" counts the processes marked with that node
(``ZERORUN_NODE=JOB:NODE``, launch/node.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from sshd import LoopbackSshd  # noqa: E402

LOOP = """
import datetime, os, sys, time
import torch, torch.distributed as dist
import zerorun
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
for step in range(1, 100000):
    if step == int(sys.argv[1] if len(sys.argv) > 1 else 0) and dist.get_rank() == 1:
        if len(sys.argv) > 3 and sys.argv[3] == "hard":
            os._exit(0)  # no finish event: only the exit code tells
        sys.exit(0)
    t = torch.ones(1)
    dist.all_reduce(t)
    if len(sys.argv) < 3 or step < int(sys.argv[2]):  # quiet from step argv[2] on
        zerorun.report(step, float(t), steps=100000, samples=1)
    time.sleep(0.2)
"""

SAVE = """
import os, sys, time
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
import zerorun
dist.init_process_group("gloo")
state = {"w": torch.randn(4096, 4096)}  # 64 MiB per rank: a save takes a while
for step in range(1, 100000):
    print("saving", flush=True)
    dcp.save(state, checkpoint_id=os.path.join(sys.argv[1], f"step-{step}"))
    zerorun.report(step, 0.0, steps=100000, samples=1)
"""


def marked(job: str) -> dict[int, list[int]]:
    """PIDs of the job's processes per node rank."""
    found: dict[int, list[int]] = {0: [], 1: []}
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("ZERORUN_JOB_ID") == job:
            node = env.get("ZERORUN_NODE", f"{job}:?").split(":")[1]
            found.setdefault(int(node) if node.isdigit() else -1, []).append(p.pid)
    return found


def rank_process(job: str, rank: int) -> psutil.Process:
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get("ZERORUN_JOB_ID") == job and env.get("RANK") == str(rank) and \
                    {"zerorun.rank.script_worker", "zerorun.rank.worker"} & set(p.cmdline()):
                return p
        except (psutil.Error, OSError):
            pass
    raise RuntimeError(f"rank {rank} of job {job} not found")


def run_fault(name: str, fault, sshd: LoopbackSshd, folder: str, script: str = LOOP, args: tuple = (),
              ready: str = "step", hosts: str = "127.0.0.2 slots=1\n127.0.0.3 slots=1\n",
              train: tuple | None = None) -> dict:
    """Run the job (``zerorun launch job.py ARGS``, or ``zerorun train`` with the overrides ``train``), apply
    ``fault`` once a line starts with ``ready``, and measure how the launcher ends (module docstring)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "job.py"), "w") as f:
        f.write(script)
    with open(os.path.join(folder, "hosts"), "w") as f:
        f.write(hosts)
    what = ["train", os.path.join(HERE, "..", "recipes", "tiny.yaml"), *train, "log.dir=runs"] if train is not None \
        else ["launch", "--log-dir", "runs", "job.py", *args]
    proc = subprocess.Popen([sys.executable, "-m", "zerorun", what[0], "-H", "hosts", "--ssh-config", sshd.config,
                             "--no-dashboard", *what[1:]], cwd=folder, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    job = re.search(r"job ([0-9a-f]{12})", proc.stdout.readline()).group(1)
    for line in proc.stdout:
        if line.startswith(ready):
            break
    t0 = time.time()
    fault(proc, job, sshd)
    try:
        proc.wait(timeout=120)
        exited = time.time() - t0
    except subprocess.TimeoutExpired:
        exited = None
    left = {n: len(p) for n, p in marked(job).items()}
    while any(marked(job).values()) and time.time() < t0 + 120:
        time.sleep(0.1)
    gone = time.time() - t0
    for pids in marked(job).values():  # never leave anything behind, even when a fault is not handled
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    if exited is None:
        proc.kill()
        proc.wait()
    err = proc.stderr.read().strip().splitlines()
    last = next((x for x in reversed(err) if x.startswith("zerorun: error:")), err[-1] if err else "")
    named = re.search(r"error: (rank \d+ on \S+|job): (.*?)(?: \(logs: .*)?$", last)
    return {"fault": name, "launcher_exit_s": None if exited is None else round(exited, 1),
            "all_gone_s": round(gone, 1), "exit_code": proc.returncode,
            "named": (named.group(1) + ": " + named.group(2)) if named else last,
            "left_at_exit": {"127.0.0.2": left.get(0, 0), "127.0.0.3": left.get(1, 0)}}


def kill_rank(sig):
    return lambda proc, job, sshd: rank_process(job, 1).send_signal(sig)


def kill_agent(proc, job, sshd):
    rank_process(job, 1).parent().kill()


def signal_launcher(sig):
    return lambda proc, job, sshd: proc.send_signal(sig)


def drop_connection(proc, job, sshd):
    agent = rank_process(job, 1).parent()
    for p in agent.parents():
        if p.name().startswith("sshd") and p.pid != sshd.proc.pid:
            p.kill()


def kill_during_save(proc, job, sshd):
    rank_process(job, 1).kill()


def two_jobs_one_folder(sshd: LoopbackSshd, folder: str) -> dict:
    """The same row for a second ``zerorun train`` of the same recipe name (another learning rate) started on
    the first job's checkpoint.dir 4 s after the first job's first step: how the second ends, and whether the
    first still ends well with checkpoints of its own (Note [Checkpoint folder lock])."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "hosts"), "w") as f:
        f.write("127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    tiny = os.path.join(HERE, "..", "recipes", "tiny.yaml")

    def train(lr: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "zerorun", "train", tiny, "-H", "hosts", "--ssh-config",
                                 sshd.config, "--no-dashboard", "log.dir=runs", "checkpoint.dir=ckpt",
                                 "checkpoint.every=25", "train.steps=100", "log.every=1", f"train.optimizer.lr={lr}"],
                                cwd=folder, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})

    first = second = None
    try:
        first = train("3e-3")
        job = re.search(r"job ([0-9a-f]{12})", first.stdout.readline()).group(1)
        for line in first.stdout:
            if line.startswith("step"):
                break
        time.sleep(4.0)
        t0 = time.time()
        second = train("1e-3")
        _, err = second.communicate(timeout=600)  # before the lock: it trained to the end, as the first
        exited = time.time() - t0
        left = sum(len(pids) for pids in marked_other(job, folder))
        first.stdout.read()
        first.wait(timeout=600)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()  # the launcher stops its ranks
                proc.wait(timeout=60)
    lrs = set()
    for name in sorted(os.listdir(os.path.join(folder, "ckpt"))):
        if name.startswith("step-"):
            with open(os.path.join(folder, "ckpt", name, "zerorun.json")) as f:
                lrs.add(json.load(f)["recipe"]["train"]["optimizer"]["lr"])
    last = err.strip().splitlines()[-1] if err.strip() else ""
    return {"fault": "second train job on the same checkpoint.dir, 4 s later", "launcher_exit_s": round(exited, 1),
            "all_gone_s": round(exited, 1), "exit_code": second.returncode,
            "named": last.removeprefix("zerorun: error: "),
            "left_at_exit": {"127.0.0.2": left, "127.0.0.3": 0},
            "first_job": f"exit {first.returncode}; checkpoints' lr {sorted(lrs)} (its own: 0.003)"}


def marked_other(job: str, folder: str) -> list[list[int]]:
    """PIDs of zerorun job processes running in ``folder`` of any job but ``job``, one list per job."""
    found: dict[str, list[int]] = {}
    for p in psutil.process_iter():
        try:
            other = p.environ().get("ZERORUN_JOB_ID")
            here = other and os.path.realpath(p.cwd()) == os.path.realpath(folder)
        except (psutil.Error, OSError):
            continue
        if here and other != job:
            found.setdefault(other, []).append(p.pid)
    return list(found.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--only", default=None, help="comma-separated fault names")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="zerorun-reliability-")
    sshd = LoopbackSshd(os.path.join(folder, "sshd"), ["127.0.0.2", "127.0.0.3"])
    faults = [
        ("kill -9 of rank 1", dict(fault=kill_rank(signal.SIGKILL))),
        ("SIGSTOP of rank 1 (30 s collective timeout)", dict(fault=kill_rank(signal.SIGSTOP))),
        ("rank 1 exits 0 mid-run", dict(fault=lambda *a: None, args=("8",))),
        ("SIGKILL of node 1's torchrun agent", dict(fault=kill_agent)),
        ("launcher SIGINT", dict(fault=signal_launcher(signal.SIGINT))),
        ("launcher SIGTERM", dict(fault=signal_launcher(signal.SIGTERM))),
        # quiet ranks: a rank that writes dies of the closed pipe anyway
        ("launcher SIGKILL (ranks quiet after step 1)", dict(fault=signal_launcher(signal.SIGKILL), args=("0", "2"))),
        ("dropped SSH connection to node 1", dict(fault=drop_connection)),
        ("kill -9 of rank 1 during a checkpoint save", dict(fault=kill_during_save, script=SAVE,
                                                             ready="[rank 1] saving")),
        # issue 34: a rank that exits 0 beside a peer on its host (its node goes on), one rank sent SIGTERM
        ("rank 1 exits 0 mid-run with os._exit (ranks 0 and 1 on 127.0.0.2)",
         dict(fault=lambda *a: None, args=("8", "100000", "hard"), hosts="127.0.0.2 slots=2\n")),
        ("SIGTERM of rank 1", dict(fault=kill_rank(signal.SIGTERM))),
        ("SIGTERM of rank 1 (zerorun train, checkpoint.dir set)",
         dict(fault=kill_rank(signal.SIGTERM), train=("train.steps=100000", "train.eval_every=0", "log.every=1",
                                                      "checkpoint.dir=ckpt"))),
    ]
    only = set(args.only.split(",")) if args.only else None
    rows = []
    try:
        for i, (name, kw) in enumerate(faults):
            if only and str(i) not in only:
                continue
            if kw.get("script") is SAVE:
                kw["args"] = (os.path.join(folder, f"ckpt{i}"),)
            row = run_fault(name, sshd=sshd, folder=os.path.join(folder, f"f{i}"), **kw)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if not only or str(len(faults)) in only:
            rows.append(two_jobs_one_folder(sshd, os.path.join(folder, f"f{len(faults)}")))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        sshd.stop()
    print("\n| fault | launcher exited (s) | all processes gone (s) | exit code | named | left at exit "
          "(127.0.0.2 / 127.0.0.3) |\n|---|---|---|---|---|---|")
    for r in rows:
        left = r["left_at_exit"]
        named = r["named"] if len(r["named"]) < 120 else r["named"][:117] + "..."
        print(f"| {r['fault']} | {r['launcher_exit_s']} | {r['all_gone_s']} | {r['exit_code']} | {named} | "
              f"{left['127.0.0.2']} / {left['127.0.0.3']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"load_avg_at_end": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
