"""The SLURM launcher, its allocation side: the hosts and slots of the allocation (which launcher a job uses:
launch/launcher.py), and the ``srun`` command that starts one node watcher per node (launch/slurm_step.py runs it).

Note [Slurm launcher]: inside an allocation (``SLURM_JOB_ID`` set by ``salloc`` or an sbatch script) the nodes
are the allocation's, ``SLURM_JOB_NODELIST`` expanded by ``scontrol show hostnames`` (SLURM's own order), and
one job step runs them all: ``srun --nodes=N --ntasks=N --ntasks-per-node=1 --kill-on-bad-exit=1 --input=all
--label ... python -m zerorun.launch.slurm_task``. Each task is a node watcher (launch/node.py) that picks its
node's spec by ``SLURMD_NODENAME`` from the one JSON line the launcher writes on srun's standard input
(broadcast to every task by ``--input=all``; env values and the recipe never on a command line), so node rank
0, and with it the master address (the first node's name), is the first node whatever order SLURM numbers
tasks in. ``--label`` prefixes every line with the task's number; each task's first line maps it to its node.
No SSH is used. Ranks per node: Note [Ranks in an allocation]. The step asks for the CPUs the allocation has
on each node (``--cpus-per-task``, from ``SLURM_JOB_CPUS_PER_NODE``), so a node's torchrun and ranks are not
confined to one CPU where SLURM binds tasks to CPUs.

Note [Ranks in an allocation]: the ranks on each node (slots) are, the first of these that is set:
``--num-procs`` / ``--nproc-per-node`` (on every node); the allocation's GPUs per node (``SLURM_GPUS_ON_NODE``,
else ``SLURM_GPUS_PER_NODE``: one rank per GPU); the allocation's tasks, when they were asked for
(``SLURM_NTASKS``, set by ``-n``/``--ntasks-per-node``): ``SLURM_TASKS_PER_NODE`` expanded, as srun places
tasks, uneven ones included (``-N2 -n3``: ``2,1``, 3 ranks), so ``salloc -N2 -n4`` runs 4 ranks whatever the
recipe says (the stderr note says the recipe's count is not used); else the recipe's ``launch.procs_per_node``
(``zerorun launch``: 1) on every node, refused in one line where a node has fewer CPUs
(``SLURM_JOB_CPUS_PER_NODE``: ``salloc -N1`` gives one) than that. A word (Note [Ranks per node] in
launch/slots.py): ``auto`` is the allocation's GPUs, else the tasks, else 1; ``gpu`` the allocation's GPUs
(none: an error); ``cpu`` the allocation's CPUs on each node (``SLURM_JOB_CPUS_PER_NODE``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import MAX_SLOTS, Host

#: the srun options zerorun always passes (Note [Slurm launcher]); the node count, node list, CPUs and working
#: folder are added per job.
SRUN_FIXED = ("--ntasks-per-node=1", "--kill-on-bad-exit=1", "--input=all", "--label", "--mpi=none")


#: SLURM_STEP_ID values at or above this are SLURM's special steps, not srun's: 0xfffffffa the interactive step
#: (the shell of salloc with LaunchParameters=use_interactive_step), 0xfffffffb the batch script, 0xfffffffc
#: the extern step (slurm/slurm.h: SLURM_INTERACTIVE_STEP, SLURM_BATCH_SCRIPT, SLURM_EXTERN_CONT).
SPECIAL_STEPS = 0xFFFFFFF0


def refuse_inside_step(environ=None) -> None:
    """Refuse to start a SLURM-launched job from inside an srun job step (``srun zerorun train``): its own srun
    step would wait, silently and for ever, for the CPUs the enclosing step holds. SLURM's special steps
    (:data:`SPECIAL_STEPS`: an interactive salloc shell, the batch script) are not srun's and pass.

    Raises:
        ZerorunError: ``SLURM_STEP_ID`` is an srun step's id.
    """
    env = os.environ if environ is None else environ
    step = env.get("SLURM_STEP_ID")
    if step is None or (step.isdigit() and int(step) >= SPECIAL_STEPS):
        return
    raise ZerorunError(f"started inside a SLURM job step (SLURM_STEP_ID={step}: under srun): zerorun starts its own "
                       "srun step, so run it directly in the salloc shell or the sbatch script, not under srun (or "
                       "give --launcher local to run one machine's job per task)")


def expand_counts(text: str, name: str = "SLURM_JOB_CPUS_PER_NODE") -> list[int]:
    """SLURM's compressed per-node counts as a list: ``"72(x2),36"`` -> ``[72, 72, 36]``.

    Raises:
        ZerorunError: ``text`` is not in that form (``name`` names the variable).
    """
    counts: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ZerorunError(f"{name}={text!r}: expected counts like '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def gpus_per_node(environ) -> int | None:
    """GPUs of the allocation on each node, or None when it has none: ``SLURM_GPUS_ON_NODE`` (set in batch
    scripts and steps), else ``SLURM_GPUS_PER_NODE`` (``4``, ``a100:4`` or ``a100:2,v100:2``: the counts summed).

    Raises:
        ZerorunError: a value that is not in that form.
    """
    on_node = environ.get("SLURM_GPUS_ON_NODE")
    if on_node:
        if not on_node.strip().isdigit():
            raise ZerorunError(f"SLURM_GPUS_ON_NODE={on_node!r}: expected a number")
        return int(on_node) or None
    per_node = environ.get("SLURM_GPUS_PER_NODE")
    if not per_node:
        return None
    return gpu_count(per_node, f"SLURM_GPUS_PER_NODE={per_node!r}") or None


def gpu_count(text: str, source: str) -> int:
    """GPUs in one per-node GPU value, SLURM's ``--gpus-per-node`` form (``8``, ``a100:8``, ``a100:4,v100:4``:
    summed).

    Raises:
        ZerorunError: ``source`` (what the value is, e.g. ``SLURM_GPUS_PER_NODE='x'``) and the expected form.
    """
    total = 0
    for part in text.split(","):
        m = re.fullmatch(r"\s*(?:[\w.-]+:)*(\d+)\s*", part)
        if not m:
            raise ZerorunError(f"{source}: expected a GPU count like 4 or a100:4")
        total += int(m.group(1))
    return total


def slots_per_node(environ, recipe_slots: int | str, num_procs: int | str | None = None, count: int = 1
                   ) -> tuple[list[int], str]:
    """Ranks on each of the allocation's ``count`` nodes and where they come from (Note [Ranks in an
    allocation]; ``recipe_slots`` and ``num_procs`` may be ``auto``/``gpu``/``cpu``: Note [Ranks per node]).

    Raises:
        ZerorunError: a malformed SLURM variable (named), task counts for another number of nodes, the recipe's
            count above the CPUs of a node, ``gpu`` in an allocation without GPUs, ``cpu`` without
            ``SLURM_JOB_CPUS_PER_NODE``, or a count above :data:`MAX_SLOTS`.
    """
    if num_procs == "auto" or num_procs == "gpu" and gpus_per_node(environ):
        num_procs = None  # the rules below: the allocation's GPUs first
    if num_procs is not None:
        slots, source = _word_slots(environ, num_procs, "--num-procs", count), "--num-procs"
    elif gpus_per_node(environ):
        slots, source = [gpus_per_node(environ)] * count, "the allocation's GPUs per node"
    elif any(environ.get(k) for k in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE")):
        slots, source = _task_slots(environ, count)
        if isinstance(recipe_slots, int) and any(n != recipe_slots for n in slots):
            source += f"; not the recipe's launch.procs_per_node {recipe_slots}"
    else:
        slots = _word_slots(environ, recipe_slots, "launch.procs_per_node", count)
        source = "launch.procs_per_node" + (f" {recipe_slots}" if isinstance(recipe_slots, str) else "")
        if isinstance(recipe_slots, int):
            _refuse_above_cpus(environ, recipe_slots, count)
    for n in slots:
        if not 1 <= n <= MAX_SLOTS:
            raise ZerorunError(f"{source}: {n} ranks on a node, expected 1 to {MAX_SLOTS}")
    return slots, source


def _word_slots(environ, value: int | str, name: str, count: int) -> list[int]:
    """``value`` ranks on each node of an allocation whose GPUs are not counted here: a number as given,
    ``auto`` 1 (no GPU in the allocation), ``cpu`` each node's CPUs (``SLURM_JOB_CPUS_PER_NODE``).

    Raises:
        ZerorunError: ``gpu`` (the allocation has no GPU), ``cpu`` without the CPU counts of every node.
    """
    if isinstance(value, int) or value == "auto":
        return [value if isinstance(value, int) else 1] * count
    if value == "gpu":
        raise ZerorunError(f"{name} gpu: the SLURM allocation has no GPU (SLURM_GPUS_ON_NODE and "
                           "SLURM_GPUS_PER_NODE unset): ask for them (--gpus-per-node) or give a number")
    text = environ.get("SLURM_JOB_CPUS_PER_NODE")
    cpus = expand_counts(text) if text else []
    if len(cpus) != count:
        raise ZerorunError(f"{name} cpu: the allocation's CPUs per node are not known "
                           f"(SLURM_JOB_CPUS_PER_NODE={text!r}); give a number")
    return cpus


def _task_slots(environ, count: int) -> tuple[list[int], str]:
    """The allocation's tasks on each node, as srun starts them: ``SLURM_TASKS_PER_NODE`` expanded (``2,1``
    for ``-N2 -n3``), else ``SLURM_NTASKS_PER_NODE`` on every node."""
    text = environ.get("SLURM_TASKS_PER_NODE")
    if text:
        counts = expand_counts(text, "SLURM_TASKS_PER_NODE")
        if len(counts) != count:
            raise ZerorunError(f"SLURM_TASKS_PER_NODE={text!r}: {len(counts)} node counts for the allocation's "
                               f"{count} nodes")
        return counts, f"SLURM_TASKS_PER_NODE={text}"
    text = environ.get("SLURM_NTASKS_PER_NODE", "")
    if not text.strip().isdigit() or int(text) < 1:
        raise ZerorunError(f"SLURM_NTASKS_PER_NODE={text!r}: expected a positive number")
    return [int(text)] * count, "SLURM_NTASKS_PER_NODE"


def _refuse_above_cpus(environ, ranks: int, count: int) -> None:
    """Refuse the recipe's ranks per node where a node of the allocation has fewer CPUs (``salloc -n1`` and a
    recipe of 4 ranks: 4 ranks on one CPU, silently, before).

    Raises:
        ZerorunError: the one line, with the ways out.
    """
    text = environ.get("SLURM_JOB_CPUS_PER_NODE")
    cpus = expand_counts(text) if text else []
    if len(cpus) == count and ranks > min(cpus):
        raise ZerorunError(f"launch.procs_per_node {ranks}: more ranks than the {min(cpus)} CPU"
                           f"{'s' * (min(cpus) != 1)} SLURM allocated on a node (SLURM_JOB_CPUS_PER_NODE={text}); "
                           f"ask for the tasks (salloc/sbatch --ntasks-per-node={ranks}), or give --num-procs")


def describe_slots(hosts: list[Host], source: str) -> str:
    """``4 ranks per node (from SOURCE)``, or ``3 ranks: 2, 1 per node (from SOURCE)`` for uneven counts."""
    counts = [h.slots for h in hosts]
    if len(set(counts)) == 1:
        return f"{counts[0]} rank{'s' if counts[0] > 1 else ''} per node (from {source})"
    return f"{sum(counts)} ranks: {', '.join(map(str, counts))} per node (from {source})"


def scontrol() -> str:
    """The path of ``scontrol``.

    Raises:
        ZerorunError: SLURM's client commands are not installed here.
    """
    found = shutil.which("scontrol")
    if not found:
        raise ZerorunError("SLURM_JOB_ID is set but scontrol is not on PATH: the SLURM launcher needs SLURM's "
                           "client commands (srun, scontrol, scancel)")
    return found


def expand_nodelist(nodelist: str) -> list[str]:
    """Node names of a SLURM node list (``node[01-03],gpu7``) in SLURM's order: ``scontrol show hostnames``.

    Raises:
        ZerorunError: scontrol is missing, fails, or prints no name (its message included).
    """
    try:
        out = subprocess.run([scontrol(), "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        raise ZerorunError(f"SLURM_JOB_NODELIST={nodelist}: scontrol show hostnames did not answer in 30 s") from None
    names = out.stdout.split()
    if out.returncode != 0 or not names:
        why = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise ZerorunError(f"SLURM_JOB_NODELIST={nodelist}: scontrol show hostnames failed: {why}")
    return names


def allocation_nodelist(environ=None) -> str:
    """The allocation's node list (``SLURM_JOB_NODELIST``, else ``SLURM_NODELIST``).

    Raises:
        ZerorunError: neither is set.
    """
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ZerorunError("SLURM_JOB_ID is set but SLURM_JOB_NODELIST is not: run zerorun in the allocation's "
                           "shell or batch script")
    return nodelist


def allocation_hosts(recipe_slots: int | str, num_nodes: int | None = None, num_procs: int | str | None = None,
                     environ=None, nodes_flag: str = "") -> tuple[list[Host], str]:
    """The allocation's nodes as hosts, in SLURM's order, and the source of their slot count
    (:func:`slots_per_node`). ``num_nodes``: the first N nodes only (``nodes_flag``: the flag and value that gave
    it, for messages; default ``--num-nodes N``).

    Raises:
        ZerorunError: no node list, ``num_nodes`` above the allocation's nodes, or a bad SLURM variable (named).
    """
    env = os.environ if environ is None else environ
    nodelist = allocation_nodelist(env)
    names = expand_nodelist(nodelist)
    slots, source = slots_per_node(env, recipe_slots, num_procs, len(names))
    if num_nodes is not None:
        if num_nodes > len(names):
            raise ZerorunError(f"{nodes_flag or f'--num-nodes {num_nodes}'}: the allocation has {len(names)} node"
                               f"{'s' if len(names) > 1 else ''} ({nodelist})")
        names = names[:num_nodes]
    return [Host(name, n) for name, n in zip(names, slots)], source


def allocation_cpus(environ=None) -> dict[str, int]:
    """CPUs the allocation has on each node (name -> count) from ``SLURM_JOB_CPUS_PER_NODE``; empty when it is
    unset or does not match the node list.

    Raises:
        ZerorunError: a malformed ``SLURM_JOB_CPUS_PER_NODE``.
    """
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_CPUS_PER_NODE"):
        return {}
    names = expand_nodelist(allocation_nodelist(env))
    counts = expand_counts(env["SLURM_JOB_CPUS_PER_NODE"])
    return dict(zip(names, counts)) if len(counts) == len(names) else {}


def srun_argv(hosts: list[Host], workdir: str, python: str | None = None, job_id: str | None = None,
              cpus: dict[str, int] | None = None, job_name: str | None = None, gpus: int | None = None) -> list[str]:
    """The ``srun`` command that starts one node watcher per host (Note [Slurm launcher]): one task per node of
    ``hosts`` (the allocation's node names), in ``workdir``, with the nodes' ``python``, in job ``job_id``
    (default: ``SLURM_JOB_ID``), asking for the smallest of the ``cpus`` counts of those nodes per task and,
    with ``gpus``, that many GPUs per node (the allocation's, :func:`gpus_per_node`). No value of the recipe
    or of ``launch.env`` is on it."""
    argv = [shutil.which("srun") or "srun"]
    job = job_id or os.environ.get("SLURM_JOB_ID")
    if job:
        argv.append(f"--jobid={job}")
    if job_name:
        argv.append(f"--job-name={job_name}")
    argv += [f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", *SRUN_FIXED,
             f"--nodelist={','.join(h.name for h in hosts)}"]
    counts = [(cpus or {}).get(h.name) for h in hosts]
    if counts and all(counts):
        argv.append(f"--cpus-per-task={min(counts)}")
    if gpus:
        argv.append(f"--gpus-per-node={gpus}")
    argv += [f"--chdir={workdir}", python or sys.executable, "-m", "zerorun.launch.slurm_task"]
    return argv


def render_srun(argv: list[str]) -> str:
    """``argv`` as one shell line."""
    return " ".join(shlex.quote(a) for a in argv)
