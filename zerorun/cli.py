"""The ``zerorun`` command line (typer)."""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import typer

from zerorun.errors import JobFailed, ZerorunError
from zerorun.hostfile import MAX_SLOTS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="zerorun: launch and run ZeRO data-parallel training jobs.")


def _err(message: str) -> None:
    sys.stderr.write("".join(f"zerorun: error: {line}\n" for line in message.splitlines() or [""]))
    sys.stderr.flush()


# Options shared by `train` and `launch` (hosts, selection, SSH).
_HOSTFILE = typer.Option(None, "-H", "--hostfile", help="DeepSpeed-style hostfile.")
_MASTER_PORT = typer.Option(None, "--master-port", "--master_port", min=1, max=65535,
                            help="Rendezvous port on the first host (default: a free one found there).")
_MASTER_ADDR = typer.Option(None, "--master-addr", "--master_addr",
                            help="The first host's address as every node reaches it (default: found from the "
                                 "hostfile and the SSH config).")
_INCLUDE = typer.Option(None, "--include", help="Only these hosts/slots: 'host1@host2:0,1'.")
_EXCLUDE = typer.Option(None, "--exclude", help="All but these hosts/slots: 'host1@host2:0,1'.")
_NUM_NODES = typer.Option(None, "--num-nodes", min=1, help="Use the first N hosts.")


def _procs(value: Optional[str]):
    """``--nproc-per-node``: N or gpu|cpu|auto, as torchrun takes it (Note [Ranks per node], launch/slots.py)."""
    from zerorun.hostfile import parse_procs

    try:
        return None if value is None else parse_procs(value, "")
    except ValueError as e:
        raise typer.BadParameter(str(e).strip()) from None


_PROCS_HELP = ("Ranks per node: N, gpu (one per visible GPU), cpu (one per CPU, as torchrun) or auto (one per visible "
               "GPU, else 1; torchrun's auto is one per CPU there); with -H at most each host's slots (gpu, auto: "
               "all of them).")
_NUM_PROCS = typer.Option(None, "--nproc-per-node", "--nproc_per_node", "--num-procs", metavar="N|gpu|cpu|auto",
                          callback=_procs, help=_PROCS_HELP + " Default: launch.procs_per_node (auto).")
# `zerorun launch` takes torchrun's names too
_NNODES = typer.Option(None, "--nnodes", "--num-nodes", min=1, help="Use the first N hosts (also --num-nodes).")
_NPROC = typer.Option(None, "--nproc-per-node", "--nproc_per_node", "--num-procs", metavar="N|gpu|cpu|auto",
                      callback=_procs, help=_PROCS_HELP + " Default: 1, as torchrun's.")
_SSH_USER = typer.Option(None, "--ssh-user", help="SSH user (default: from ~/.ssh/config, else yours).")
_SSH_PORT = typer.Option(None, "--ssh-port", min=1, max=65535, help="SSH port (default: from ~/.ssh/config, 22).")
_SSH_KEY = typer.Option(None, "--ssh-key", help="The only SSH private key to use (default: ~/.ssh/config's).")
_SSH_CONFIG = typer.Option(None, "--ssh-config", help="SSH config file to read instead of ~/.ssh/config.")
_SSH_LOCAL = typer.Option(False, "--ssh-local", help="Reach this machine's hosts (localhost) over SSH too.")
_LAUNCHER = typer.Option(None, "--launcher", metavar="ssh|slurm|local",
                         help="How nodes start: ssh (the hostfile's hosts; this machine without -H), slurm (the "
                              "allocation's nodes through srun), local (this machine). Default: slurm inside a SLURM "
                              "allocation (SLURM_JOB_ID) without -H, else ssh.")


#: the longest ``--preflight-timeout`` (seconds: a day; a thread's join overflows past about 9.2e9).
MAX_PREFLIGHT_S = 86400.0


def _preflight_seconds(value: float) -> float:
    """``--preflight-timeout``: seconds from 1 to :data:`MAX_PREFLIGHT_S` (typer's own ``min`` check would say
    "greater than or equal to 1" of ``nan``, and let ``inf`` or ``1e10`` through to the preflight's thread
    joins, which raise OverflowError)."""
    if not 1 <= value <= MAX_PREFLIGHT_S:  # nan too
        raise typer.BadParameter(f"expected seconds from 1 to {MAX_PREFLIGHT_S:g} (a day); got {value:g}")
    return value


