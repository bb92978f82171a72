"""``--dry-run``: the launch commands of a job, planned as the job plans them (Note [One plan path] in
launch/job.py), contacting no host."""

from __future__ import annotations

import json
import os
import sys
import uuid

from zerorun.recipe.hostfile import Host
from zerorun.launch.launcher import Launcher
from zerorun.launch.script import job_parts


def dry_run(job, hosts: list[Host], *, master_port: int | None = None, master_addr: str | None = None,
            job_id: str | None = None, launcher: Launcher = Launcher.SSH, ssh=None, ssh_local: bool = False) -> str:
    """The launch commands of ``job`` (a Recipe or a :class:`Script`) on ``hosts`` as a shell script's text
    (Note [Printed commands] in launch/commands.py), contacting no host: each runs as printed. The plan is the
    job's own (Note [One plan path] in launch/job.py: the master address with the SSH config's aliases
    resolved as ``ssh`` reads them; the port as Note [Dry-run master port] says). The resolved recipe is
    written, as a node's watcher writes it, to a 0600 ``recipe.json`` in a fresh private folder that the
    commands name, its ``launch.env`` values masked (Note [Masked environment values]: the commands take them
    from the shell, and the worker reads them from its environment). With the SLURM launcher the text is the
    srun command zerorun runs and the same step as one srun line that runs as printed (launch/commands.py
    ``render_slurm``).
    """
    import tempfile

    from zerorun.launch.commands import render, render_slurm
    from zerorun.launch.env import env_file_values
    from zerorun.launch.job import dry_run_reach, plan_job
    from zerorun.launch.node import write_private
    from zerorun.launch.remote import SshOptions

    recipe_json, _, program, launch = job_parts(job)
    if recipe_json is not None:  # the file stays in /tmp: launch.env values masked (the commands take them
        from zerorun.recipe import masked  # from the shell; the worker fills them in from its environment)

        recipe_json = json.dumps(masked(json.loads(recipe_json)))
    extra_env = {**env_file_values(), **(launch.get("env") or {})}
    reach = dry_run_reach(hosts, launcher, ssh or SshOptions(), ssh_local)
    if launcher is Launcher.SLURM:
        from zerorun.launch.job import Reach
        from zerorun.launch.slurm import allocation_cpus

        reach = Reach(cpus=allocation_cpus())
    plan, note = plan_job(hosts, job_id or uuid.uuid4().hex[:12], launcher, reach, recipe_json=recipe_json,
                          program=program, python=launch.get("python") or sys.executable, extra_env=extra_env,
                          master_port=master_port, master_addr=master_addr)
    folder = tempfile.mkdtemp(prefix=f"zerorun-{plan.job_id}-dry-run-")
    write_private(folder, plan.nodes[0].files)
    workdir = launch.get("workdir") or os.getcwd()
    node_dirs = {n.node_rank: folder for n in plan.nodes}
    if launcher is Launcher.SLURM:
        from zerorun.launch.slurm import gpus_per_node, srun_argv

        srun = srun_argv(hosts, workdir, launch.get("python"), cpus=reach.cpus, job_name=f"zerorun-{plan.job_id}",
                         gpus=gpus_per_node(os.environ))
        return render_slurm(plan, workdir, node_dirs, set(extra_env), srun) + (
            f"# nodes without a shared {os.path.dirname(folder)}: copy {folder} to the same path there first\n")
    text = render(plan, workdir, node_dirs, set(extra_env)) + (note + "\n" if note else "")
    if any(not n.host.is_local for n in plan.nodes):
        text += f"# remote nodes: copy {folder} to the same path there first\n"
    return text
