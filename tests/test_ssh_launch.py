"""Multi-node launch through a real sshd on loopback: hosts 127.0.0.2 and 127.0.0.3 are SSH config entries
with the server's port, so both really go through SSH (the launcher runs 127.0.0.1/localhost locally).

Every host is this machine, so listing this machine's processes lists every host's."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from sshd import SSHD
from test_train_e2e import ROOT, TINY, job_id, read_events, survivors, zerorun
from tiny_reference import RECIPE, STEPS

pytestmark = [pytest.mark.slow, pytest.mark.ssh,
              pytest.mark.skipif(not os.path.exists(SSHD), reason="openssh-server is not installed (.ci/run "
                                                                  "installs it)")]


def hostfile(tmp_path, text: str) -> str:
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


def step_losses(run_root) -> list[float]:
    return [e["loss"] for e in read_events(run_root) if e["event"] == "step" and e["rank"] == 0]


def unbase64(text: str) -> str:
    try:
        return base64.b64decode(text.encode() + b"==").decode(errors="replace")
    except ValueError:
        return ""


def watch_job(proc: subprocess.Popen, secret: str) -> dict:
    """While ``proc`` (a launcher) runs, sample the processes that carry ``ZR_SECRET`` in their environment:
    what their command lines and listening sockets are."""
    seen = {"with_secret": set(), "secret_in_cmdline": [], "listen": set(), "master": None}
    while proc.poll() is None:
        for p in psutil.process_iter():
            try:
                if "ZR_SECRET" not in p.environ():
                    continue
                cmd = p.cmdline()
                seen["with_secret"].add((p.pid, p.environ()["ZR_SECRET"] == secret))
                if any(secret[:64] in a or secret[:64] in unbase64(a) for a in cmd):
                    seen["secret_in_cmdline"].append(cmd)
                if "--node-rank=0" in cmd:
                    seen["master"] = [a for a in cmd if a.startswith(("--master-port=", "--master-addr="))]
                    seen["listen"] |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections("tcp")
                                       if c.status == psutil.CONN_LISTEN}
            except (psutil.Error, OSError):
                pass
        time.sleep(0.5)
    return seen


def test_two_hosts_over_ssh_match_two_local_ranks(sshd, tiny_reference, tmp_path):
    """The losses equal those of two local ranks step for step (the session's reference job, the same recipe
    and overrides: tests/tiny_reference.py). Also: no env value or recipe on any command line (a 100 KB value
    works: on a command line it was over the kernel's 128 KiB limit), node 0's rendezvous store listens on the
    master address only, and the nodes' private folders are gone after the run."""
    hosts = hostfile(tmp_path, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    secret = "s3cret-" + os.urandom(8).hex() + "x" * 100_000
    recipe = tmp_path / "tiny.yaml"  # the secret in the recipe file, not on the launcher's command line
    recipe.write_text(pathlib.Path(TINY).read_text().replace(
        "launch: {procs_per_node: 2}",
        f"launch: {{procs_per_node: 2, env: {{ZR_SECRET: {secret}, OMP_NUM_THREADS: '1'}}}}").replace(
        "module: models/gpt.py", f"module: {os.path.join(os.path.dirname(TINY), 'models', 'gpt.py')}"))
    assert RECIPE[-1].startswith("launch.env=")  # the recipe file's launch.env has OMP_NUM_THREADS 1 too
    proc = subprocess.Popen([sys.executable, "-m", "zerorun", "train", str(recipe), *RECIPE[:-1],
                             f"log.dir={tmp_path / 'ssh'}", "-H", hosts, "--ssh-config", sshd.config],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = watch_job(proc, secret)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout + stderr
    assert "2 ranks on 127.0.0.2x1, 127.0.0.3x1" in stdout and "warning" not in stderr, stderr
    assert len(seen["with_secret"]) >= 2 and all(ok for _, ok in seen["with_secret"]), seen["with_secret"]
    assert seen["secret_in_cmdline"] == []
    assert not any(secret[:64] in line for line in open(next((tmp_path / "ssh").glob("*/*/output.log"))))
    port = int(seen["master"][0].split("=")[1]) if seen["master"][0].startswith("--master-port") else \
        int(seen["master"][1].split("=")[1])
    assert {ip for ip, p in seen["listen"] if p == port} == {"127.0.0.2"}, seen
    assert not list(pathlib.Path(tempfile.gettempdir()).glob(f"zerorun-{job_id(stdout)}-*"))
    remote_losses, local_losses = step_losses(tmp_path / "ssh"), [tiny_reference[s] for s in range(1, STEPS + 1)]
    assert len(remote_losses) == STEPS and remote_losses == pytest.approx(local_losses, rel=1e-6, abs=0)
    assert survivors(job_id(stdout)) == []


def test_heterogeneous_local_plus_remote_world_size_3(sshd, tmp_path):
    """Also: the local node leaves nothing in its temporary folder (torchrun's logs included)."""
    hosts = hostfile(tmp_path, "localhost slots=2\n127.0.0.2 slots=1\n")
    (tmp_path / "tmp").mkdir()
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", TINY, "train.steps=2", "train.eval_every=0",
                          f"log.dir={tmp_path / 'runs'}", "-H", hosts, "--ssh-config", sshd.config], cwd=ROOT,
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert out.returncode == 0, out.stdout + out.stderr
    assert [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith(("torchelastic_", "zerorun-"))] == []
    events = read_events(tmp_path / "runs")
    starts = [e for e in events if e["event"] == "start"]
    assert sorted(e["rank"] for e in starts) == [0, 1, 2] and {e["world_size"] for e in starts} == {3}
    assert sorted(e["rank"] for e in events if e["event"] == "finish") == [0, 1, 2]
    # ranks in hostfile order: 0 and 1 on localhost (local ranks 0, 1), 2 on 127.0.0.2 (local rank 0)
    assert {e["rank"]: e["local_rank"] for e in starts} == {0: 0, 1: 1, 2: 0}


LOOP = """
import datetime, os, sys, time
import torch, torch.distributed as dist
import zerorun
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
exit_at = int(sys.argv[1]) if len(sys.argv) > 1 else 0  # rank 1 exits 0 at this step
quiet_from = int(sys.argv[2]) if len(sys.argv) > 2 else 0  # no output from this step on
for step in range(1, 100000):
    if step == exit_at and dist.get_rank() == 1:
        sys.exit(0)
    t = torch.ones(1)
    dist.all_reduce(t)
    if not quiet_from or step < quiet_from:
        zerorun.report(step, float(t), steps=100000, samples=1)
    time.sleep(0.2)
"""


def start_loop(tmp_path, sshd, hosts_text: str, *args: str) -> tuple[subprocess.Popen, str]:
    """``zerorun launch`` of a script that all-reduces forever; returns it once rank 0 reported a step."""
    return first_step(launch_loop(tmp_path, sshd, hosts_text, *args))


def launch_loop(tmp_path, sshd, hosts_text: str, *args: str) -> subprocess.Popen:
    """``zerorun launch`` of a script that all-reduces forever, started (see :func:`first_step`)."""
    (tmp_path / "loop.py").write_text(LOOP)
    return subprocess.Popen([sys.executable, "-m", "zerorun", "launch", "-H", hostfile(tmp_path, hosts_text),
                             "--ssh-config", sshd.config, "--log-dir", str(tmp_path / "runs"), "loop.py", *args],
                            cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def first_step(proc: subprocess.Popen) -> tuple[subprocess.Popen, str]:
    """The started launch ``proc`` and its job id, once its rank 0 reported a step."""
    job = job_id(proc.stdout.readline())
    for line in proc.stdout:
        if line.startswith("step"):
            break
    return proc, job


def rank_process(job: str, rank: int) -> psutil.Process:
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get("ZERORUN_JOB_ID") == job and env.get("RANK") == str(rank) and \
                    "zerorun.rank.script_worker" in proc.cmdline():
                return proc
        except (psutil.Error, OSError):
            pass
    raise AssertionError(f"rank {rank} of job {job} not found")


def test_rank_killed_on_one_host_stops_every_host(sshd, tmp_path):
    proc, job = start_loop(tmp_path, sshd, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    assert len(survivors(job)) >= 4  # a torchrun agent and a rank on each host
    rank_process(job, 1).kill()
    t0 = time.time()
    proc.wait(timeout=60)
    took = time.time() - t0
    err = proc.stderr.read()
    assert proc.returncode == 1, err
    assert "rank 1 on 127.0.0.3: rank process ended (killed by SIGKILL)" in err, err
    out = proc.stdout.read()  # the summary shows what happened to each rank (issue 17 item 9)
    assert re.search(r"127\.0\.0\.3\s+1\s+killed", out) and re.search(r"127\.0\.0\.2\s+0\s+stopped", out), out
    assert survivors(job) == []
    assert took < 20, f"teardown took {took:.1f} s"  # the target is 10 s (Note [Teardown]); generous under load


def test_sigint_stops_every_host(sshd, tmp_path):
    proc, job = start_loop(tmp_path, sshd, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    proc.send_signal(signal.SIGINT)
    t0 = time.time()
    proc.wait(timeout=60)
    assert proc.returncode == 130 and "stopped by SIGINT" in proc.stderr.read()
    assert survivors(job) == [] and time.time() - t0 < 20


def test_lost_ssh_connection_is_a_node_failure(sshd, tmp_path):
    proc, job = start_loop(tmp_path, sshd, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    # the sshd session processes above node 1's torchrun agent (ranks 1's parent)
    agent = rank_process(job, 1).parent()
    sessions = [p for p in agent.parents() if p.name().startswith("sshd") and p.pid != sshd.proc.pid]
    assert sessions, [p.name() for p in agent.parents()]
    for p in sessions:
        p.kill()
    proc.wait(timeout=60)
    err = proc.stderr.read()
    assert proc.returncode == 1 and "lost the SSH connection to 127.0.0.3" in err, err
    assert survivors(job) == []


def agent_of(job: str, rank: int) -> psutil.Process:
    agent = rank_process(job, rank).parent()
    assert "zerorun.launch.torchrun" in agent.cmdline(), agent.cmdline()
    return agent


def wait_ended(proc: subprocess.Popen, job: str, bound: float = 15.0) -> tuple[float, str]:
    """Wait for the launcher ``proc`` to exit and the job's processes (and nodes' folders) to be gone; return
    the seconds that took and the launcher's stderr."""
    t0 = time.time()
    proc.wait(timeout=60)
    while (survivors(job) or list(pathlib.Path(tempfile.gettempdir()).glob(f"zerorun-{job}-*"))) and \
            time.time() < t0 + 30:
        time.sleep(0.1)
    return time.time() - t0, proc.stderr.read()


@pytest.mark.parametrize("where", ["remote", "local"])
def test_killed_torchrun_agent_stops_its_node_and_the_job(sshd, tmp_path, where):
    """Issue 17 item 6: SIGKILL of a node's torchrun (which orphans its ranks) ends the job, naming the node."""
    first = "127.0.0.2" if where == "remote" else "localhost"
    proc, job = start_loop(tmp_path, sshd, f"{first} slots=1\n127.0.0.3 slots=1\n")
    node, host = (1, "127.0.0.3") if where == "remote" else (0, "localhost")
    agent_of(job, node).kill()
    took, err = wait_ended(proc, job)
    assert proc.returncode == 1, err
    assert f"node {node} on {host} ended (its torchrun agent was killed by SIGKILL; 1 orphaned rank process " \
           "stopped)" in err, err
    assert survivors(job) == [] and took < 15, (took, survivors(job))


@pytest.mark.parametrize("where", ["remote", "local"])
def test_killed_node_watcher_stops_its_node_and_the_job(sshd, tmp_path, where):
    """SIGKILL of a node's watcher (``python -m zerorun.launch.node``): its torchrun gets SIGTERM from the kernel
    and stops the ranks, and the launcher names the watcher's death, instead of ranks training on unsupervised
    and the launcher waiting for them."""
    first = "127.0.0.2" if where == "remote" else "localhost"
    proc, job = start_loop(tmp_path, sshd, f"{first} slots=1\n127.0.0.3 slots=1\n")
    node, host = (1, "127.0.0.3") if where == "remote" else (0, "localhost")
    watcher = agent_of(job, node).parent()
    assert "zerorun.launch.node" in watcher.cmdline(), watcher.cmdline()
    watcher.kill()
    took, err = wait_ended(proc, job)
    assert proc.returncode == 1, err
    assert f"node {node} on {host} ended (its watcher was killed by SIGKILL)" in err, err
    assert survivors(job) == [] and took < 15, (took, survivors(job))


def test_launcher_killed_stops_every_host(sshd, tmp_path):
    """Issue 17 item 7: SIGKILL of the launcher: every node's watcher sees its input end and stops the node. The
    ranks are quiet after their first step (a rank that writes dies of the closed pipe anyway)."""
    proc, job = start_loop(tmp_path, sshd, "localhost slots=1\n127.0.0.2 slots=1\n", "0", "2")
    assert len(survivors(job)) >= 4
    proc.kill()
    took, _ = wait_ended(proc, job)
    assert survivors(job) == [] and took < 15, took
    assert not list(pathlib.Path(tempfile.gettempdir()).glob(f"zerorun-{job}-*"))


def test_hung_or_vanished_rank_is_blamed_not_its_peer(sshd, tmp_path):
    """Issue 17 item 8: a rank stopped with SIGSTOP makes rank 0 time out (5 s here), a rank that exits 0 in
    the middle makes rank 0 fail on a closed connection; either way rank 1 is named. The second job starts
    while the first one's rank 0 waits out its timeout (idle CPUs)."""
    proc, job = start_loop(tmp_path, sshd, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    rank_process(job, 1).suspend()
    second = launch_loop(tmp_path, sshd, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n", "5")
    took, err = wait_ended(proc, job, 30)
    assert proc.returncode == 1, err
    # "last heard N s before rank 0 failed", or "no word from it before ..." when stopped before its first step
    assert "rank 1 on 127.0.0.3: rank 1 stopped responding (" in err and " before rank 0 failed)" in err, err
    assert survivors(job) == []
    proc, job = first_step(second)
    took, err = wait_ended(proc, job)
    assert proc.returncode == 1, err
    assert "rank 1 on 127.0.0.3: rank 1 finished while its peers still needed it; rank 0 then failed" in err, err
    assert survivors(job) == []


ENV_SCRIPT = """
import json, os, sys
json.dump({k: os.environ.get(k) for k in sys.argv[2:]}, open(sys.argv[1], "w"))
"""


def test_only_asked_for_env_crosses_byte_for_byte(sshd, tmp_path):
    (tmp_path / "env.py").write_text(ENV_SCRIPT)
    (tmp_path / ".zerorun_env").write_text("# values are literal\n\nSPACED=two words\nQUOTED=it's \"quoted\" \\\n"
                                           "DOLLAR=$HOME;echo pwned `id` | x & y\n")
    weird = "line one\nline 'two' \"$PATH\"; exit 3\n"
    env = {**os.environ, "HOME": str(tmp_path), "NCCL_ZR_TEST": weird, "ZR_SECRET": "must not cross"}
    hosts = hostfile(tmp_path, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    keys = ["SPACED", "QUOTED", "DOLLAR", "NCCL_ZR_TEST", "ZR_SECRET"]
    out = subprocess.run([sys.executable, "-m", "zerorun", "launch", "-H", hosts, "--exclude", "127.0.0.3",
                          "--ssh-config", sshd.config, "--log-dir", str(tmp_path / "runs"), "env.py",
                          str(tmp_path / "seen.json"), *keys], cwd=str(tmp_path), env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rank on 127.0.0.2x1" in out.stdout
    assert re.search(r"127\.0\.0\.2\s+0\s+done", out.stdout) and "warning" not in out.stderr, out.stdout + out.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"SPACED": "two words", "QUOTED": "it's \"quoted\" \\", "DOLLAR": "$HOME;echo pwned `id` | x & y",
                    "NCCL_ZR_TEST": weird, "ZR_SECRET": None}


def test_preflight_names_each_failing_host_and_starts_nothing(sshd, tmp_path):
    (tmp_path / "s.py").write_text("print('ran')\n")
    hosts = hostfile(tmp_path, "127.0.0.2 slots=1\nbadkey slots=1\ndown slots=1\n127.0.0.3 slots=1\n")
    out = subprocess.run([sys.executable, "-m", "zerorun", "launch", "-H", hosts, "--ssh-config", sshd.config,
                          "s.py"], cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert len(lines) == 2, out.stderr
    assert lines[0].startswith("zerorun: error: preflight: badkey: authentication refused")
    assert lines[1].startswith(f"zerorun: error: preflight: down: unreachable: connection refused (127.0.0.1:")
    assert not (tmp_path / "runs").exists()


def test_preflight_detects_master_port_in_use_and_a_missing_module(sshd, tmp_path):
    (tmp_path / "s.py").write_text("print('ran')\n")
    hosts = hostfile(tmp_path, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.2", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "zerorun", "launch", "-H", hosts, "--ssh-config", sshd.config,
                              "--master-port", str(port), "s.py"], cwd=str(tmp_path), capture_output=True,
                             text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr == f"zerorun: error: preflight: 127.0.0.2: master port {port} is already in use there\n"
    out = zerorun("train", TINY, "model.module=no_such_model_module", "launch.procs_per_node=1", "-H", hosts,
                  "--ssh-config", sshd.config, cwd=ROOT)  # the hosts' slots: no note on procs_per_node
    assert out.returncode == 2 and out.stderr.splitlines() == [
        f"zerorun: error: preflight: {h}: module missing: no_such_model_module" for h in ("127.0.0.2", "127.0.0.3")]


def test_env_reports_versions_backends_and_which_hosts_answer(sshd, tmp_path):
    """``zerorun env`` (issue 18): what a bug report needs, and with -H each host reachable or not (loopback), and
    the GPUs each host has (issue 33)."""
    from importlib.metadata import version

    hosts = hostfile(tmp_path, "localhost slots=2\n127.0.0.2 slots=1\ndown slots=1\n")
    out = subprocess.run([sys.executable, "-m", "zerorun", "env", "-H", hosts, "--ssh-config", sshd.config],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    # a host that does not answer fails the command (found by review: exit 0), after the whole report
    assert out.returncode == 1 and out.stderr == ("zerorun: error: 1 of the hostfile's hosts did not answer: down "
                                                  "(rows above)\n"), out.stdout + out.stderr
    rows = {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip() for line in out.stdout.splitlines()}
    import zerorun

    assert rows["zerorun"].startswith(zerorun.__version__) and rows["python"].startswith(sys.version.split()[0])
    assert rows["torch"].startswith(version("torch")) and "gloo" in rows["distributed backends"]
    assert rows["fabric"] == version("fabric") and rows["paramiko"] == version("paramiko")
    from zerorun.cli.env import cuda_devices, gpu_text

    gpus = gpu_text(cuda_devices())  # "no GPU (CUDA not available)" here; each host's GPUs named (issue 33)
    assert "cores" in rows["CPU"] and rows["GPUs"] == gpus
    assert rows["host localhost (slots=2)"] == f"local (no SSH); GPUs: {gpus}"
    assert rows["host 127.0.0.2 (slots=1)"] == f"reachable over SSH; GPUs: {gpus}"  # asked there, over SSH
    assert rows["host down (slots=1)"].startswith("unreachable: connection refused"), rows


def test_estimate_takes_the_memory_of_the_hostfiles_hosts(sshd, tmp_path):
    """``zerorun estimate -H`` (issue 37 part 6) asks each host its memory over SSH, as ``zerorun env -H``
    reaches it, and says so on its first line; a host that does not answer is one line naming it (exit 2)."""
    hosts = hostfile(tmp_path, "127.0.0.2 slots=2\n127.0.0.3 slots=2\n")
    out = subprocess.run([sys.executable, "-m", "zerorun", "estimate", "--params", "350M", "-H", hosts,
                          "--ssh-config", sshd.config, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    setup = json.loads(out.stdout)["setup"]
    total = psutil.virtual_memory().total  # the loopback hosts are this machine: /proc/meminfo's MemTotal
    assert setup["memory_source"].startswith("the hostfile's hosts (127.0.0.2, 127.0.0.3; the smallest")
    assert abs(setup["cpu_memory_per_node"] - total) < 2**20 and setup["device_memory"] == setup["cpu_memory_per_node"] // 2
    bad = hostfile(tmp_path, "127.0.0.2 slots=1\ndown slots=1\n")
    out = subprocess.run([sys.executable, "-m", "zerorun", "estimate", "--params", "350M", "-H", bad,
                          "--ssh-config", sshd.config], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith(f"zerorun: error: estimate: -H {bad}: host down: "
                                                         "unreachable: connection refused"), out.stderr
    assert out.stderr.count("\n") == 1 and "--host-memory" in out.stderr, out.stderr