_PREFLIGHT_S = typer.Option(15.0, "--preflight-timeout", callback=_preflight_seconds,
                            help="Seconds preflight may take, all hosts (1 to 86400).")


def _version(value: bool) -> None:
    if value:
        import zerorun

        print(f"zerorun {zerorun.__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print zerorun's version and exit.")) -> None:
    """zerorun: launch and run ZeRO data-parallel training jobs."""


@app.command("env")
def env_report(
    hostfile: Optional[str] = typer.Option(None, "-H", "--hostfile", help="Also check that these hosts are "
                                           "reachable (local ones without SSH, the others over SSH)."),
    ssh_user: Optional[str] = _SSH_USER, ssh_port: Optional[int] = _SSH_PORT, ssh_key: Optional[str] = _SSH_KEY,
    ssh_config: Optional[str] = _SSH_CONFIG,
) -> None:
    """Print what a bug report needs: zerorun, python and torch versions, backends, CPU and GPUs, the
    launcher's libraries (fabric, paramiko, ...), and with -H whether each host is reachable."""
    from zerorun import envinfo
    from zerorun.launch import ssh_options

    ssh = ssh_options(ssh_user, ssh_port, ssh_key, ssh_config)
    sys.stdout.write(envinfo.report(hostfile, ssh))


@app.command(context_settings={"allow_extra_args": False})
def train(
    recipe: str = typer.Argument(..., help="Recipe YAML file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="FIELD=VALUE overrides, e.g. zero.stage=2."),
    hostfile: Optional[str] = _HOSTFILE,
    master_port: Optional[int] = _MASTER_PORT, master_addr: Optional[str] = _MASTER_ADDR,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print each node's launch command and exit."),
    resume: Optional[str] = typer.Option(None, "--resume", metavar="[PATH]",
                                         help="Resume from the latest checkpoint in checkpoint.dir (default "
                                         "<log.dir>/<name>/checkpoints), or start from step 0 when there is none; "
                                         "or from PATH, which must exist."),
    include: Optional[str] = _INCLUDE, exclude: Optional[str] = _EXCLUDE,
    num_nodes: Optional[int] = _NUM_NODES, num_procs: Optional[str] = _NUM_PROCS,
    ssh_user: Optional[str] = _SSH_USER, ssh_port: Optional[int] = _SSH_PORT, ssh_key: Optional[str] = _SSH_KEY,
    ssh_config: Optional[str] = _SSH_CONFIG, ssh_local: bool = _SSH_LOCAL, preflight_timeout: float = _PREFLIGHT_S,
    no_dashboard: bool = typer.Option(False, "--no-dashboard",
                                      help="Plain one-line progress instead of the live dashboard."),
    launcher: Optional[str] = _LAUNCHER,
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="Write the run into this folder (made if "
                                          "missing) instead of a new <log.dir>/<name>/<time> (zerorun submit's "
                                          "batch script uses it)."),
    max_restarts: Optional[int] = typer.Option(None, "--max-restarts", "--max_restarts", min=0,
                                               help="Start a failed job again from its latest checkpoint up to N "
                                               "times (launch.max_restarts)."),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", metavar="[MIN:]N", help="torchrun's: use the first N "
                                         "hosts; with MIN, a restart continues without lost hosts while MIN remain "
                                         "(launch.min_nodes)."),
) -> None:
    """Train RECIPE on every rank of the hostfile (or on localhost with launch.procs_per_node ranks)."""
    import uuid

    from zerorun import checkpoint_lock, launch as zlaunch
    from zerorun.launch.restart import check_min_nodes, restart_options, run_training
    from zerorun.recipe import load_recipe
    from zerorun.resume import prepare_resume

    # the optimizer and HF checks import torch: the model check does them beside the launch (zerorun/modelcheck.py,
    # Note [HF checks after the header] in zerorun/hf/files.py)
    launcher = zlaunch.choose_launcher(launcher, hostfile)
    r = load_recipe(recipe, overrides or [], check_optimizer=False, check_hf=False)
    num_nodes = restart_options(r, max_restarts, nnodes, num_nodes)
    said: list[str] = []  # said once the job may start (a job refused by the lock starts nothing: one line)
    if not prepare_resume(r, resume, say=said.append):  # sets checkpoint.resume and .dir (Note [Resume lookup])
        _say(said)
        return  # the checkpoint is the last step's: done
    hosts = zlaunch.select(hostfile, r.launch.procs_per_node, include, exclude, num_nodes, num_procs, launcher,
                           job_env=r.launch.env)
    check_min_nodes(r, hosts)
    ssh = zlaunch.ssh_options(ssh_user, ssh_port, ssh_key, ssh_config)
    local = any(h.is_local for h in hosts)  # else no model check runs: the launcher does the HF checks itself
    if dry_run:  # nothing is contacted; the commands run as printed, then the recipe's checks that need torch
        _say(said)
        sys.stdout.write(zlaunch.dry_run(r, hosts, master_port=master_port, master_addr=master_addr,
                                         launcher=launcher, ssh=ssh, ssh_local=ssh_local))
        sys.stdout.flush()
        if local:
            from zerorun import modelcheck

            problem = modelcheck.start(r, recipe, overrides or [], beside=False).wait()
            if problem:
                raise ZerorunError(problem)
        elif r.model.hf is not None or r.data.kind == "hf":
            load_recipe(recipe, overrides or [], check_optimizer=False)
        return
    if not local and (r.model.hf is not None or r.data.kind == "hf"):
        load_recipe(recipe, overrides or [], check_optimizer=False)
    if r.checkpoint.dir:
        try:
            os.makedirs(r.checkpoint.dir, exist_ok=True)
        except OSError as e:
            raise ZerorunError(f"checkpoint.dir: cannot create {r.checkpoint.dir}: {e.strerror}") from None
    job_id = uuid.uuid4().hex[:12]
    with checkpoint_lock.held(r.checkpoint.dir, job_id, r.name):  # Note [Checkpoint folder lock]
        _say(said)
        result = run_training(r, hosts, recipe_path=recipe, overrides=overrides or [],
                              dashboard=not no_dashboard, master_port=master_port, master_addr=master_addr,
                              ssh=ssh, ssh_local=ssh_local, preflight_timeout=preflight_timeout, run_dir=run_dir,
                              launcher=launcher, job_id=job_id)  # Note [Job restarts]
    if not result.ok:
        raise result.error()


