"""``zerorun train`` and ``zerorun launch``: start a job on every host of a hostfile (or on this machine) and
follow it to its end."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import typer

from zerorun.cli.options import (EXCLUDE, HOSTFILE, INCLUDE, LAUNCHER, MASTER_ADDR, MASTER_PORT, NNODES,
                                  NNODES_NAMES, NO_DASHBOARD, NPROC, NUM_NODES, NUM_PROCS, PREFLIGHT_S, PROCS_NAMES,
                                  SSH_CONFIG, SSH_KEY, SSH_LOCAL, SSH_PORT, SSH_USER, as_typed)
from zerorun.errors import INT64_MAX, ZerorunError


def train(
    recipe: str = typer.Argument(..., help="Recipe YAML file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="FIELD=VALUE overrides, e.g. zero.stage=2."),
    hostfile: Optional[str] = HOSTFILE,
    master_port: Optional[int] = MASTER_PORT, master_addr: Optional[str] = MASTER_ADDR,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print each node's launch command and exit."),
    resume: Optional[str] = typer.Option(None, "--resume", metavar="[PATH]",
                                         help="Resume from the latest checkpoint in checkpoint.dir (default "
                                         "<log.dir>/<name>/checkpoints), or start from step 0 when there is none; "
                                         "or from PATH, which must exist."),
    include: Optional[str] = INCLUDE, exclude: Optional[str] = EXCLUDE,
    num_nodes: Optional[int] = NUM_NODES, num_procs: Optional[str] = NUM_PROCS,
    ssh_user: Optional[str] = SSH_USER, ssh_port: Optional[int] = SSH_PORT, ssh_key: Optional[str] = SSH_KEY,
    ssh_config: Optional[str] = SSH_CONFIG, ssh_local: bool = SSH_LOCAL, preflight_timeout: float = PREFLIGHT_S,
    no_dashboard: bool = NO_DASHBOARD,
    launcher: Optional[str] = LAUNCHER,
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="Write the run into this folder (made if "
                                          "missing) instead of a new <log.dir>/<name>/<timestamp>-<job> (zerorun submit's "
                                          "batch script uses it)."),
    max_restarts: Optional[int] = typer.Option(None, "--max-restarts", "--max_restarts", min=0, max=INT64_MAX,
                                               help="Start a failed job again from its latest checkpoint up to N "
                                               "times (launch.max_restarts)."),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", metavar="[MIN:]N", help="torchrun's: use the first N "
                                         "hosts; with MIN, a restart continues without lost hosts while MIN remain "
                                         "(launch.min_nodes)."),
) -> None:
    """Train RECIPE on every rank of the hostfile (or on localhost with launch.procs_per_node ranks)."""
    import uuid

    from zerorun import launch as zlaunch
    from zerorun.checkpoint import lock as checkpoint_lock
    from zerorun.launch.restart import check_min_nodes, restart_options, run_training
    from zerorun.recipe import load_recipe
    from zerorun.checkpoint.resume import batch_change, prepare_resume

    # the optimizer and HF checks import torch: the model check does them beside the launch (zerorun/rank/modelcheck.py,
    # Note [HF checks after the header] in zerorun/hf/files.py)
    launcher = zlaunch.choose_launcher(launcher, hostfile)
    r = load_recipe(recipe, overrides or [], check_optimizer=False, check_hf=False)
    num_nodes = restart_options(r, max_restarts, nnodes, num_nodes)
    said: list[str] = []  # said once the job may start (a job refused by the lock starts nothing: one line)
    if not prepare_resume(r, resume, say=said.append):  # sets checkpoint.resume and .dir (Note [Resume lookup])
        _say(said)
        return  # the checkpoint is the last step's: done
    hosts = zlaunch.select(hostfile, r.launch.procs_per_node, include, exclude, num_nodes, num_procs, launcher,
                           job_env=r.launch.env, nodes_flag=f"--nnodes {nnodes}" if nnodes else "",
                           procs_flag=as_typed(num_procs, *PROCS_NAMES))
    check_min_nodes(r, hosts)
    _check_hierarchy(r, hosts)
    said += [line for line in [batch_change(r, sum(h.slots for h in hosts))] if line]
    rule = _slots_rule(r, hosts, hostfile, num_procs, launcher)
    if rule:  # on stderr, as the notes on what a procs_per_node word became (launch/hosts.py)
        sys.stderr.write(rule + "\n")
    ssh = zlaunch.ssh_options(ssh_user, ssh_port, ssh_key, ssh_config)
    local = any(h.is_local for h in hosts)  # else no model check runs: the launcher does the HF checks itself
    if dry_run:  # nothing is contacted; the commands run as printed, then the recipe's checks that need torch
        _say(said)
        sys.stdout.write(zlaunch.dry_run(r, hosts, master_port=master_port, master_addr=master_addr,
                                         launcher=launcher, ssh=ssh, ssh_local=ssh_local))
        sys.stdout.flush()
        _check_after_dry_run(r, recipe, overrides or [], local)
        return
    if not local and (r.model.hf is not None or r.data.kind == "hf"):
        load_recipe(recipe, overrides or [], check_optimizer=False)
    _make_checkpoint_dir(r)
    job_id = uuid.uuid4().hex[:12]
    with checkpoint_lock.held(r.checkpoint.dir, job_id, r.name):  # Note [Checkpoint folder lock]
        _say(said)
        result = run_training(r, hosts, recipe_path=recipe, overrides=overrides or [],
                              dashboard=not no_dashboard, master_port=master_port, master_addr=master_addr,
                              ssh=ssh, ssh_local=ssh_local, preflight_timeout=preflight_timeout, run_dir=run_dir,
                              launcher=launcher, job_id=job_id)  # Note [Job restarts]
    if not result.ok:
        raise result.error()


def _slots_rule(r, hosts, hostfile: str | None, num_procs, launcher) -> str | None:
    """One line where the recipe sets ``launch.procs_per_node`` and a hostfile's ``slots=`` decide instead (as
    DeepSpeed's launcher: found by review, silently ignored), else None."""
    from zerorun import launch as zlaunch

    given = r.launch.procs_per_node
    if not hostfile or launcher is zlaunch.Launcher.LOCAL or num_procs is not None \
            or "procs_per_node" not in r.launch.model_fields_set or {h.slots for h in hosts} == {given}:
        return None
    return (f"zerorun: launch.procs_per_node {given} is for runs without a hostfile: each host of {hostfile} runs "
            f"its slots= ranks ({', '.join(f'{h.name} {h.slots}' for h in hosts)}); --num-procs N runs N on each")


