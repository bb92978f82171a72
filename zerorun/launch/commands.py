"""Each node's launch command as a shell line: what ``--dry-run`` prints and ``commands.sh`` in a run folder
records.

Note [Printed commands]: a node is started by its watcher (launch/node.py), which gets torchrun's argv, the
environment and the recipe through a pipe, never a command line. The line printed here is the watcher's
torchrun command as a shell would run it: ``cd WORKDIR && env NAME=VALUE ... PYTHON -m zerorun.launch.torchrun
... -m zerorun.rank.worker --recipe-file FOLDER/recipe.json``, with the resolved master address and port. The values
of ``launch.env`` and of environment files (launch/env.py) may be secrets, so they are never printed: a comment
names them, and the line takes them from the shell's environment (``NAME="$NAME"``). The variables zerorun sets
itself (job id, threads, allocator choice) are printed with their values; ``ZERORUN_ALLOCATOR=auto`` is what the
watcher resolves on its node (Note [Rank allocator]: ``LD_PRELOAD`` of tcmalloc where the node has it), so the
line run by hand gives its ranks glibc tuned unless ``LD_PRELOAD=libtcmalloc_minimal.so.4`` is put in front.
"""

from __future__ import annotations

import shlex

from zerorun.launch.marks import NODE_DIR
from zerorun.launch.plan import LaunchPlan, NodeSpec
from zerorun.telemetry.format import count


def node_command(spec: NodeSpec, workdir: str, node_dir: str, hidden: set[str] = frozenset()) -> str:
    """``spec``'s torchrun command as one shell line run in ``workdir``, its private folder being ``node_dir``
    (a path, or a shell expression such as ``"$ZERORUN_NODE_DIR"``, left unquoted); variables in ``hidden``
    are taken from the environment by name (Note [Printed commands]), except ``CUDA_VISIBLE_DEVICES`` where
    zerorun sets it itself over ``launch.env``'s (the node's selected slots: plan.build_plan)."""
    if spec.host.slot_ids is not None:
        hidden = set(hidden) - {"CUDA_VISIBLE_DEVICES"}
    env = " ".join(f'{k}="${k}"' if k in hidden else f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
    argv = " ".join(_quote_with(a, node_dir) for a in spec.argv)
    return f"cd {shlex.quote(workdir)} && env {env} {argv}"


def _quote_with(arg: str, node_dir: str) -> str:
    if NODE_DIR not in arg:
        return shlex.quote(arg)
    head, _, tail = arg.partition(NODE_DIR)
    return (shlex.quote(head) if head else "") + node_dir + (shlex.quote(tail) if tail else "")


def _ranks(spec: NodeSpec) -> str:
    """``ranks 0..3``, or ``rank 0`` for a node of one."""
    last = spec.first_rank + spec.nproc - 1
    return f"rank {last}" if spec.nproc == 1 else f"ranks {spec.first_rank}..{last}"


def render(plan: LaunchPlan, workdir: str, node_dirs: dict[int, str], hidden: set[str] = frozenset()) -> str:
    """Every node's command (:func:`node_command`) under a ``# node N on HOST: ranks A..B`` comment, and a
    comment naming the ``hidden`` variables, as a shell script's text."""
    lines = [f"# job {plan.job_id}: {count(plan.world_size, 'rank')}, master {plan.master_addr}:{plan.master_port}"]
    if hidden:
        lines.append("# values not shown (launch.env, environment files): set them in the shell first: "
                     + ", ".join(sorted(hidden)))
    for spec in plan.nodes:
        where = "here" if spec.host.is_local else f"on {spec.host.name}"
        lines.append(f"# node {spec.node_rank} ({spec.host.name}): {_ranks(spec)}, run {where}")
        lines.append(node_command(spec, workdir, node_dirs[spec.node_rank], hidden))
    return "\n".join(lines) + "\n"


def render_slurm(plan: LaunchPlan, workdir: str, node_dirs: dict[int, str], hidden: set[str],
                 srun: list[str]) -> str:
    """The SLURM launcher's step as a shell script's text: the exact ``srun`` command zerorun runs (as a comment:
    its tasks read the nodes' specs from standard input, Note [Slurm launcher] in launch/slurm.py), then the
    same step as one srun line that runs as printed: the same options, each task running its node's
    :func:`node_command`, chosen by ``SLURMD_NODENAME``."""
    lines = [f"# job {plan.job_id}: {count(plan.world_size, 'rank')}, master {plan.master_addr}:{plan.master_port}"]
    if hidden:
        lines.append("# values not shown (launch.env, environment files): set them in the shell first: "
                     + ", ".join(sorted(hidden)))
    program = srun.index("-m") - 1  # srun's options end where the nodes' python starts
    lines.append("# zerorun runs (every task reads the nodes' specs, the commands below, on standard input):")
    lines.append("#   " + " ".join(shlex.quote(a) for a in srun))
    cases = []
    for spec in plan.nodes:
        lines.append(f"# node {spec.node_rank} ({spec.host.name}): {_ranks(spec)}, srun's task on {spec.host.name}")
        cases.append(f"{shlex.quote(spec.host.name)}) {node_command(spec, workdir, node_dirs[spec.node_rank], hidden)}"
                     " ;;")
    script = 'case "$SLURMD_NODENAME" in\n' + "\n".join(cases) + "\nesac"
    lines.append(" ".join(shlex.quote(a) for a in srun[:program]) + " bash -c " + shlex.quote(script))
    return "\n".join(lines) + "\n"
