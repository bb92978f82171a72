"""A throwaway SLURM cluster on loopback, for the slurm launcher's tests.

``start_cluster(directory, nodes=2, cpus_per_node=2)`` writes a slurm.conf in ``directory``, starts munged,
slurmctld and one slurmd per node (Debian's slurm-wlm allows several slurmd on one host), waits until every
node is idle and returns a :class:`SlurmCluster`. Client commands (srun, salloc, sbatch, squeue, scontrol)
need ``SLURM_CONF``: add ``cluster.env`` to their environment. ``cluster.stop()`` cancels this cluster's jobs
and ends the daemons it started, by their recorded PIDs (never by name: another cluster may run beside it);
it also runs at interpreter exit, and every daemon gets SIGTERM when the process that started it dies.

Facts of these machines (Debian 12, slurm 22.05, munge 0.5.15, as root, no systemd):
- ``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny`` makes every daemon and srun bind the address that
  ``hostname`` resolves to instead of 0.0.0.0: it must be a loopback address (checked before starting).
- Node i is named ``127.0.0.<10+i>`` (a literal address, resolvable without /etc/hosts); every slurmd listens on
  127.0.0.1 on its own free port. ``hostname`` is the same in every task: tell nodes apart by
  ``SLURMD_NODENAME`` / ``SLURM_NODEID``.
- munged's socket folder and every folder above it must be o+x (pytest's tmp folders are 0700): the socket lives
  in its own 0755 folder under /tmp (a short path, too: socket paths are limited to 107 bytes).
  slurmd does not create its spool folder; slurmctld takes 2-3 s to exit.
- Ports are chosen free at start (bind to 0 on 127.0.0.1), so two clusters can run at once.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

BINARIES = ("slurmctld", "slurmd", "srun", "salloc", "sbatch", "scontrol", "sinfo", "squeue", "scancel",
            "munged", "mungekey")
_SBIN = ("/usr/sbin", "/usr/bin", "/sbin")


#: A ``zerorun launch`` script that all-reduces and reports a step every 50 ms until it is stopped: the job that
#: the teardown tests (tests/test_slurm_launch.py) and benchmarks/slurm_teardown.py kill in various ways.
ENDLESS_SCRIPT = """\
import time
import torch
import torch.distributed as dist
import zerorun
dist.init_process_group("gloo")
for step in range(1, 100000):
    t = torch.ones(1)
    dist.all_reduce(t)
    zerorun.report(step, 1.0, steps=100000)
    time.sleep(0.05)
"""


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for folder in _SBIN:
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK):
            return path
    return None


def missing_binaries() -> list[str]:
    """Names of the SLURM/munge programs this machine lacks (empty when a cluster can start)."""
    return [name for name in BINARIES if _which(name) is None]


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (bound together, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the process that started it dies (a killed test run leaves no daemon)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class SlurmCluster:
    """A running loopback SLURM cluster.

    Attributes: ``dir`` (its folder: slurm.conf, log/, jobs/), ``nodes`` (node names, ``127.0.0.11`` ...),
    ``env`` (``{"SLURM_CONF": path}``, to add to a client command's environment), ``conf`` (slurm.conf's path),
    ``ctld_port`` and ``slurmd_ports``.
    """

    def __init__(self, directory: str, nodes: list[str], ctld_port: int, slurmd_ports: list[int]) -> None:
        self.dir = directory
        self.nodes = nodes
        self.ctld_port = ctld_port
        self.slurmd_ports = slurmd_ports
        self.conf = os.path.join(directory, "slurm.conf")
        self.env = {"SLURM_CONF": self.conf}
        self.munge_dir = tempfile.mkdtemp(prefix="zr-munge-", dir="/tmp")
        os.chmod(self.munge_dir, 0o755)  # munged: the socket's folder (and those above it) must be o+x
        self.munge_socket = os.path.join(self.munge_dir, "munge.socket.2")
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._stopped = False

    def client_env(self, **extra: str) -> dict[str, str]:
        """``os.environ`` plus ``env`` plus ``extra``, without the SLURM_* variables of an enclosing job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(self.env)
        env.update(extra)
        return env

    def run(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """Run a client command (``scontrol``, ``squeue`` ...) against this cluster; text output captured."""
        return subprocess.run(list(args), env=self.client_env(), capture_output=True, text=True,
                              timeout=timeout, check=check)

    def jobs(self) -> list[str]:
        """Ids of the jobs this cluster still runs or queues."""
        out = self.run("squeue", "-h", "-o", "%i", check=False).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def pids(self) -> dict[str, int]:
        """The daemons' PIDs by name (``munged``, ``slurmctld``, ``slurmd-127.0.0.11`` ...)."""
        return {name: proc.pid for name, proc in self._procs}

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.dir, "log", f"{name}.stdout"), "w")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=self.client_env(), preexec_fn=_die_with_parent)
        log.close()
        self._procs.append((name, proc))
        with open(os.path.join(self.dir, "run", f"{name}.pid.bg"), "w") as f:
            f.write(f"{proc.pid}\n")
        return proc

    def stop(self) -> None:
        """Cancel this cluster's jobs, then end slurmd(s), slurmctld and munged (recorded PIDs only, SIGTERM,
        SIGKILL after 10 s each). Idempotent; registered with atexit."""
        if self._stopped:
            return
        self._stopped = True
        ctld_alive = any(name == "slurmctld" and p.poll() is None for name, p in self._procs)
        if ctld_alive and self.jobs():
            self.run("scancel", "--full", *self.jobs(), check=False, timeout=20)
            deadline = time.time() + 15  # KillWait (5 s) + slack: the steps' processes end before slurmd does
            while self.jobs() and time.time() < deadline:
                time.sleep(0.2)
        # slurmd first (they tell slurmctld), then slurmctld, munged last (the others authenticate with it)
        order = sorted(self._procs, key=lambda item: {"slurmctld": 1, "munged": 2}.get(item[0], 0))
        for name, proc in order:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            try:
                os.unlink(os.path.join(self.dir, "run", f"{name}.pid.bg"))
            except FileNotFoundError:
                pass
        shutil.rmtree(self.munge_dir, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _slurm_conf(d: str, nodes: list[str], ctld_port: int, slurmd_ports: list[int], cpus: int,
                kill_wait: int, munge_socket: str) -> str:
    node_lines = "".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={p} CPUs={cpus} RealMemory=4000 State=UNKNOWN\n"
                         for n, p in zip(nodes, slurmd_ports))
    return f"""\
ClusterName=zrtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_ports[0]}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
KillWait={kill_wait}
# a step's processes slow to end on a loaded machine must not drain the node ("Kill task failed", 60 s default)
UnkillableStepTimeout=300
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
{node_lines}PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP
"""