def _say(lines: list[str]) -> None:
    for line in lines:
        print(line, flush=True)


def _check_after_dry_run(r, recipe: str, overrides: list[str], local: bool) -> None:
    """The recipe's checks that need torch, after ``train --dry-run`` printed its commands: the model check on
    this machine when a host is local, else the HF checks (raises ZerorunError: the check's one line)."""
    from zerorun.recipe import load_recipe

    if local:
        from zerorun.rank import modelcheck

        problem = modelcheck.start(r, recipe, overrides, beside=False).wait()
        if problem:
            raise ZerorunError(problem)
    elif r.model.hf is not None or r.data.kind == "hf":
        load_recipe(recipe, overrides, check_optimizer=False)


def _make_checkpoint_dir(r) -> None:
    """Make ``checkpoint.dir`` when the recipe has one (raises ZerorunError naming the field when it cannot)."""
    if r.checkpoint.dir:
        try:
            os.makedirs(r.checkpoint.dir, exist_ok=True)
        except OSError as e:
            raise ZerorunError(f"checkpoint.dir: cannot create {r.checkpoint.dir}: {e.strerror}") from None


def launch(
    script: str = typer.Argument(..., metavar="SCRIPT", help="Your training script (with -m: a module), run on "
                                 "every rank by torchrun; options after it are the script's."),
    args: Optional[List[str]] = typer.Argument(None, help="Arguments for the script."),
    module: bool = typer.Option(False, "-m", "--module", help="SCRIPT is a module, run as python -m does."),
    hostfile: Optional[str] = HOSTFILE,
    master_port: Optional[int] = MASTER_PORT, master_addr: Optional[str] = MASTER_ADDR,
    include: Optional[str] = INCLUDE, exclude: Optional[str] = EXCLUDE,
    num_nodes: Optional[int] = NNODES, num_procs: Optional[str] = NPROC,
    ssh_user: Optional[str] = SSH_USER, ssh_port: Optional[int] = SSH_PORT, ssh_key: Optional[str] = SSH_KEY,
    ssh_config: Optional[str] = SSH_CONFIG, ssh_local: bool = SSH_LOCAL, preflight_timeout: float = PREFLIGHT_S,
    log_dir: str = typer.Option("runs", "--log-dir", help="Runs are written under LOG_DIR/<script>/<timestamp>-<job>/."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print each node's command and exit."),
    standalone: bool = typer.Option(False, "--standalone", help="torchrun's: this machine alone, a local "
                                    "rendezvous (what zerorun launch does without -H; refused with -H)."),
    no_dashboard: bool = NO_DASHBOARD,
    launcher: Optional[str] = LAUNCHER,
    max_restarts: int = typer.Option(0, "--max-restarts", "--max_restarts", min=0, max=INT64_MAX,
                                     help="Run the script again "
                                     "after a failure, up to N times (it resumes itself, as under torchrun)."),
) -> None:
    """Run your own SCRIPT on every rank of the hostfile (or one local rank per --nproc-per-node), with the same
    streaming and teardown as `train`; the script may report steps with zerorun.report(). torchrun's habits
    work: zerorun launch --nproc-per-node 2 -m pkg.train --lr 3e-4."""
    from zerorun import launch as zlaunch

    if standalone and hostfile:
        raise ZerorunError("--standalone runs on this machine alone: drop it or -H")
    launcher = zlaunch.choose_launcher("local" if standalone and launcher is None else launcher, hostfile)
    if standalone and launcher is not zlaunch.Launcher.LOCAL:
        raise ZerorunError(f"--standalone runs on this machine alone: drop it or --launcher {launcher}")
    if not module and not os.path.isfile(script):  # a folder said "no such script" (a review)
        raise ZerorunError(f"{script}: " + ("a folder, not a script (give the .py file, or -m for a module)"
                                            if os.path.isdir(script) else "no such script"))
    job = zlaunch.Script(script if module else os.path.abspath(script), tuple(args or ()), module, log_dir)
    hosts = zlaunch.select(hostfile, 1, include, exclude, num_nodes, num_procs, launcher,
                           nodes_flag=as_typed(num_nodes, *NNODES_NAMES), procs_flag=as_typed(num_procs, *PROCS_NAMES))
    if dry_run:
        sys.stdout.write(zlaunch.dry_run(job, hosts, master_port=master_port, master_addr=master_addr,
                                         launcher=launcher, ssh=zlaunch.ssh_options(ssh_user, ssh_port, ssh_key,
                                                                                    ssh_config),
                                         ssh_local=ssh_local))
        return
    from zerorun.launch.restart import run_training

    result = run_training(job, hosts, max_restarts=max_restarts, dashboard=not no_dashboard, master_port=master_port,
                          master_addr=master_addr, ssh=zlaunch.ssh_options(ssh_user, ssh_port, ssh_key, ssh_config),
                          ssh_local=ssh_local, preflight_timeout=preflight_timeout, launcher=launcher)
    if not result.ok:
        raise result.error()


def _check_hierarchy(recipe, hosts) -> None:
    """``zero.hierarchy`` against the hosts of the launch plan (one node each, Note [Nodes of a group]), before
    anything starts: what the ranks would refuse at their setup (zero/placement.py ``hierarchy_on_nodes``).

    Raises:
        ZerorunError: the line the ranks would raise, with the hosts.
    """
    if recipe.zero.hierarchy is None or recipe.runtime != "zero":
        return
    from zerorun.zero.placement import hierarchy_on_nodes

    try:
        hierarchy_on_nodes(recipe.zero.hierarchy, tuple(h.slots for h in hosts))
    except ValueError as e:
        raise ZerorunError(f"{e} (hosts: {', '.join(f'{h.name} x{h.slots}' for h in hosts)})") from None
