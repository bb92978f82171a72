"""From selected hosts to nodes ready to start: preflight the remote hosts, choose the rendezvous address and
port, build the plan, and make a :class:`LocalNode` or :class:`RemoteNode` per host."""

from __future__ import annotations

import ipaddress
import os
import queue
import socket
import sys
from dataclasses import dataclass, field

from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import Host
from zerorun.launch.env import allowed_env, env_file_values
from zerorun.launch.launcher import Launcher
from zerorun.launch.nodes import Node
from zerorun.launch.plan import LaunchPlan, build_plan, free_port, port_in_use
from zerorun.launch.preflight import preflight
from zerorun.launch.remote import RemoteNode, SshOptions, connection
from zerorun.launch.runner import LocalNode


@dataclass
class Job:
    """A planned job: its ``plan``, one node per host (not started; launch/nodes.py ``Node``), and the
    ``lines`` queue they send their messages to (Note [Node messages])."""

    plan: LaunchPlan
    nodes: list[Node] = field(default_factory=list)
    lines: "queue.Queue" = field(default_factory=queue.Queue)
    workdir: str = ""
    #: names of the variables from ``launch.env`` and environment files (values never printed)
    user_env: frozenset = frozenset()
    #: the SLURM launcher's srun command (launch/slurm.py), None for the SSH and local launchers
    srun: list[str] | None = None
    #: seconds between SIGTERM and SIGKILL at teardown (Note [Teardown]); SLURM's: 10 s, for the ranks'
    #: checkpoint on SIGTERM (Note [Slurm teardown])
    grace_s: float = 5.0

    def close(self) -> None:
        """Release what the nodes hold (SSH connections)."""
        for node in self.nodes:
            node.close()


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _local_end(conn) -> str:
    """This machine's address on the route to ``conn``'s host: the local end of its open SSH connection, or
    for one not opened (the dry run), the address the kernel would send from (a UDP socket connected to the
    host, which sends nothing); this machine's name when the host's address cannot be resolved here."""
    if conn.transport is not None:
        return conn.transport.sock.getsockname()[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((conn.host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def master_address(hosts: list[Host], remote: dict[str, object]) -> str:
    """The first host's address as every other node reaches it.

    A remote first host: its address from the SSH config (``HostName``, or the name itself). This machine (a
    local first host, or a remote one whose address is loopback): 127.0.0.1 (or that loopback address) when
    every other node is on loopback too, else this machine's address on the route to the first other host
    that is not (the local end of that SSH connection), since a loopback address there is that host itself.
    ``remote``: host name -> its fabric ``Connection`` (open, or not for the dry run: :func:`_local_end`).
    """
    first = hosts[0].name
    far = [conn for name, conn in remote.items() if name != first and not _is_loopback(conn.host)]
    if first in remote and (not far or not _is_loopback(remote[first].host)):
        return remote[first].host
    if not far:
        return "127.0.0.1"
    return _local_end(far[0])


#: the master port a dry run prints when the job would choose it on a remote first host at start: torchrun's and
#: DeepSpeed's default (Note [Dry-run master port]).
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Reach:
    """What planning knows of the hosts (Note [One plan path]): ``conns``, SSH connection per remote host name
    (opened by preflight for the job, not opened for the dry run); ``port``, the master port preflight found
    free on a remote first host (None: not asked, or the dry run); ``cpus``, CPUs per host name (preflight's
    count; missing: this machine's)."""

    conns: dict = field(default_factory=dict)
    port: int | None = None
    cpus: dict = field(default_factory=dict)


def plan_job(hosts: list[Host], job_id: str, launcher: Launcher, reach: Reach, *, recipe_json: str | None,
             program: list[str] | None, python: str, extra_env: dict[str, str], master_port: int | None,
             master_addr: str | None) -> tuple[LaunchPlan, str | None]:
    """The job's plan, the same for the job and its dry run (Note [One plan path]), and a note for the dry
    run when the master port is only chosen at start (None otherwise).

    Note [One plan path]: the job (:func:`prepare`) and ``--dry-run`` (launch/dryrun.py) both plan here, so
    the printed commands are the ones the job runs. The master address: ``master_addr``, else the SLURM
    allocation's first node name, else 127.0.0.1 for this machine alone (``local``), else
    :func:`master_address` over the SSH connections, the aliases of the SSH config resolved to their
    ``HostName`` (fabric reads the config the same way whether the connection is opened or not). Two things
    only a contacted host tells, which a dry run therefore cannot know: a port free on a remote first host
    (Note [Dry-run master port]) and a remote host's CPU count (its ``OMP_NUM_THREADS`` in a dry run is this
    machine's CPUs over its ranks; the job's, that host's).

    Note [Dry-run master port]: ``master_port``, else a port free on the first host when the job starts. A
    local first host (and SLURM's, where the launcher runs on the first node): one free here, found the same
    way by both. A remote first host: preflight finds one free there, which a dry run, contacting no host,
    cannot know: the commands print torchrun's (and DeepSpeed's) default 29500, which runs as printed where it
    is free, and a comment says so and how to make the job use the printed port (``--master-port``), rather
    than a port the job would not use without saying so.
    """
    note = None
    if launcher is Launcher.SLURM:
        addr = master_addr or hosts[0].name
    elif launcher is Launcher.LOCAL:
        addr = master_addr or "127.0.0.1"
    else:
        addr = master_addr or master_address(hosts, reach.conns)
    if master_port is None and hosts[0].name in reach.conns and launcher is Launcher.SSH:
        master_port = reach.port
        if master_port is None:
            master_port = DEFAULT_MASTER_PORT
            note = (f"# master port: the job picks a free port on {hosts[0].name} when it starts; the commands "
                    f"use torchrun's default {master_port}: give --master-port to make the job use the one printed")
    elif master_port is None:
        master_port = free_port()
    plan = build_plan(hosts, recipe_json, job_id, master_port, python, extra_env, master_addr=addr,
                      program=program, cpus=reach.cpus)
    return plan, note


def dry_run_reach(hosts: list[Host], launcher: Launcher, ssh: SshOptions, ssh_local: bool) -> Reach:
    """The :class:`Reach` of a dry run: SSH connections made but not opened (the SSH config read, no host
    contacted) for the hosts the job would reach over SSH."""
    if launcher is not Launcher.SSH:
        return Reach()
    return Reach(conns={h.name: connection(h.name, ssh) for h in hosts if ssh_local or not h.is_local})


def prepare(hosts: list[Host], job_id: str, launcher: Launcher, *, recipe_json: str | None = None,
            program: list[str] | None = None, python: str | None = None, workdir: str | None = None,
            env: dict[str, str] | None = None, modules: list[str] = (), master_port: int | None = None,
            master_addr: str | None = None, ssh: SshOptions = SshOptions(), ssh_local: bool = False,
            preflight_timeout: float = 15.0) -> Job:
    """Plan a job on ``hosts`` and make its nodes with ``launcher``'s backend (Note [Launchers] in
    launch/launcher.py): :func:`prepare_job` (ssh), :func:`prepare_local_job` (local) or
    :func:`prepare_slurm_job` (slurm).

    Raises:
        ZerorunError: a preflight failure (one line per host), or the master port is in use.
    """
    what = dict(recipe_json=recipe_json, program=program, python=python, workdir=workdir, env=env,
                master_port=master_port, master_addr=master_addr)
    if launcher is Launcher.SLURM:
        from zerorun.launch.slurm import allocation_cpus

        return prepare_slurm_job(hosts, job_id, cpus=allocation_cpus(), **what)
    if launcher is Launcher.LOCAL:
        return prepare_local_job(hosts, job_id, **what)
    return prepare_job(hosts, job_id, modules=modules, ssh=ssh, ssh_local=ssh_local,
                       preflight_timeout=preflight_timeout, **what)


def _refuse_used_port(hosts: list[Host], master_port: int | None) -> None:
    if master_port is not None and hosts[0].is_local and port_in_use(master_port):
        raise ZerorunError(f"--master-port {master_port}: the port is already in use on {socket.gethostname()}")


def prepare_local_job(hosts: list[Host], job_id: str, *, recipe_json: str | None = None,
                      program: list[str] | None = None, python: str | None = None, workdir: str | None = None,
                      env: dict[str, str] | None = None, master_port: int | None = None,
                      master_addr: str | None = None) -> Job:
    """Plan a job on this machine alone (``--launcher local``) and make its local nodes: no SSH, no preflight.

    Raises:
        ZerorunError: ``master_port`` is in use here.
    """
    python = python or sys.executable
    workdir = workdir or os.getcwd()
    extra_env = {**env_file_values(), **(env or {})}
    _refuse_used_port(hosts, master_port)
    plan, _ = plan_job(hosts, job_id, Launcher.LOCAL, Reach(), recipe_json=recipe_json, program=program,
                       python=python, extra_env=extra_env, master_port=master_port, master_addr=master_addr)
    job = Job(plan, workdir=workdir, user_env=frozenset(extra_env))
    job.nodes = [LocalNode(spec, job.lines, cwd=workdir) for spec in plan.nodes]
    return job


def prepare_job(hosts: list[Host], job_id: str, *, recipe_json: str | None = None, program: list[str] | None = None,
                python: str | None = None, workdir: str | None = None, env: dict[str, str] | None = None,
                modules: list[str] = (), master_port: int | None = None, master_addr: str | None = None,
                ssh: SshOptions = SshOptions(),
                ssh_local: bool = False, preflight_timeout: float = 15.0) -> Job:
    """Plan a job on ``hosts`` with the SSH launcher and make its nodes; remote hosts are checked first
    (launch/preflight.py).

    Args:
        hosts: selected hosts in rank order (hostfile.select_hosts).
        recipe_json / program: what the ranks run (see plan.build_plan).
        python: interpreter on every node (default: this one); workdir: where nodes start (default: here).
        env: the recipe's ``launch.env``; ``.zerorun_env`` values go under it (launch/env.py).
        modules: files or dotted modules the ranks import, checked on every remote host.
        master_port: rendezvous port (default: a free one on the first host); a port in use is an error.
        master_addr: the first host's address as every node reaches it (default: :func:`master_address`).
        ssh: how to reach remote hosts; ssh_local: reach this machine's hosts over SSH too.

    Raises:
        ZerorunError: a preflight failure (one line per host), or the master port is in use.
    """
    python = python or sys.executable
    workdir = workdir or os.getcwd()
    extra_env = {**env_file_values(), **(env or {})}
    forwarded = allowed_env()
    remote_hosts = [h for h in hosts if ssh_local or not h.is_local]
    first_remote = bool(remote_hosts) and remote_hosts[0] is hosts[0]
    checks = preflight(remote_hosts, ssh, python=python, workdir=workdir, modules=list(modules),
                       env={**forwarded, **extra_env}, port=(master_port or 0) if first_remote else None,
                       timeout=preflight_timeout) if remote_hosts else []
    reach = Reach(conns={c.host.name: c.conn for c in checks}, port=checks[0].facts["port"] if first_remote else None,
                  cpus={c.host.name: c.facts.get("cpus") for c in checks})
    if not first_remote:
        _refuse_used_port(hosts, master_port)
    plan, _ = plan_job(hosts, job_id, Launcher.SSH, reach, recipe_json=recipe_json, program=program, python=python,
                       extra_env=extra_env, master_port=None if first_remote else master_port,
                       master_addr=master_addr)
    job = Job(plan, workdir=workdir, user_env=frozenset(extra_env))
    for spec in plan.nodes:
        name = spec.host.name
        if name in reach.conns:
            job.nodes.append(RemoteNode(spec, job.lines, reach.conns[name], ssh, forwarded, workdir))
        else:
            job.nodes.append(LocalNode(spec, job.lines, cwd=workdir))
    return job


def prepare_slurm_job(hosts: list[Host], job_id: str, *, recipe_json: str | None = None,
                      program: list[str] | None = None, python: str | None = None, workdir: str | None = None,
                      env: dict[str, str] | None = None, master_port: int | None = None,
                      master_addr: str | None = None, cpus: dict[str, int] | None = None) -> Job:
    """Plan a job on the SLURM allocation's ``hosts`` and make its nodes: one srun step (Note [Slurm launcher]
    in launch/slurm.py), no SSH, no preflight. The master address is the first node's name (or
    ``master_addr``); the port ``master_port``, else one free here (the launcher runs on the first node in a
    batch script; elsewhere, a port free here is a guess: pass ``--master-port``). ``cpus``: the allocation's
    CPUs per node name (each node's OMP_NUM_THREADS, srun's ``--cpus-per-task``).

    Raises:
        ZerorunError: ``master_port`` is in use on this machine when it is the first node.
    """
    from zerorun.launch.slurm import gpus_per_node, srun_argv
    from zerorun.launch.slurm_step import SlurmNode, SlurmStep

    python = python or sys.executable
    workdir = workdir or os.getcwd()
    extra_env = {**env_file_values(), **(env or {})}
    _refuse_used_port(hosts, master_port)
    plan, _ = plan_job(hosts, job_id, Launcher.SLURM, Reach(cpus=cpus or {}), recipe_json=recipe_json,
                       program=program, python=python, extra_env=extra_env, master_port=master_port,
                       master_addr=master_addr)
    argv = srun_argv(hosts, workdir, python, cpus=cpus, job_name=f"zerorun-{job_id}", gpus=gpus_per_node(os.environ))
    job = Job(plan, workdir=workdir, user_env=frozenset(extra_env), srun=argv, grace_s=10.0)
    step = SlurmStep(argv, plan.nodes, job.lines, cwd=workdir)
    job.nodes = [SlurmNode(spec, step) for spec in plan.nodes]
    return job
