"""The ``zerorun`` command line (typer)."""

from __future__ import annotations

import json
import os
import queue
import sys
import time
import uuid
from typing import List, Optional

import typer
import yaml

from zerorun.errors import JobFailed, ZerorunError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="zerorun: launch and run ZeRO data-parallel training jobs.")


def _err(message: str) -> None:
    sys.stderr.write(f"zerorun: error: {message}\n")
    sys.stderr.flush()


@app.callback()
def _root() -> None:
    """zerorun: launch and run ZeRO data-parallel training jobs."""


@app.command(context_settings={"allow_extra_args": False})
def train(
    recipe: str = typer.Argument(..., help="Recipe YAML file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="FIELD=VALUE overrides, e.g. zero.stage=2."),
    hostfile: Optional[str] = typer.Option(None, "-H", "--hostfile", help="DeepSpeed-style hostfile."),
    master_port: Optional[int] = typer.Option(None, "--master-port", min=1, max=65535,
                                              help="Rendezvous port on the first host (default: a free one)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the launch plan and exit."),
    resume: Optional[str] = typer.Option(None, "--resume", metavar="[PATH]",
                                         help="Resume from the latest checkpoint in checkpoint.dir, or from PATH."),
) -> None:
    """Train RECIPE on every rank of the hostfile (or on localhost with launch.procs_per_node ranks)."""
    from zerorun.hostfile import Host, read_hostfile
    from zerorun.launch.plan import build_plan, free_port, port_in_use
    from zerorun.recipe import load_recipe

    r = load_recipe(recipe, overrides or [])
    if resume is not None:
        r.checkpoint.resume = _resume_path(r, resume)
        r.checkpoint.dir = r.checkpoint.dir or os.path.dirname(r.checkpoint.resume)  # keep saving beside it
    hosts = read_hostfile(hostfile) if hostfile else [Host("localhost", r.launch.procs_per_node)]
    remote = [h.name for h in hosts if not h.is_local]
    if remote:
        raise ZerorunError(f"{hostfile}: remote hosts ({', '.join(remote)}) need the SSH launcher, which is not "
                           "available yet; use local hosts only")
    if master_port is None:
        master_port = free_port()
    elif port_in_use(master_port):
        raise ZerorunError(f"--master-port {master_port}: the port is already in use on 127.0.0.1")
    job_id = uuid.uuid4().hex[:12]
    plan = build_plan(hosts, r.model_dump_json(), job_id, master_port, r.launch.python, r.launch.env)
    if dry_run:
        for node in plan.nodes:
            print(f"node {node.node_rank} {node.host.name}: ranks {node.first_rank}..{node.first_rank + node.nproc - 1}")
            print("  " + " ".join(node.argv[:-1]) + " <recipe>")
        return
    if r.checkpoint.dir:
        try:
            os.makedirs(r.checkpoint.dir, exist_ok=True)
        except OSError as e:
            raise ZerorunError(f"checkpoint.dir: cannot create {r.checkpoint.dir}: {e.strerror}") from None
    _run(r, plan)


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
    out: str = typer.Option(..., "--out", "-o", help="Output file: NAME.safetensors or NAME.pt."),
) -> None:
    """Write the model of a sharded checkpoint as one fp32 state dict (no training processes needed)."""
    from zerorun.checkpoint import consolidate as run
    from zerorun.telemetry.console import human_bytes

    count, nbytes = run(ckpt_dir, out)
    print(f"zerorun: wrote {count} tensors ({human_bytes(nbytes)}) to {out}")


def _run(recipe, plan) -> None:
    from zerorun.launch.runner import LocalNode
    from zerorun.launch.supervisor import Supervisor
    from zerorun.telemetry.console import PlainView, RunRecorder

    run_dir = os.path.join(recipe.log.dir, recipe.name, time.strftime("%Y%m%d-%H%M%S") + f"-{plan.job_id[:4]}")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "recipe.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(json.loads(recipe.model_dump_json()), f, sort_keys=False)
    except OSError as e:
        raise ZerorunError(f"log.dir: cannot create the run directory {run_dir}: {e.strerror}") from None
    recorder, view = RunRecorder(run_dir), PlainView(sys.stdout)
    hosts = ", ".join(f"{n.host.name}x{n.nproc}" for n in plan.nodes)
    view.print(f"zerorun: {recipe.name}: {plan.world_size} ranks on {hosts}, ZeRO stage {recipe.zero.stage}, "
               f"{recipe.precision}; job {plan.job_id}; run dir {run_dir}")
    lines: queue.Queue = queue.Queue()
    nodes = [LocalNode(spec, lines, cwd=recipe.launch.workdir) for spec in plan.nodes]

    def on_event(e):
        recorder.event(e)
        view.event(e)

    def on_line(node_rank, line):
        recorder.line(node_rank, line)
        view.line(node_rank, line)

    try:
        result = Supervisor(plan, nodes, lines, on_event, on_line).run()
    finally:
        recorder.close()
    if result.status != "ok":
        where = f"rank {result.rank}" + (f" on {result.host}" if result.host else "") if result.rank is not None \
            else "job"
        err = JobFailed(f"{where}: {result.message} (logs: {run_dir})")
        err.exit_code = result.exit_code
        raise err
    summary = f"done in {result.elapsed_s:.1f} s"
    if view.last_val is not None:
        summary += f"; validation loss {view.first_val:.4f} -> {view.last_val:.4f} (best {view.best_val:.4f})"
    view.print(f"zerorun: {summary}; metrics: {os.path.join(run_dir, 'metrics.jsonl')}")


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
    except Exception as e:  # click's (typer's) usage errors: they know how to show themselves
        if hasattr(e, "show") and hasattr(e, "exit_code"):
            e.show()
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort":
            _err("aborted")
            sys.exit(130)
        raise