def _say(lines: list[str]) -> None:
    for line in lines:
        print(line, flush=True)


@app.command(context_settings={"allow_extra_args": False})
def submit(
    ctx: typer.Context,
    recipe: str = typer.Argument(..., help="Recipe YAML file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="FIELD=VALUE overrides, as zerorun train takes "
                                                    "them; after '--': more sbatch arguments."),
    nodes: int = typer.Option(1, "--nodes", "-N", min=1, help="Nodes to allocate (one torchrun agent on each)."),
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
    save_before: int = typer.Option(120, "--save-before", min=0, metavar="SECONDS",
                                    help="With checkpoint.dir: SIGUSR1 this long before the time limit makes the "
                                    "ranks save and stop (--signal=B:USR1@SECONDS); 0: none."),
) -> None:
    """Submit RECIPE as a SLURM batch job: the run folder is made first, the batch script written into it
    (submit.sbatch: edit and resubmit it with sbatch) and submitted; prints the job id and the run folder.
    Example: zerorun submit recipe.yaml zero.stage=3 --nodes 2 --time 01:00:00 -- --gres=gpu:8"""
    from zerorun.launch.slurm_submit import SubmitOptions, submit as run

    options = SubmitOptions(nodes=nodes, procs_per_node=procs_per_node, time=time_limit, partition=partition,
                            account=account, job_name=job_name, resume=resume, gpus_per_node=gpus_per_node,
                            save_before=save_before,
                            sbatch_args=tuple((ctx.obj or {}).get("sbatch_args", ())))
    run(recipe, overrides or [], options, dry_run=dry_run, command=["zerorun", *sys.argv[1:]])