def start_cluster(directory: str, nodes: int = 2, cpus_per_node: int = 2, kill_wait: int = 5,
                  timeout: float = 60) -> SlurmCluster:
    """Start munged, slurmctld and ``nodes`` slurmd in ``directory`` (created; must not hold a running cluster)
    and wait until every node is idle.

    ``cpus_per_node``: CPUs each node declares (tasks per node). ``kill_wait``: seconds between SIGTERM and
    SIGKILL when a job is cancelled or reaches its time limit (slurm.conf ``KillWait``).
    Raises RuntimeError (with the logs' folder) when a daemon does not start or the nodes are not idle within
    ``timeout`` seconds; the daemons already started are stopped first.
    """
    missing = missing_binaries()
    if missing:
        raise RuntimeError(f"SLURM test cluster: missing programs {', '.join(missing)}")
    resolved = socket.gethostbyname(socket.gethostname())
    if not resolved.startswith("127."):
        raise RuntimeError(f"SLURM test cluster: hostname {socket.gethostname()} resolves to {resolved}, not a "
                           "loopback address (NoInAddrAny binds it)")
    d = os.path.abspath(directory)
    for sub in ("munge", "state", "log", "run", "jobs"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    names = [f"127.0.0.{10 + i}" for i in range(1, nodes + 1)]
    for n in names:
        os.makedirs(os.path.join(d, "spool", n), exist_ok=True)
    ports = _free_ports(nodes + 1)
    cluster = SlurmCluster(d, names, ports[0], ports[1:])
    with open(cluster.conf, "w") as f:
        f.write(_slurm_conf(d, names, ports[0], ports[1:], cpus_per_node, kill_wait, cluster.munge_socket))
    atexit.register(cluster.stop)
    try:
        _start(cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start(cluster: SlurmCluster, timeout: float) -> None:
    d = cluster.dir
    key = os.path.join(d, "munge", "munge.key")
    socket_path = cluster.munge_socket
    if not os.path.exists(key):
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
    cluster._spawn("munged", [_which("munged"), "-F", f"--key-file={key}", f"--socket={socket_path}",
                              f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/log/munged.log",
                              f"--seed-file={d}/munge/munged.seed"])
    deadline = time.time() + timeout

    def wait(what: str, ready) -> None:
        while not ready():
            for name, proc in cluster._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"SLURM test cluster: {name} exited with {proc.returncode} while waiting "
                                       f"for {what}; see {d}/log")
            if time.time() > deadline:
                raise RuntimeError(f"SLURM test cluster: no {what} after {timeout:.0f} s; see {d}/log")
            time.sleep(0.1)

    wait("munge socket", lambda: os.path.exists(socket_path))
    cluster._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", cluster.conf])
    wait("slurmctld", lambda: "is UP" in cluster.run("scontrol", "ping", check=False, timeout=10).stdout)
    for n in cluster.nodes:
        cluster._spawn(f"slurmd-{n}", [_which("slurmd"), "-D", "-N", n, "-f", cluster.conf])

    def idle() -> bool:
        out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in cluster.nodes)

    wait("idle nodes", idle)
