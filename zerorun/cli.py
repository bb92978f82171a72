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
    no_dashboard: bool = typer.Option(False, "--no-dashboard",
                                      help="Plain one-line progress instead of the live dashboard."),
) -> None:
    """Train RECIPE on every rank of the hostfile (or on localhost with launch.procs_per_node ranks)."""
    from zerorun.hostfile import Host, read_hostfile
    from zerorun.launch.plan import build_plan, free_port, port_in_use
    from zerorun.recipe import load_recipe

    r = load_recipe(recipe, overrides or [])
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
    _run(r, plan, dashboard=not no_dashboard)


def _run(recipe, plan, dashboard: bool = True) -> None:
    from zerorun.launch.runner import LocalNode
    from zerorun.launch.supervisor import Supervisor
    from zerorun.telemetry.console import RunRecorder
    from zerorun.telemetry.dashboard import open_view
    from zerorun.telemetry.state import JobState, write_job_file

    run_dir = os.path.join(recipe.log.dir, recipe.name, time.strftime("%Y%m%d-%H%M%S") + f"-{plan.job_id[:4]}")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "recipe.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(json.loads(recipe.model_dump_json()), f, sort_keys=False)
    except OSError as e:
        raise ZerorunError(f"log.dir: cannot create the run directory {run_dir}: {e.strerror}") from None
    hosts = ", ".join(f"{n.host.name}x{n.nproc}" for n in plan.nodes)
    state = JobState(name=recipe.name, stage=recipe.zero.stage, precision=recipe.precision,
                     world_size=plan.world_size, hosts=[f"{n.host.name}x{n.nproc}" for n in plan.nodes],
                     steps=recipe.train.steps, rank_hosts={r: n.host.name for n in plan.nodes
                                                           for r in range(n.first_rank, n.first_rank + n.nproc)})
    print(f"zerorun: {recipe.name}: {plan.world_size} ranks on {hosts}, ZeRO stage {recipe.zero.stage}, "
          f"{recipe.precision}; job {plan.job_id}; run dir {run_dir}", flush=True)
    recorder, view = RunRecorder(run_dir), open_view(state, sys.stdout, dashboard)
    lines: queue.Queue = queue.Queue()
    nodes = [LocalNode(spec, lines, cwd=recipe.launch.workdir) for spec in plan.nodes]

    def on_event(e):
        recorder.event(e)
        try:
            view.event(e)
        except Exception:  # noqa: BLE001 - an event the view cannot show is shown as a log line, never fatal
            view.line(-1, f"[rank {e.rank}] unreadable event: {json.dumps(e.to_json(), default=str)}")

    def on_line(node_rank, line):
        recorder.line(node_rank, line)
        view.line(node_rank, line)

    result = None
    try:
        result = Supervisor(plan, nodes, lines, on_event, on_line).run()
    finally:
        recorder.close()
        state.end()
        view.close()  # the summary table, also after a failure or Ctrl-C
        if result is not None:
            write_job_file(run_dir, state, result.status, result.exit_code, result.message)
    if result.status != "ok":
        where = f"rank {result.rank}" + (f" on {result.host}" if result.host else "") if result.rank is not None \
            else "job"
        err = JobFailed(f"{where}: {result.message} (logs: {run_dir})")
        err.exit_code = result.exit_code
        raise err
    summary = f"done in {result.elapsed_s:.1f} s"
    if state.evals:
        summary += f"; validation loss {state.evals[0][1]:.4f} -> {state.final_val:.4f} (best {state.best_val:.4f})"
    print(f"zerorun: {summary}; metrics: {os.path.join(run_dir, 'metrics.jsonl')}", flush=True)


@app.command()
def show(
    run_dir: str = typer.Argument(..., help="A run directory: runs/<name>/<timestamp>."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Also draw loss and memory per rank over steps into "
                                                            "this image file (needs matplotlib)."),
) -> None:
    """Print the summary of a finished run again (from its metrics.jsonl); --plot draws loss and memory."""
    from zerorun.telemetry.dashboard import print_summary
    from zerorun.telemetry.state import load_run

    state, events = load_run(run_dir)
    print_summary(state, sys.stdout)
    if plot:
        from zerorun.telemetry.plot import plot_run

        plot_run(state, events, plot)
        print(f"zerorun: wrote {plot}")


def main() -> None:
    """Console entry point: run the typer app; a :class:`ZerorunError` becomes one line and its exit code."""
    try:
        app(standalone_mode=False)
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
