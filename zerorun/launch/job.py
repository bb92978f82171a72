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
from zerorun.launch.plan import LaunchPlan, build_plan, free_port, port_in_use
from zerorun.launch.preflight import preflight
from zerorun.launch.remote import RemoteNode, SshOptions
from zerorun.launch.runner import LocalNode


@dataclass
class Job:
    """A planned job: its ``plan``, one node object per host (not started), and the ``lines`` queue they
    stream to."""

    plan: LaunchPlan
    nodes: list = field(default_factory=list)
    lines: "queue.Queue" = field(default_factory=queue.Queue)
    workdir: str = ""
    #: names of the variables from ``launch.env`` and environment files (values never printed)
    user_env: frozenset = frozenset()
    #: the SLURM launcher's srun command (launch/slurm.py), None for the SSH and local launchers
    srun: list[str] | None = None

    def close(self) -> None:
        """Close the SSH connections."""
        for node in self.nodes:
            if isinstance(node, RemoteNode):
                node.close()


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def master_address(hosts: list[Host], remote: dict[str, object]) -> str:
    """The first host's address as every other node reaches it.

    A remote first host: its address from the SSH config (``HostName``, or the name itself). This machine (a
    local first host, or a remote one whose address is loopback): 127.0.0.1 (or that loopback address) when
    every other node is on loopback too, else this machine's address on the route to the first other host
    that is not (the local end of that SSH connection), since a loopback address there is that host itself.
    """
    first = hosts[0].name
    far = [conn for name, conn in remote.items() if name != first and not _is_loopback(conn.host)]
    if first in remote and (not far or not _is_loopback(remote[first].host)):
        return remote[first].host
    if not far:
        return "127.0.0.1"
    return far[0].transport.sock.getsockname()[0]


def prepare_job(hosts: list[Host], job_id: str, *, recipe_json: str | None = None, program: list[str] | None = None,
                python: str | None = None, workdir: str | None = None, env: dict[str, str] | None = None,
                modules: list[str] = (), master_port: int | None = None, master_addr: str | None = None,
                ssh: SshOptions = SshOptions(),
                ssh_local: bool = False, preflight_timeout: float = 15.0) -> Job:
    """Plan a job on ``hosts`` and make its nodes; remote hosts are checked first (launch/preflight.py).

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
    conns = {c.host.name: c.conn for c in checks}
    if first_remote:
        master_port = checks[0].facts["port"]
    elif master_port is None:
        master_port = free_port()
    elif port_in_use(master_port):
        raise ZerorunError(f"--master-port {master_port}: the port is already in use on {socket.gethostname()}")
    plan = build_plan(hosts, recipe_json, job_id, master_port, python, extra_env,
                      master_addr=master_addr or master_address(hosts, conns), program=program,
                      cpus={c.host.name: c.facts.get("cpus") for c in checks})
    job = Job(plan, workdir=workdir, user_env=frozenset(extra_env))
    for spec in plan.nodes:
        name = spec.host.name
        if name in conns:
            job.nodes.append(RemoteNode(spec, job.lines, conns[name], ssh, forwarded, workdir))
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
    if master_port is None:
        master_port = free_port()
    elif hosts[0].is_local and port_in_use(master_port):
        raise ZerorunError(f"--master-port {master_port}: the port is already in use on {socket.gethostname()}")
    plan = build_plan(hosts, recipe_json, job_id, master_port, python, extra_env,
                      master_addr=master_addr or hosts[0].name, program=program, cpus=cpus)
    argv = srun_argv(hosts, workdir, python, cpus=cpus, job_name=f"zerorun-{job_id}", gpus=gpus_per_node(os.environ))
    job = Job(plan, workdir=workdir, user_env=frozenset(extra_env), srun=argv)
    step = SlurmStep(argv, plan.nodes, job.lines, cwd=workdir)
    job.nodes = [SlurmNode(spec, step) for spec in plan.nodes]
    return job