@app.command()
def attach(
    job_id: str = typer.Argument(..., metavar="JOBID", help="A SLURM job id (zerorun submit prints it)."),
    no_dashboard: bool = typer.Option(False, "--no-dashboard",
                                      help="Plain one-line progress instead of the live dashboard."),
) -> None:
    """Follow a SLURM job's metrics with the live dashboard until it ends (a pending job: waits for it; an ended
    one: its summary). Exits with the job's exit status; Ctrl-C stops following, not the job."""
    from zerorun.launch.slurm_attach import attach as run

    code = run(job_id, dashboard=not no_dashboard)
    if code:
        raise typer.Exit(code)


@app.command()
def consolidate(
    ckpt_dir: str = typer.Argument(..., help="A checkpoint folder (step-N), or a folder of them (the latest)."),
    out: str = typer.Option(..., "--out", "-o", help="Output file: NAME.safetensors or NAME.pt; with --hf a folder."),
    hf: bool = typer.Option(False, "--hf", help="Write a Hugging Face folder (model.hf recipes): config.json, "
                            "safetensors shards, tokenizer files; AutoModelForCausalLM.from_pretrained loads it."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="With --hf: largest weight file."),
) -> None:
    """Write the model of a sharded checkpoint as one fp32 state dict (no training processes needed)."""
    from zerorun.checkpoint import consolidate as run
    from zerorun.telemetry.console import human_bytes

    if hf:
        from zerorun.hf.export import export_hf

        count, nbytes = export_hf(ckpt_dir, out, max_shard_size=max_shard_size)
        print(f"zerorun: wrote {count} weight file{'s' * (count != 1)} ({human_bytes(nbytes)}) to {out}")
        return
    count, nbytes = run(ckpt_dir, out)
    print(f"zerorun: wrote {count} tensors ({human_bytes(nbytes)}) to {out}")


@app.command("import-deepspeed")
def import_deepspeed(
    ds_config: str = typer.Argument(..., help="A DeepSpeed config (JSON)."),
    hostfile: Optional[str] = typer.Option(None, "--hostfile", "-H", help="DeepSpeed hostfile: its slots split "
                                           "train_batch_size and set launch.procs_per_node."),
    lr: Optional[float] = typer.Option(None, "--lr", help="The learning rate, for the config's \"auto\" "
                                       "(the HF Trainer's learning_rate)."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Optimizer steps, for \"auto\" (max_steps)."),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size", min=1, help="Samples per rank per "
                                                   "micro-step, for \"auto\" (per_device_train_batch_size)."),
) -> None:
    """Print a recipe made from a DeepSpeed config (ZeRO stage, offload, precision and loss scaling, clipping,
    batch sizes, optimizer, scheduler, bucket sizes, monitors); HF Trainer "auto" values from --lr, --steps,
    --micro-batch-size or its defaults; what to fill in and the fields it drops are listed in it and on stderr."""
    from zerorun.hf.deepspeed import import_deepspeed as run

    text, dropped, fill_in = run(ds_config, hostfile, lr=lr, steps=steps, micro_batch_size=micro_batch_size)
    sys.stdout.write(text)
    for line in fill_in:
        sys.stderr.write(f"zerorun: fill in {line}\n")
    for line in dropped:
        sys.stderr.write(f"zerorun: dropped {line}\n")


