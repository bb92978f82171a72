"""Each node's launch command as a shell line: what ``--dry-run`` prints and ``commands.sh`` in a run folder
records.

Note [Printed commands]: a node is started by its watcher (launch/node.py), which gets torchrun's argv, the
environment and the recipe through a pipe, never a command line. The line printed here is the watcher's
torchrun command as a shell would run it: ``cd WORKDIR && env NAME=VALUE ... PYTHON -m zerorun.launch.torchrun
... -m zerorun.worker --recipe-file FOLDER/recipe.json``, with the resolved master address and port. The values
of ``launch.env`` and of environment files (launch/env.py) may be secrets, so they are never printed: a comment
names them, and the line takes them from the shell's environment (``NAME="$NAME"``). The variables zerorun sets
itself (job id, threads, allocator settings) are printed with their values.
"""

from __future__ import annotations

import shlex

from zerorun.launch.node import NODE_DIR
from zerorun.launch.plan import LaunchPlan, NodeSpec


def node_command(spec: NodeSpec, workdir: str, node_dir: str, hidden: set[str] = frozenset()) -> str:
    """``spec``'s torchrun command as one shell line run in ``workdir``, its private folder being ``node_dir``
    (a path, or a shell expression such as ``"$ZERORUN_NODE_DIR"``, left unquoted); variables in ``hidden``
    are taken from the environment by name (Note [Printed commands])."""
    env = " ".join(f'{k}="${k}"' if k in hidden else f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
    argv = " ".join(_quote_with(a, node_dir) for a in spec.argv)
    return f"cd {shlex.quote(workdir)} && env {env} {argv}"


def _quote_with(arg: str, node_dir: str) -> str:
    if NODE_DIR not in arg:
        return shlex.quote(arg)
    head, _, tail = arg.partition(NODE_DIR)
    return (shlex.quote(head) if head else "") + node_dir + (shlex.quote(tail) if tail else "")


def render(plan: LaunchPlan, workdir: str, node_dirs: dict[int, str], hidden: set[str] = frozenset()) -> str:
    """Every node's command (:func:`node_command`) under a ``# node N on HOST: ranks A..B`` comment, and a
    comment naming the ``hidden`` variables, as a shell script's text."""
    lines = [f"# job {plan.job_id}: {plan.world_size} ranks, master {plan.master_addr}:{plan.master_port}"]
    if hidden:
        lines.append("# values not shown (launch.env, environment files): set them in the shell first: "
                     + ", ".join(sorted(hidden)))
    for spec in plan.nodes:
        where = "here" if spec.host.is_local else f"on {spec.host.name}"
        lines.append(f"# node {spec.node_rank} ({spec.host.name}): ranks {spec.first_rank}.."
                     f"{spec.first_rank + spec.nproc - 1}, run {where}")
        lines.append(node_command(spec, workdir, node_dirs[spec.node_rank], hidden))
    return "\n".join(lines) + "\n"
