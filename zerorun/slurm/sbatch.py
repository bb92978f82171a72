"""What the sbatch arguments of ``zerorun submit`` ask for: the GPUs per node (and so the ranks per node), a
job array (refused), the time limit and the early save signal (slurm/submit.py writes the script).

Note [Ranks of a submitted job]: the job's ranks per node are, the first that applies: ``--procs-per-node``
(explicit: it may be fewer than the GPUs, never more); the GPUs per node asked for (``--gpus-per-node N`` of
zerorun submit, or ``--gpus-per-node=[type:]N`` / ``--gres=gpu[:type]:N`` given to sbatch after ``--``): one
rank per GPU, as ``launch.procs_per_node: auto`` (the default) does on a GPU machine; the recipe's
``launch.procs_per_node`` (``auto`` without GPUs asked for: 1; ``gpu`` then, or ``cpu``, an error: the count
must be known when the job is submitted).
A recipe that sets ``launch.procs_per_node`` to another count than the GPUs asked for is a one-line error
(2 ranks on 8 GPUs was silent before): ``--procs-per-node`` says which is meant. Two GPU counts that disagree
(zerorun's flag and sbatch's, or ``--gres`` and ``--gpus-per-node``) are an error too. The count goes into
``#SBATCH --ntasks-per-node`` and into the job's ``zerorun train --num-procs``, so both sides agree.

Note [Early save signal]: at the time limit SLURM sends SIGTERM and SIGKILL ``KillWait`` seconds later (30 s
by default), too short for a large model's checkpoint. A submitted job whose recipe saves checkpoints asks for
``--signal=B:USR1@S`` (``--save-before S``, 120 s by default): SIGUSR1 S seconds before the limit (SLURM may send
it up to 60 s earlier still) to the batch shell only (``B:``), which is the launcher (the script ``exec``s it);
the launcher passes it on to every rank as a stop request (launch/supervisor.py) and the ranks save at the next
step boundary and stop (zerorun/rank/stopsignal.py), with the whole rest of the job's time for the save.
"""

from __future__ import annotations

import os
import re

from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import MAX_SLOTS
from zerorun.launch.slurm import gpu_count

#: sbatch's own options that a job array is asked for with (``-a 0-3``, ``--array=0-3``)
_ARRAY = ("-a", "--array")


def option_values(groups: list[list[str]], *names: str) -> list[tuple[str, str]]:
    """``(option, value)`` for every group (slurm/submit.py ``group_args``) that gives one of ``names``:
    ``--name=value``, ``--name value``, ``-x value`` or ``-xvalue``; a missing value is ``""``."""
    found = []
    for group in groups:
        head = group[0]
        for name in names:
            if head == name:
                found.append((name, group[1] if len(group) > 1 else ""))
            elif name.startswith("--") and head.startswith(name + "="):
                found.append((name, head[len(name) + 1:]))
            elif not name.startswith("--") and head.startswith(name) and len(head) > len(name):
                found.append((name, head[len(name):]))
    return found


def refuse_array(groups: list[list[str]]) -> None:
    """Refuse a job array (its tasks would all train into one run folder and one ``checkpoint.dir`` at once),
    and sbatch's own node count (a review: ``-- --nodes=5`` was said "on 1 node").

    Raises:
        ZerorunError: ``--array``/``-a`` or ``--nodes``/``-N`` among the sbatch arguments.
    """
    for name, value in option_values(groups, *_ARRAY):
        raise ZerorunError(f"sbatch {name} {value}: a job array's tasks would all train into one run folder and "
                           "one checkpoint.dir at the same time; submit one job per setting instead (zerorun "
                           "submit RECIPE FIELD=VALUE ..., each gets its own run folder)")
    for name, value in option_values(groups, "--nodes", "-N"):  # the ranks and the message follow zerorun's own
        raise ZerorunError(f"sbatch {name} {value}: give zerorun submit's --nodes instead (the ranks it starts "
                           "and the job's own lines follow it)")


def _gres_gpus(text: str, source: str) -> int | None:
    """GPUs in a ``--gres`` value (``gpu:8``, ``gpu:a100:8``, ``gpu`` = 1, other resources skipped), or None
    when it names no GPU."""
    total = None
    for part in text.split(","):
        words = part.strip().split(":")
        if words[0] != "gpu":
            continue
        if len(words) > 1 and words[-1].isdigit() and len(words) <= 3:
            count = int(words[-1])
        elif len(words) <= 2:  # gpu, gpu:TYPE: one
            count = 1
        else:
            raise ZerorunError(f"{source}: expected gpu:N or gpu:TYPE:N")
        total = (total or 0) + count
    return total


def gpus_asked(groups: list[list[str]], flag: int | None = None) -> int | None:
    """GPUs per node the job asks for (Note [Ranks of a submitted job]): ``flag`` (zerorun submit's
    ``--gpus-per-node``) and the sbatch arguments' ``--gpus-per-node``/``--gres``; None when none.

    Raises:
        ZerorunError: a malformed count, or two counts that disagree (both named).
    """
    counts: list[tuple[int, str]] = [] if flag is None else [(flag, f"--gpus-per-node {flag}")]
    for name, value in option_values(groups, "--gpus-per-node", "--gres"):
        source = f"sbatch {name}={value}"
        count = gpu_count(value, source) if name == "--gpus-per-node" else _gres_gpus(value, source)
        if count is not None:
            counts.append((count, source))
    for count, source in counts[1:]:
        if count != counts[0][0]:
            raise ZerorunError(f"{counts[0][1]} and {source}: two different GPU counts per node; give one")
    return counts[0][0] if counts else None


