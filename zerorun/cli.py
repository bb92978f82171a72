"""The ``zerorun`` command line (typer)."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import List, Optional

import typer

from zerorun.errors import JobFailed, ZerorunError
from zerorun.hostfile import MAX_SLOTS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="zerorun: launch and run ZeRO data-parallel training jobs.")


def _err(message: str) -> None:
    sys.stderr.write("".join(f"zerorun: error: {line}\n" for line in message.splitlines() or [""]))
    sys.stderr.flush()


# Options shared by `train` and `launch` (hosts, selection, SSH).
_HOSTFILE = typer.Option(None, "-H", "--hostfile", help="DeepSpeed-style hostfile.")
_MASTER_PORT = typer.Option(None, "--master-port", min=1, max=65535,
                            help="Rendezvous port on the first host (default: a free one found there).")
_INCLUDE = typer.Option(None, "--include", help="Only these hosts/slots: 'host1@host2:0,1'.")
_EXCLUDE = typer.Option(None, "--exclude", help="All but these hosts/slots: 'host1@host2:0,1'.")
_NUM_NODES = typer.Option(None, "--num-nodes", min=1, help="Use the first N hosts.")
_NUM_PROCS = typer.Option(None, "--num-procs", min=1, max=MAX_SLOTS, help="Ranks per node (at most its slots).")
_SSH_USER = typer.Option(None, "--ssh-user", help="SSH user (default: from ~/.ssh/config, else yours).")
_SSH_PORT = typer.Option(None, "--ssh-port", min=1, max=65535, help="SSH port (default: from ~/.ssh/config, 22).")
_SSH_KEY = typer.Option(None, "--ssh-key", help="The only SSH private key to use (default: ~/.ssh/config's).")
_SSH_CONFIG = typer.Option(None, "--ssh-config", help="SSH config file to read instead of ~/.ssh/config.")
_SSH_LOCAL = typer.Option(False, "--ssh-local", help="Reach this machine's hosts (localhost) over SSH too.")
_PREFLIGHT_S = typer.Option(15.0, "--preflight-timeout", min=1.0, help="Seconds preflight may take, all hosts.")


def _hosts(hostfile: str | None, default_slots: int, include, exclude, num_nodes, num_procs):
    """The selected hosts: the hostfile's (or localhost with --num-procs, else ``default_slots``, ranks)
    through --include/--exclude, --num-nodes and --num-procs (hostfile.select_hosts)."""
    from zerorun.hostfile import Host, read_hostfile, select_hosts

    hosts = read_hostfile(hostfile) if hostfile else [Host("localhost", num_procs or default_slots)]
    return select_hosts(hosts, include, exclude, num_nodes, num_procs)


def _ssh(user, port, key, config):
    """SSH options from the flags; a key or config file that does not exist is an error."""
    from zerorun.launch.remote import SshOptions

    for flag, path in (("--ssh-key", key), ("--ssh-config", config)):
        if path is not None and not os.path.isfile(path):
            raise ZerorunError(f"{flag} {path}: no such file")
    return SshOptions(user=user, port=port, key=key, config=config)


@app.callback()
def _root() -> None:
    """zerorun: launch and run ZeRO data-parallel training jobs."""


@app.command(context_settings={"allow_extra_args": False})
def train(
    recipe: str = typer.Argument(..., help="Recipe YAML file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="FIELD=VALUE overrides, e.g. zero.stage=2."),
    hostfile: Optional[str] = _HOSTFILE,
    master_port: Optional[int] = _MASTER_PORT,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the launch plan and exit."),
    resume: Optional[str] = typer.Option(None, "--resume", metavar="[PATH]",
                                         help="Resume from the latest checkpoint in checkpoint.dir, or from PATH."),
    include: Optional[str] = _INCLUDE, exclude: Optional[str] = _EXCLUDE,
    num_nodes: Optional[int] = _NUM_NODES, num_procs: Optional[int] = _NUM_PROCS,
    ssh_user: Optional[str] = _SSH_USER, ssh_port: Optional[int] = _SSH_PORT, ssh_key: Optional[str] = _SSH_KEY,
    ssh_config: Optional[str] = _SSH_CONFIG, ssh_local: bool = _SSH_LOCAL, preflight_timeout: float = _PREFLIGHT_S,
    no_dashboard: bool = typer.Option(False, "--no-dashboard",
                                      help="Plain one-line progress instead of the live dashboard."),
) -> None:
    """Train RECIPE on every rank of the hostfile (or on localhost with launch.procs_per_node ranks)."""
    from zerorun.launch.plan import build_plan
    from zerorun.recipe import load_recipe

    r = load_recipe(recipe, overrides or [])
    if resume is not None:
        r.checkpoint.resume = _resume_path(r, resume)
        r.checkpoint.dir = r.checkpoint.dir or os.path.dirname(r.checkpoint.resume)  # keep saving beside it
    hosts = _hosts(hostfile, r.launch.procs_per_node, include, exclude, num_nodes, num_procs)
    if any(h.is_local for h in hosts):  # remote-only jobs: preflight looks for the module on each host
        _check_model(r)
    ssh = _ssh(ssh_user, ssh_port, ssh_key, ssh_config)
    job_id = uuid.uuid4().hex[:12]
    if dry_run:  # nothing is contacted: the master address and port are settled at launch
        plan = build_plan(hosts, r.model_dump_json(), job_id, master_port or 0, r.launch.python, r.launch.env)
        for node in plan.nodes:
            print(f"node {node.node_rank} {node.host.name}: ranks {node.first_rank}..{node.first_rank + node.nproc - 1}")
            print("  " + " ".join(node.argv[:-1]) + " <recipe>")
        return
    if r.checkpoint.dir:
        try:
            os.makedirs(r.checkpoint.dir, exist_ok=True)
        except OSError as e:
            raise ZerorunError(f"checkpoint.dir: cannot create {r.checkpoint.dir}: {e.strerror}") from None
    _run(r, _job(r, hosts, job_id, master_port, ssh, ssh_local, preflight_timeout), dashboard=not no_dashboard)


def _check_model(r) -> None:
    """Build recipe ``r``'s model on the meta device before launching (no parameter memory, a few seconds),
    in a child process with the ranks' interpreter and working directory, so that the user's module-level code
    runs outside the launcher: a missing or broken model module, a missing factory, model.kwargs it does not
    take, a factory that returns no module, or ``zero.units`` naming no class of the model is one line before
    any rank starts. Anything else the check meets (a factory that cannot run on the meta device, a module
    that exits on import) is left to the ranks, which build the model for real and report it.

    Raises:
        ZerorunError: as above, naming the module or the recipe field.
    """
    import subprocess

    code = "import sys; from zerorun.cli import _check_model_here; _check_model_here(sys.stdin.read())"
    try:
        proc = subprocess.run([r.launch.python or sys.executable, "-c", code], input=r.model_dump_json(),
                              capture_output=True, text=True, timeout=300, cwd=r.launch.workdir or None)
    except (OSError, subprocess.TimeoutExpired):
        return
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    if proc.returncode == 2 and last.startswith(_CHECK_PREFIX):
        raise ZerorunError(last[len(_CHECK_PREFIX):])


_CHECK_PREFIX = "zerorun-check: error: "


def _check_model_here(recipe_json: str) -> None:
    """The child of :func:`_check_model`: exit 2 with one ``zerorun-check: error:`` line on stderr when the
    model cannot be what the recipe says, else exit 0."""
    from zerorun.estimate import layout_of_recipe
    from zerorun.recipe import Recipe
    from zerorun.userload import FactoryError

    try:
        layout_of_recipe(Recipe.model_validate_json(recipe_json))
    except FactoryError as e:
        if isinstance(e.__cause__, TypeError):  # a wrong argument (model.kwargs), not the meta device
            sys.stderr.write(f"{_CHECK_PREFIX}{e}\n")
            sys.exit(2)
    except ZerorunError as e:
        sys.stderr.write(f"{_CHECK_PREFIX}{e}\n")
        sys.exit(2)


def _job(r, hosts, job_id: str, master_port: int | None = None, ssh=None, ssh_local: bool = False,
         preflight_timeout: float = 15.0):
    """Preflight ``hosts`` and prepare the job of recipe ``r`` on them (launch/job.py ``prepare_job``):
    nodes ready to start, master address and port settled (``master_port`` None: a free one on the first host).

    Raises:
        ZerorunError: a host fails preflight, or ``master_port`` is already in use.
    """
    from zerorun.launch.job import prepare_job

    modules = [r.model.source()[0]] + ([r.data.module] if r.data.kind == "module" else [])
    return prepare_job(hosts, job_id, recipe_json=r.model_dump_json(), python=r.launch.python,
                       workdir=r.launch.workdir, env=r.launch.env, modules=modules, master_port=master_port,
                       ssh=ssh, ssh_local=ssh_local, preflight_timeout=preflight_timeout)


def _resume_path(recipe, resume: str) -> str:
    """The checkpoint folder ``--resume`` names (``latest``: the latest in ``checkpoint.dir``), checked."""
    from zerorun import checkpoint

    if resume == "latest":
        if not recipe.checkpoint.dir:
            raise ZerorunError("--resume: checkpoint.dir is not set in the recipe, so there is no latest "
                               "checkpoint; give --resume PATH")
        found = checkpoint.latest(recipe.checkpoint.dir)
        if found is None:
            raise ZerorunError(f"--resume: no complete checkpoint in {recipe.checkpoint.dir}")
        resume = found
    path = checkpoint.resolve(resume)
    checkpoint.check(path)
    return path


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
) -> None:
    """Print a recipe made from a DeepSpeed config (ZeRO stage, offload, precision and loss scaling, clipping,
    batch sizes, optimizer, scheduler, bucket sizes); the fields it drops are listed in it and on stderr."""
    from zerorun.hf.deepspeed import import_deepspeed as run

    text, dropped = run(ds_config, hostfile)
    sys.stdout.write(text)
    for line in dropped:
        sys.stderr.write(f"zerorun: dropped {line}\n")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "allow_interspersed_args": False})
def launch(
    script: str = typer.Argument(..., help="Your training script, run on every rank by torchrun."),
    args: Optional[List[str]] = typer.Argument(None, help="Arguments for the script."),
    hostfile: Optional[str] = _HOSTFILE,
    master_port: Optional[int] = _MASTER_PORT,
    include: Optional[str] = _INCLUDE, exclude: Optional[str] = _EXCLUDE,
    num_nodes: Optional[int] = _NUM_NODES, num_procs: Optional[int] = _NUM_PROCS,
    ssh_user: Optional[str] = _SSH_USER, ssh_port: Optional[int] = _SSH_PORT, ssh_key: Optional[str] = _SSH_KEY,
    ssh_config: Optional[str] = _SSH_CONFIG, ssh_local: bool = _SSH_LOCAL, preflight_timeout: float = _PREFLIGHT_S,
    log_dir: str = typer.Option("runs", "--log-dir", help="Runs are written under LOG_DIR/<script>/<time>/."),
    no_dashboard: bool = typer.Option(False, "--no-dashboard",
                                      help="Plain one-line progress instead of the live dashboard."),
) -> None:
    """Run your own SCRIPT on every rank of the hostfile (or one local rank per --num-procs), with the same
    streaming and teardown as `train`; the script may report steps with zerorun.report()."""
    from zerorun.launch.job import prepare_job

    if not os.path.isfile(script):
        raise ZerorunError(f"{script}: no such script")
    script = os.path.abspath(script)
    hosts = _hosts(hostfile, 1, include, exclude, num_nodes, num_procs)
    job = prepare_job(hosts, uuid.uuid4().hex[:12], program=["-m", "zerorun.script_worker", script, *(args or [])],
                      modules=[script], master_port=master_port, ssh=_ssh(ssh_user, ssh_port, ssh_key, ssh_config),
                      ssh_local=ssh_local, preflight_timeout=preflight_timeout)
    _run(None, job, name=os.path.splitext(os.path.basename(script))[0], log_dir=log_dir, dashboard=not no_dashboard)


def _run(recipe, job, name: str | None = None, log_dir: str | None = None, dashboard: bool = True,
         make_view=None) -> str:
    """Run ``job`` (launch/job.py) under the supervisor, recording and showing its events, and return the run
    directory's path; ``recipe`` is None for ``zerorun launch`` (then ``name`` and ``log_dir`` say where the run
    goes). Progress shows in the live dashboard on a terminal when ``dashboard``, else in plain lines;
    ``make_view(state)`` replaces both (``zerorun bench``'s quiet view).

    Raises:
        ZerorunError: the run directory cannot be created.
        JobFailed: a rank failed, a node was lost, or the job was interrupted (``exit_code`` 130).
    """
    from zerorun.launch.supervisor import Supervisor
    from zerorun.recipe import masked_yaml
    from zerorun.telemetry.console import RunRecorder
    from zerorun.telemetry.dashboard import open_view
    from zerorun.telemetry.state import JobState, write_job_file

    plan, lines, nodes = job.plan, job.lines, job.nodes
    name = recipe.name if recipe is not None else name
    run_dir = os.path.join(recipe.log.dir if recipe is not None else log_dir, name,
                           time.strftime("%Y%m%d-%H%M%S") + f"-{plan.job_id[:4]}")
    try:
        os.makedirs(run_dir, exist_ok=True)
        if recipe is not None:
            with open(os.path.join(run_dir, "recipe.yaml"), "w", encoding="utf-8") as f:
                f.write(masked_yaml(recipe))
    except OSError as e:
        job.close()
        raise ZerorunError(f"log.dir: cannot create the run directory {run_dir}: {e.strerror}") from None
    hosts = ", ".join(f"{n.host.name}x{n.nproc}" for n in plan.nodes)
    state = JobState(name=name, stage=recipe.zero.stage if recipe is not None else None,
                     precision=recipe.precision if recipe is not None else None, world_size=plan.world_size,
                     hosts=[f"{n.host.name}x{n.nproc}" for n in plan.nodes],
                     steps=recipe.train.steps if recipe is not None else None,
                     rank_hosts={r: n.host.name for n in plan.nodes for r in range(n.first_rank, n.first_rank + n.nproc)})
    recorder, view = RunRecorder(run_dir), (make_view or (lambda st: open_view(st, sys.stdout, dashboard)))(state)
    what = f"ZeRO stage {recipe.zero.stage}, {recipe.precision}" if recipe is not None else "user script"
    view.print(f"zerorun: {name}: {plan.world_size} ranks on {hosts}, {what}; job {plan.job_id}; run dir {run_dir}")

    def on_event(e):
        recorder.event(e)
        try:
            view.event(e)
        except Exception:  # noqa: BLE001 - an event the view cannot show is shown as a log line, never fatal
            view.line(-1, f"[rank {e.rank}] unreadable event: {json.dumps(e.to_json(), default=str)}")

    def on_line(node_rank, line):
        recorder.line(node_rank, line)
        view.line(node_rank, line)

    supervisor = Supervisor(plan, nodes, lines, on_event, on_line, require_finish=recipe is not None)
    result = None
    try:
        result = supervisor.run()
    finally:
        recorder.close()
        job.close()
        for rank, code in supervisor.rank_exits.items():  # what happened to ranks that ended on their own
            state.rank_exited(rank, code)
        state.end()
        view.close()  # the summary table, also after a failure or Ctrl-C
        if result is not None:
            write_job_file(run_dir, state, result.status, result.exit_code, result.message, result.rank, result.host)
    for host, why in supervisor.unverified.items():
        sys.stderr.write(f"zerorun: warning: {host}: could not check that the job's processes are gone: {why}\n")
    if result.status != "ok":
        where = f"rank {result.rank}" + (f" on {result.host}" if result.host else "") if result.rank is not None \
            else "job"
        err = JobFailed(f"{where}: {result.message} (logs: {run_dir})")
        err.exit_code = result.exit_code
        raise err
    summary = f"done in {result.elapsed_s:.1f} s"
    if state.evals:
        summary += f"; validation loss {state.evals[0][1]:.4f} -> {state.final_val:.4f} (best {state.best_val:.4f})"
    view.print(f"zerorun: {summary}; metrics: {os.path.join(run_dir, 'metrics.jsonl')}")
    return run_dir


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
) -> None:
    """Run RECIPE on every hostfile at every stage (and the baselines) and compare them: bench.json, bench.csv,
    bench.png in <log.dir>/<name>/bench-<timestamp>/. Exit code 1 when any combination failed."""
    from zerorun.bench import parse_baselines, parse_stages, run_bench

    failed, total, bench_dir = run_bench(recipe, overrides or [], hostfile or [], parse_stages(stages),
                                         parse_baselines(baseline), steps, warmup, repeat)
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
    device_memory: Optional[str] = typer.Option(None, "--device-memory", help="Per rank: 80GiB, 80GB "
                                                "(default: detected; on CPU host memory / ranks per node)."),
    cpu_memory: Optional[str] = typer.Option(None, "--cpu-memory", help="Host memory per node (default: "
                                             "this machine's)."),
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

    result = est.from_arguments(recipe=recipe, overrides=overrides or [], hostfile=hostfile, params=params,
                                largest_layer=largest_layer, nodes=nodes, procs_per_node=procs_per_node,
                                precision=precision, optimizer=optimizer, device_memory=device_memory,
                                cpu_memory=cpu_memory, bandwidth=bandwidth, micro_batch=micro_batch,
                                offload=offload)
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
    from zerorun.telemetry.show import show as run

    run(run_dir, plot)


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


def main() -> None:
    """Console entry point: run the typer app; a :class:`ZerorunError` becomes one line and its exit code."""
    try:
        app(args=optional_value(sys.argv[1:], "--resume", "latest"), standalone_mode=False)
    except ZerorunError as e:
        _err(str(e))
        sys.exit(e.exit_code)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        _err("interrupted")
        sys.exit(130)
    except Exception as e:  # click's (typer's) usage errors: one line, as every other bad input
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            _err(" ".join(e.format_message().split()) + hint)
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort":
            _err("aborted")
            sys.exit(130)
        raise
