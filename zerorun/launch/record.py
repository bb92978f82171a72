"""What a run folder records before the job starts: ``recipe.yaml`` (the resolved recipe, ``launch.env`` values
masked) and ``commands.sh`` (each node's launch command, Note [Printed commands] in launch/commands.py)."""

from __future__ import annotations

import os

from zerorun import runfolder
from zerorun.launch.commands import render, render_slurm
from zerorun.launch.plan import LaunchPlan

#: in ``commands.sh``: the node's private folder, made and removed by its watcher (launch/node.py)
NODE_DIR_VAR = '"$ZERORUN_NODE_DIR"'


def write(run_dir: str, plan: LaunchPlan, recipe, workdir: str, user_env: frozenset = frozenset(),
          srun: list[str] | None = None) -> None:
    """Make ``run_dir`` and write ``recipe.yaml`` (when ``recipe`` is a Recipe) and ``commands.sh`` into it;
    with ``srun`` (the SLURM launcher), ``commands.sh`` holds that exact srun command and the step as one srun
    line (launch/commands.py ``render_slurm``).

    Raises:
        OSError: the folder or a file cannot be made.
    """
    os.makedirs(run_dir, exist_ok=True)
    if recipe is not None:
        from zerorun.recipe import masked_yaml

        with open(os.path.join(run_dir, runfolder.RECIPE), "w", encoding="utf-8") as f:
            f.write(masked_yaml(recipe))
    dirs = {n.node_rank: NODE_DIR_VAR for n in plan.nodes}
    text = render_slurm(plan, workdir, dirs, set(user_env), srun) if srun else render(plan, workdir, dirs,
                                                                                       set(user_env))
    note = ("# ZERORUN_NODE_DIR: each node's private folder (the resolved recipe as recipe.json, 0600; torchrun's "
            "logs), made and removed by the node's watcher (python -m zerorun.launch.node)\n")
    with open(os.path.join(run_dir, runfolder.COMMANDS), "w", encoding="utf-8") as f:
        f.write("#!/bin/sh\n" + note + text)