def ranks_per_node(procs_flag: int | None, gpus: int | None, recipe) -> tuple[int, str]:
    """The submitted job's ranks per node and where the count comes from (Note [Ranks of a submitted job]).

    Raises:
        ZerorunError: more ranks than GPUs per node, a recipe's ``launch.procs_per_node`` that is not the GPU
            count, or a count below 1 or above :data:`MAX_SLOTS`.
    """
    recipe_set = "procs_per_node" in recipe.launch.model_fields_set
    ppn = recipe.launch.procs_per_node
    if ppn == "cpu" and procs_flag is None:  # the CPUs of nodes not yet allocated: unknown at submit time
        raise ZerorunError("launch.procs_per_node cpu: a batch job's ranks per node are needed when it is "
                           "submitted (#SBATCH --ntasks-per-node): give --procs-per-node N")
    if procs_flag is not None:
        if gpus and procs_flag > gpus:
            raise ZerorunError(f"--procs-per-node {procs_flag}: more ranks than the {_gpus(gpus)} per node asked for")
        procs, source = procs_flag, "--procs-per-node"
    elif gpus:
        if recipe_set and isinstance(ppn, int) and ppn != gpus:  # --procs-per-node above the GPUs is refused
            fewer = (f"--procs-per-node {ppn} to run {ppn} rank{'s' * (ppn != 1)} per node" if ppn < gpus else
                     f"--gpus-per-node {ppn} for {ppn} ranks per node")
            raise ZerorunError(f"launch.procs_per_node is {ppn} but the job asks for {_gpus(gpus)} per node: give "
                               f"{fewer}, or launch.procs_per_node={gpus} for one rank per GPU")
        procs, source = gpus, "one rank per GPU"
    elif ppn == "gpu":
        raise ZerorunError("launch.procs_per_node gpu: the job asks for no GPU: give --gpus-per-node N (or "
                           "sbatch's --gres=gpu:N after '--')")
    else:
        procs, source = (1, "launch.procs_per_node auto, no GPU asked for") if ppn == "auto" else (
            ppn, "launch.procs_per_node")
    if not 1 <= procs <= MAX_SLOTS:
        raise ZerorunError(f"{source}: {procs} ranks per node, expected 1 to {MAX_SLOTS}")
    return procs, source


def check_partition_size(nodes: int, groups: list[list[str]], partition: str | None = None) -> None:
    """Refuse a job that asks for more nodes than its partition has (``$SBATCH_PARTITION``, else the last of
    sbatch's ``-p`` after ``--``, else ``partition``, else the default one, as sbatch reads them): SLURM queues it all the same, pending for ever with the reason
    ``PartitionConfig``, and nothing said so (a review). Drained or down nodes count: a job waiting for them is
    queued as before. Nothing is checked where ``scontrol`` cannot say (not on PATH, no answer, several partitions).

    Raises:
        ZerorunError: ``nodes`` above the partition's ``TotalNodes``.
    """
    import shutil
    import subprocess

    given = [v for _, v in option_values(groups, "--partition", "-p")]  # #SBATCH lines: the last one wins; sbatch's
    asked = os.environ.get("SBATCH_PARTITION") or (given[-1] if given else partition)  # environment before them
    if shutil.which("scontrol") is None or (asked is not None and "," in asked):
        return
    try:
        text = subprocess.run(["scontrol", "show", "partition", "-o", *([asked] if asked else [])],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    from zerorun.slurm.jobs import field

    lines = [line for line in text.splitlines() if asked or " Default=YES" in line]
    name, total = (field(lines[0], key) if lines else None for key in ("PartitionName", "TotalNodes"))
    if name and total and total.isdigit() and nodes > int(total):
        raise ZerorunError(f"--nodes {nodes}: partition {name} has {total} node{'s' * (total != '1')}, so the job "
                           "could never start (SLURM would queue it pending for ever: PartitionConfig)")


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' * (n != 1)}"


def time_limit_s(text: str) -> int | None:
    """sbatch's ``--time`` in seconds (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``), None for
    ``UNLIMITED``/``INFINITE`` and ``0`` (SLURM's "no limit").

    Raises:
        ZerorunError: another form.
    """
    if text.strip().lower() in ("unlimited", "infinite", "-1"):
        return None
    m = re.fullmatch(r"\s*(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?\s*", text)
    if not m:
        raise ZerorunError(f"--time {text}: expected minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or "
                           "UNLIMITED")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:  # D-H, D-H:M, D-H:M:S
        total = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    else:
        total = a * 3600 + b * 60 + c if c is not None else a * 60 + (b or 0)
    return total or None  # 0: no limit, as SLURM reads it (a review: it was refused with checkpoints only)


def signal_directive(save_before: int, checkpoints: bool, time_text: str | None) -> str | None:
    """The ``--signal=B:USR1@S`` value of Note [Early save signal], or None (``save_before`` 0, or a recipe
    that saves no checkpoint: then the time limit just ends it).

    Raises:
        ZerorunError: a time limit not longer than ``save_before`` (the signal would come at once).
    """
    if not save_before or not checkpoints:
        return None
    limit = time_limit_s(time_text) if time_text else None
    if limit is not None and limit <= save_before:
        raise ZerorunError(f"--time {time_text}: not longer than --save-before {save_before} s (the save signal "
                           "would come at once); give a smaller --save-before, or 0 for none")
    return f"B:USR1@{save_before}"
