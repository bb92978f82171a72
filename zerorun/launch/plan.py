"""The launch plan: which node runs how many ranks, and the exact torchrun command line and environment.

Pure data, built before anything starts, so it can be printed (``--dry-run``) and tested.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field

from zerorun.hostfile import Host
from zerorun.launch.marks import JOB_ENV, NODE_DIR  # JOB_ENV: checkpoint.py reads it here
from zerorun.zero.allocator import ALLOCATOR_VAR, ALLOCATORS, INSTALL_HINT, MMAP_THRESHOLD  # noqa: F401
from zerorun.zero.allocator import allocator_problem
from zerorun.zero.allocator import ENV as GLIBC_ENV  # torch-free; MMAP_THRESHOLD: benchmarks import it here

# Note [Rank allocator] (zerorun/zero/allocator.py, with the figures): ZERORUN_ALLOCATOR chooses each rank's malloc
# (``auto``, the default: gperftools' tcmalloc where the node has it, else mimalloc from its pip wheel, a zerorun
# dependency, else glibc tuned; or one of them by name: zero.allocator.ALLOCATORS). Resolved on each node by its
# watcher (:func:`allocator_env`), not here. glibc's tuning (GLIBC_ENV, Note [Returning freed memory]): a fixed mmap
# threshold, so freed tensors of 1 MiB or more go back to the OS instead of staying in the heap, and 2 MiB pages.
#: sonames of gperftools' tcmalloc, preferred first (Debian/Ubuntu: libtcmalloc-minimal4, libgoogle-perftools4).
TCMALLOC_SONAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
#: tcmalloc prints a line for every allocation above this many bytes (default 1 GiB): never, for a rank.
TCMALLOC_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50)}
#: mimalloc keeps what a rank frees instead of returning it to the kernel after 1 s (its default, shorter than a
#: step: every step faulted its memory in again) and reusing it, as tcmalloc does (Note [Rank allocator]).
MIMALLOC_KEEP = {"MIMALLOC_PURGE_DELAY": "-1"}


def rank_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The allocator variable the launcher gives every rank (Note [Rank allocator]): the launcher's own
    ``ZERORUN_ALLOCATOR`` (``environ``, default ``os.environ``) if set, else ``auto``; the job's environment files
    and ``launch.env`` override it, and each node's watcher turns it into that node's variables with
    :func:`allocator_env`.

    Raises:
        ZerorunError: the launcher's ``ZERORUN_ALLOCATOR`` is not one of ``zero.allocator.ALLOCATORS``.
    """
    value = (os.environ if environ is None else environ).get(ALLOCATOR_VAR) or "auto"
    if allocator_problem(value):
        from zerorun.errors import ZerorunError

        raise ZerorunError(f"environment: {allocator_problem(value)}")
    return {ALLOCATOR_VAR: value}


def find_tcmalloc() -> str | None:
    """The soname of a tcmalloc this machine's dynamic loader finds (its ``ldconfig`` cache), or None."""
    import ctypes.util

    for soname in TCMALLOC_SONAMES:
        name = soname[3:].split(".so")[0]
        if ctypes.util.find_library(name) == soname:
            return soname
    return None


def allocator_env(env: dict[str, str], tcmalloc: str | None, mimalloc: str | None = None) -> dict[str, str]:
    """The variables that carry out Note [Rank allocator] for ranks whose environment is ``env`` (this node's
    variables with the job's on top), on a node where ``tcmalloc`` (a soname) and ``mimalloc`` (a path: the
    pip wheel's library, :func:`zerorun.zero.allocator.find_mimalloc`) are found (None: not there).

    ``auto`` preloads tcmalloc, else mimalloc (``LD_PRELOAD``), unless the job (or the node) preloads a library
    itself (which may be an allocator: ``ZERORUN_ALLOCATOR=preload``) or sets ``MALLOC_MMAP_THRESHOLD_``;
    ``tcmalloc`` and ``mimalloc`` preload that one unless the job preloads its own; mimalloc gets
    :data:`MIMALLOC_KEEP` unless the job sets it. Otherwise, and for
    ``glibc``, glibc's tuning (:data:`GLIBC_ENV`) where the job does not set those variables. The result also
    names the choice made (``ZERORUN_ALLOCATOR=tcmalloc``, ``mimalloc``, ``preload`` or ``glibc``) and always
    has :data:`TCMALLOC_QUIET`, which only a tcmalloc reads; the rank reports what it really runs under
    (:func:`zerorun.zero.allocator.name`).

    Raises:
        ValueError: ``ZERORUN_ALLOCATOR`` is not one of ``ALLOCATORS`` (a recipe's ``launch.env`` is checked
            before launch: :func:`zerorun.recipe_text.check_env`), or names an allocator this node lacks.
    """
    choice = env.get(ALLOCATOR_VAR, "auto")
    if choice not in ALLOCATORS:
        raise ValueError(f"{ALLOCATOR_VAR}={choice!r}: expected one of {', '.join(ALLOCATORS)}")
    found = {"tcmalloc": tcmalloc, "mimalloc": mimalloc}
    if choice in found and not found[choice]:
        raise ValueError(f"{ALLOCATOR_VAR}={choice}, but this node has no {choice} (install: {INSTALL_HINT})")
    quiet = {**TCMALLOC_QUIET, **{k: env[k] for k in TCMALLOC_QUIET if k in env}}
    if choice == "auto" and "MALLOC_MMAP_THRESHOLD_" not in env:  # the job tuning glibc asks for glibc
        choice = "tcmalloc" if tcmalloc else "mimalloc" if mimalloc else "glibc"
    if choice in found and not env.get("LD_PRELOAD"):
        keep = {**MIMALLOC_KEEP, **{k: env[k] for k in MIMALLOC_KEEP if k in env}} if choice == "mimalloc" else {}
        return {**quiet, **keep, "LD_PRELOAD": found[choice], ALLOCATOR_VAR: choice}
    label = "preload" if env.get("LD_PRELOAD") else "glibc"
    return {**GLIBC_ENV, **{k: env[k] for k in GLIBC_ENV if k in env}, **quiet, ALLOCATOR_VAR: label}


def fallback_note(env: dict[str, str], resolved: dict[str, str], host: str) -> str | None:
    """One line for a node whose ranks ``auto`` left under glibc tuned for want of tcmalloc and mimalloc
    (``env``: their environment before :func:`allocator_env`, ``resolved``: its result), else None."""
    if env.get(ALLOCATOR_VAR, "auto") != "auto" or resolved.get(ALLOCATOR_VAR) != "glibc":
        return None
    if "MALLOC_MMAP_THRESHOLD_" in env:  # the job tunes glibc itself: its choice
        return None
    return (f"zerorun: note: {host} has neither tcmalloc nor mimalloc: its ranks run under glibc tuned, the slow "
            f"fallback (install: {INSTALL_HINT})")


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
            default: ``-m zerorun.worker`` with the recipe.
        cpus: CPU count per host name (from preflight), for each node's OMP_NUM_THREADS (default: this
            machine's).
    """
    if master_addr is None:
        master_addr = "127.0.0.1" if hosts[0].is_local else hosts[0].name
    files = {}
    if program is None:
        program = ["-m", "zerorun.worker", "--recipe-file", f"{NODE_DIR}/recipe.json"]
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
