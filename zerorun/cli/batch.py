"""``zerorun submit`` and ``zerorun attach``: a recipe as a SLURM batch job, and following one to its end."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from zerorun.cli.options import NO_DASHBOARD
from zerorun.errors import INT64_MAX
from zerorun.recipe.hostfile import MAX_SLOTS


def submit(
    ctx: typer.Context,
    recipe: str = typer.Argument(..., help="Recipe YAML file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="FIELD=VALUE overrides, as zerorun train takes "
                                                    "them; after '--': more sbatch arguments."),
    nodes: int = typer.Option(1, "--nodes", "-N", min=1, max=INT64_MAX,
                              help="Nodes to allocate (one torchrun agent on each)."),
    procs_per_node: Optional[int] = typer.Option(None, "--procs-per-node", min=1, max=MAX_SLOTS,
                                                 help="Ranks per node (default: launch.procs_per_node)."),
    time_limit: Optional[str] = typer.Option(None, "--time", "-t", help="sbatch's --time, e.g. 01:00:00."),
    partition: Optional[str] = typer.Option(None, "--partition", "-p", help="sbatch's --partition."),
    account: Optional[str] = typer.Option(None, "--account", "-A", help="sbatch's --account."),
    job_name: Optional[str] = typer.Option(None, "--job-name", "-J", help="Default: the recipe's name."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the batch script into the run folder and print "
                                 "it; do not submit."),
    resume: Optional[str] = typer.Option(None, "--resume", metavar="[PATH]", help="As zerorun train's, in the job."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", min=1, max=MAX_SLOTS,
                                                help="GPUs per node to ask for; one rank per GPU (also from "
                                                "sbatch's --gpus-per-node/--gres after '--')."),
    save_before: int = typer.Option(120, "--save-before", min=0, max=INT64_MAX, metavar="SECONDS",
                                    help="With checkpoint.dir: SIGUSR1 this long before the time limit makes the "
                                    "ranks save and stop (--signal=B:USR1@SECONDS); 0: none."),
) -> None:
    """Submit RECIPE as a SLURM batch job: the run folder is made first, the batch script written into it
    (submit.sbatch: edit and resubmit it with sbatch) and submitted; prints the job id and the run folder.
    sbatch's own options go after '--': zerorun submit recipe.yaml --nodes 2 -- --gres=gpu:8."""
    from zerorun.slurm.submit import SubmitOptions, submit as run

    options = SubmitOptions(nodes=nodes, procs_per_node=procs_per_node, time=time_limit, partition=partition,
                            account=account, job_name=job_name, resume=resume, gpus_per_node=gpus_per_node,
                            save_before=save_before,
                            sbatch_args=tuple((ctx.obj or {}).get("sbatch_args", ())))
    run(recipe, overrides or [], options, dry_run=dry_run, command=["zerorun", *sys.argv[1:]])


def attach(
    job_id: str = typer.Argument(..., metavar="JOBID", help="A SLURM job id (zerorun submit prints it)."),
    no_dashboard: bool = NO_DASHBOARD,
) -> None:
    """Follow a SLURM job's metrics with the live dashboard until it ends (a pending job: waits for it; an ended
    one: its summary). Exits with the job's exit status; Ctrl-C stops following, not the job."""
    from zerorun.slurm.attach import attach as run

    code = run(job_id, dashboard=not no_dashboard)
    if code:
        raise typer.Exit(code)
