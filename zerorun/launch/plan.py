"""The launch plan: which node runs how many ranks, and the exact torchrun command line and environment.

Pure data, built before anything starts, so it can be printed (``--dry-run``) and tested.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field

from zerorun.allocator import rank_env
from zerorun.recipe.hostfile import Host
from zerorun.launch.marks import JOB_ENV, NODE_DIR



@dataclass(frozen=True)
class NodeSpec:
    """One node of the job: ``host``, its ``node_rank``, ranks ``[first_rank, first_rank + nproc)``, and the
    ``argv`` and extra ``env`` that start torch's launcher there, and ``files`` (name -> text) written to the
    node's private folder (:data:`~zerorun.launch.marks.NODE_DIR` in ``argv``) by its watcher. ``env`` and
    ``files`` reach the node through a pipe, never a command line (Note [Node watcher] in launch/node.py)."""

    host: Host
    node_rank: int
    nproc: int
    first_rank: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchPlan:
    """Every node of a job, the rendezvous address and port, the world size and the job id."""

    nodes: list[NodeSpec]
    world_size: int
    master_addr: str
    master_port: int
    job_id: str

    def node_of_rank(self, rank: int) -> NodeSpec | None:
        """The node that runs global ``rank``."""
        for node in self.nodes:
            if node.first_rank <= rank < node.first_rank + node.nproc:
                return node
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (bound to port 0 and released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when ``port`` on ``host`` cannot be bound (someone listens there)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def build_plan(hosts: list[Host], recipe_json: str | None, job_id: str, master_port: int,
               python: str | None = None, extra_env: dict[str, str] | None = None,
               master_addr: str | None = None, program: list[str] | None = None,
               cpus: dict[str, int] | None = None) -> LaunchPlan:
    """One :class:`NodeSpec` per host, ranks numbered in hostfile order.

    Args:
        hosts: the nodes (a single local host when there is no hostfile).
        recipe_json: the resolved recipe as JSON; each node's watcher writes it to a 0600 file that the
            worker reads (``--recipe-file``), so no value of it is on a command line.
        job_id: marks every process of the job (:data:`JOB_ENV`).
        master_port: the rendezvous port on the first host.
        python: interpreter on the nodes (default: this one).
        extra_env: the recipe's ``launch.env`` (and ``.zerorun_env``'s values, see launch/env.py).
        master_addr: the first host's address as the other nodes reach it (default: 127.0.0.1 for a local
            first host, else its name).
        program: what torchrun runs on every rank (``["script.py", "arg", ...]`` for ``zerorun launch``);
            default: ``-m zerorun.rank.worker`` with the recipe.
        cpus: CPU count per host name (from preflight), for each node's OMP_NUM_THREADS (default: this
            machine's).
    """
    if master_addr is None:
        master_addr = "127.0.0.1" if hosts[0].is_local else hosts[0].name
    files = {}
    if program is None:
        program = ["-m", "zerorun.rank.worker", "--recipe-file", f"{NODE_DIR}/recipe.json"]
        files = {"recipe.json": recipe_json}
    nodes, first = [], 0
    for i, host in enumerate(hosts):
        cores = (cpus or {}).get(host.name) or os.cpu_count() or 1
        # zerorun.launch.torchrun is torchrun with node 0's rendezvous store bound to the master address only
        argv = [python or sys.executable, "-m", "zerorun.launch.torchrun",
                f"--nnodes={len(hosts)}", f"--nproc-per-node={host.slots}", f"--node-rank={i}",
                f"--master-addr={master_addr}", f"--master-port={master_port}", "--max-restarts=0",
                "--monitor-interval=0.2",
                f"--log-dir={NODE_DIR}/torchelastic", *program]
        env = {JOB_ENV: job_id, "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": str(max(1, cores // host.slots)),
               **rank_env(), **(extra_env or {})}
        if host.slot_ids is not None:  # --include host:0,2 selects those devices, as DeepSpeed does
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, host.slot_ids))
        env[JOB_ENV] = job_id  # never overridden: teardown finds the job's processes by it
        nodes.append(NodeSpec(host, i, host.slots, first, argv, env, dict(files)))
        first += host.slots
    return LaunchPlan(nodes, first, master_addr, master_port, job_id)