@app.command(context_settings={"allow_extra_args": True, "allow_interspersed_args": False})
def launch(
    script: str = typer.Argument(..., metavar="SCRIPT", help="Your training script (with -m: a module), run on "
                                 "every rank by torchrun; options after it are the script's."),
    args: Optional[List[str]] = typer.Argument(None, help="Arguments for the script."),
    module: bool = typer.Option(False, "-m", "--module", help="SCRIPT is a module, run as python -m does."),
    hostfile: Optional[str] = _HOSTFILE,
    master_port: Optional[int] = _MASTER_PORT, master_addr: Optional[str] = _MASTER_ADDR,
    include: Optional[str] = _INCLUDE, exclude: Optional[str] = _EXCLUDE,
    num_nodes: Optional[int] = _NNODES, num_procs: Optional[str] = _NPROC,
    ssh_user: Optional[str] = _SSH_USER, ssh_port: Optional[int] = _SSH_PORT, ssh_key: Optional[str] = _SSH_KEY,
    ssh_config: Optional[str] = _SSH_CONFIG, ssh_local: bool = _SSH_LOCAL, preflight_timeout: float = _PREFLIGHT_S,
    log_dir: str = typer.Option("runs", "--log-dir", help="Runs are written under LOG_DIR/<script>/<time>/."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print each node's command and exit."),
    standalone: bool = typer.Option(False, "--standalone", help="torchrun's: this machine alone, a local "
                                    "rendezvous (what zerorun launch does without -H; refused with -H)."),
    no_dashboard: bool = typer.Option(False, "--no-dashboard",
                                      help="Plain one-line progress instead of the live dashboard."),
    launcher: Optional[str] = _LAUNCHER,
    max_restarts: int = typer.Option(0, "--max-restarts", "--max_restarts", min=0, help="Run the script again "
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
    if not module and not os.path.isfile(script):
        raise ZerorunError(f"{script}: no such script")
    job = zlaunch.Script(script if module else os.path.abspath(script), tuple(args or ()), module, log_dir)
    hosts = zlaunch.select(hostfile, 1, include, exclude, num_nodes, num_procs, launcher)
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


@app.command(context_settings={"allow_extra_args": False})
def bench(
    recipe: str = typer.Argument(..., help="Recipe YAML file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="FIELD=VALUE overrides for every job."),
    hostfile: Optional[List[str]] = typer.Option(None, "-H", "--hostfile",
                                                 help="A hostfile to bench on; repeat for several."),
    stages: str = typer.Option("0,1,2,3", "--stages", help="ZeRO stages, comma-separated."),
    steps: int = typer.Option(30, "--steps", min=1, help="Measured optimizer steps per job."),
    warmup: int = typer.Option(5, "--warmup", min=0, help="Optimizer steps left out before measuring."),
    baseline: str = typer.Option("", "--baseline", help="Baselines to run too: ddp, fsdp2 (comma-separated)."),
    repeat: int = typer.Option(1, "--repeat", min=1, help="Runs per combination; the median is reported."),
    nodes: Optional[str] = typer.Option(None, "--nodes", help="Inside a SLURM allocation, instead of -H: node "
                                        "counts, comma-separated (1,2: the allocation's first node, then its first "
                                        "two), each run through the slurm launcher."),
) -> None:
    """Run RECIPE on every hostfile at every stage (and the baselines) and compare them: bench.json, bench.csv,
    bench.png in <log.dir>/<name>/bench-<timestamp>/. Exit code 1 when any combination failed."""
    from zerorun.bench import parse_baselines, parse_nodes, parse_stages, run_bench

    failed, total, bench_dir = run_bench(recipe, overrides or [], hostfile or [], parse_stages(stages),
                                         parse_baselines(baseline), steps, warmup, repeat, nodes=parse_nodes(nodes))
    if failed:
        raise JobFailed(f"bench: {failed} of {total} combinations failed (reasons in {bench_dir}/bench.json)")


@app.command(context_settings={"allow_extra_args": False})
def estimate(
    recipe: Optional[str] = typer.Argument(None, help="Recipe YAML file (or give --params)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="FIELD=VALUE overrides, e.g. train.micro_batch_size=4."),
    hostfile: Optional[str] = typer.Option(None, "-H", "--hostfile", help="DeepSpeed-style hostfile."),
    params: Optional[str] = typer.Option(None, "--params", help="Parameter count without a recipe: 7B, 350M."),
    largest_layer: Optional[str] = typer.Option(None, "--largest-layer", help="With --params: parameters of the "
                                                "largest layer (stage 3 gathers it), e.g. 0.5B."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="Nodes (default: the hostfile's, else 1)."),
    procs_per_node: Optional[int] = typer.Option(None, "--procs-per-node", min=1,
                                                 help="Ranks per node (default: hostfile slots or "
                                                      "launch.procs_per_node)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp32, bf16 or fp16 (fp32 master); "
                                            "default: the recipe's, else fp32."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="adam (2 states), sgd (momentum: 1), none, "
                                            "or a torch.optim name; default: the recipe's, else adam."),
    device_memory: Optional[str] = typer.Option(None, "--gpu-memory", "--device-memory", help="Per rank: 80GiB, "
                                                "80GB (default: the -H hosts', else this machine's; on CPU host "
                                                "memory / ranks per node)."),
    cpu_memory: Optional[str] = typer.Option(None, "--host-memory", "--cpu-memory", help="Host memory per node "
                                             "(default: the smallest of the -H hosts', else this machine's)."),
    ssh_user: Optional[str] = _SSH_USER, ssh_port: Optional[int] = _SSH_PORT, ssh_key: Optional[str] = _SSH_KEY,
    ssh_config: Optional[str] = _SSH_CONFIG,
    bandwidth: str = typer.Option("100Gbps", "--bandwidth", help="Link speed per rank: 100Gbps, 12.5GB/s."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", min=1, help="Samples per micro-batch "
                                              "(default: train.micro_batch_size, else 1)."),
    offload: Optional[str] = typer.Option(None, "--offload", help="Optimizer offload rows besides none: none, "
                                          "cpu, disk or all (default: the recipe's zero.offload_optimizer if "
                                          "set, else all)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (bytes, seconds) instead of tables."),
) -> None:
    """Estimate memory per rank and communication per step for ZeRO stages 0-3 before launching."""
    from zerorun import estimate as est
    from zerorun.launch import ssh_options

    result = est.from_arguments(recipe=recipe, overrides=overrides or [], hostfile=hostfile, params=params,
                                largest_layer=largest_layer, nodes=nodes, procs_per_node=procs_per_node,
                                precision=precision, optimizer=optimizer, device_memory=device_memory,
                                cpu_memory=cpu_memory, bandwidth=bandwidth, micro_batch=micro_batch,
                                offload=offload, ssh=ssh_options(ssh_user, ssh_port, ssh_key, ssh_config))
    if as_json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        est.render(result)


@app.command()
def show(
    run_dir: str = typer.Argument(..., help="A run folder (runs/<name>/<timestamp>), or runs/<name> for its "
                                            "latest run."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Also draw loss and memory per rank over steps into "
                                                            "this image file (needs matplotlib)."),
) -> None:
    """Print the summary of a run again (from its metrics.jsonl) and how the job ended; --plot draws loss and
    memory."""
    from zerorun.launch.slurm_attach import follow_submitted
    from zerorun.telemetry.show import show as run

    code = None if plot else follow_submitted(run_dir)  # a zerorun submit job still queued or running
    if code is None:
        run(run_dir, plot)
    elif code:
        raise typer.Exit(code)


def optional_value(argv: list[str], option: str, default: str) -> list[str]:
    """``argv`` with ``option`` given ``default`` where it has no value of its own (typer options always take
    one): at the end, before another option, or before a ``FIELD=VALUE`` override that is not a path."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == option:
            nxt = out[i + 1] if i + 1 < len(out) else None
            if nxt is None or nxt.startswith("-") or ("=" in nxt and not os.path.exists(nxt)):
                out[i] = f"{option}={default}"
    return out


def split_sbatch_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``zerorun submit``'s arguments and, after its ``--``, the extra sbatch arguments (click would mix them
    into the overrides); other commands' ``argv`` unchanged, with no sbatch arguments."""
    if argv[:1] == ["submit"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def main() -> None:
    """Console entry point: run the typer app; a :class:`ZerorunError` becomes one line and its exit code."""
    try:
        argv, sbatch_args = split_sbatch_args(optional_value(sys.argv[1:], "--resume", "latest"))
        code = app(args=argv, standalone_mode=False, obj={"sbatch_args": sbatch_args})
        if isinstance(code, int) and code:  # typer.Exit(code): attach passes on the job's exit status
            sys.exit(code)
    except ZerorunError as e:
        _err(str(e))
        sys.exit(e.exit_code)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        _err("interrupted")
        sys.exit(130)
    except Exception as e:  # click's (typer's) usage errors: one line, as every other bad input
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare `zerorun`: the help was printed, nothing failed
            sys.exit(0)
        if type(e).__name__ == "NoSuchOption" and sys.argv[1:2] == ["submit"]:
            from zerorun.launch.slurm_submit import misplaced_option

            _err(misplaced_option(sys.argv[1:], e.option_name))
            sys.exit(2)
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            _err(" ".join(e.format_message().split()) + hint)
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort":
            _err("aborted")
            sys.exit(130)
        raise
