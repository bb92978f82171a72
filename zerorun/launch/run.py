"""Running a job: the public API that ``zerorun train``, ``zerorun launch`` and ``zerorun bench`` all call.

::

    hosts = launch.select(hostfile, recipe.launch.procs_per_node)
    result = launch.run_job(recipe, hosts, recipe_path=path, overrides=overrides)   # or launch.Script(...)
    if not result.ok:
        raise result.error()

:func:`run_job` goes plan -> nodes -> supervisor -> result: it checks the remote hosts (preflight) and prepares
the nodes (launch/job.py), makes the run folder (``recipe.yaml``, ``commands.sh``), prints the job header at
once, starts every node and, beside them, the model check (zerorun/rank/modelcheck.py), shows the events in a view,
and returns a :class:`Outcome`. Nothing here imports torch: the launcher's first line comes in a fraction of
a second (``benchmarks/startup.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
import uuid
from typing import Callable

from zerorun import runfolder
from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import Host
from zerorun.launch.launcher import Launcher
from zerorun.launch.outcome import Outcome
from zerorun.launch.script import Script, job_parts
from zerorun.telemetry.format import count


def prepare(job, hosts: list[Host], *, job_id: str | None = None, master_port: int | None = None,
            master_addr: str | None = None, ssh=None, ssh_local: bool = False, preflight_timeout: float = 15.0,
            launcher: Launcher = Launcher.SSH):
    """Preflight the remote ``hosts`` and make the nodes of ``job`` (a Recipe or a :class:`Script`), not
    started, with ``launcher``'s backend (launch/job.py ``prepare``). ``master_port`` None: a free one on the
    first host.

    Raises:
        ZerorunError: a host fails preflight (one line per host), or ``master_port`` is in use.
    """
    from zerorun.launch.job import prepare as prepare_nodes
    from zerorun.launch.remote import SshOptions

    recipe_json, modules, program, launch = job_parts(job)
    return prepare_nodes(hosts, job_id or uuid.uuid4().hex[:12], launcher, recipe_json=recipe_json,
                         program=program, modules=modules, master_port=master_port, master_addr=master_addr,
                         ssh=ssh or SshOptions(), ssh_local=ssh_local, preflight_timeout=preflight_timeout,
                         **launch)


def run_job(job, hosts: list[Host], *, recipe_path: str | None = None, overrides: list[str] = (),
            view: Callable | None = None, dashboard: bool = True, out=None, job_id: str | None = None,
            master_port: int | None = None, master_addr: str | None = None, ssh=None, ssh_local: bool = False,
            preflight_timeout: float = 15.0, model_check: bool = True, launcher: Launcher = Launcher.SSH,
            run_dir: str | None = None, started: float | None = None) -> Outcome:
    """Run ``job`` (a :class:`~zerorun.recipe.Recipe`, or a :class:`Script` for ``zerorun launch``) on
    ``hosts`` (:func:`select`) and return how it ended.

    Progress shows in the live dashboard when ``dashboard`` and ``out`` (default stdout) is a terminal, else in
    plain lines; ``view(state)`` replaces both (``zerorun bench``'s quiet view). With ``model_check`` and a
    recipe loaded from ``recipe_path`` with ``overrides`` (and a local host), the model check runs beside the
    launch (Note [Model check beside the launch] in zerorun/rank/modelcheck.py). ``launcher``: ``ssh`` and ``local``
    as ever, ``slurm``: every node through one srun step in the allocation (Note [Slurm launcher]).
    The run folder is ``run_dir``
    (made if missing; ``zerorun submit`` makes it before the job starts) or a new :func:`new_run_dir`. Inside a
    SLURM allocation the folder is recorded under the job's id for ``zerorun attach`` (zerorun/slurm/jobs.py).
    ``started``: when the job started (Unix s; default now), the first try's for a restart (launch/restart.py).

    Raises:
        ZerorunError: before anything starts: preflight, a master port in use, the run folder cannot be made.
    """
    from zerorun.telemetry.dashboard import open_view

    out = out or sys.stdout
    recipe = None if isinstance(job, Script) else job
    check = None
    if recipe is not None and model_check and recipe_path is not None and any(h.is_local for h in hosts):
        from zerorun.rank import modelcheck  # remote-only jobs: preflight looks for the module on each host

        check = modelcheck.start(recipe, recipe_path, list(overrides))
    try:
        prepared = prepare(job, hosts, job_id=job_id, master_port=master_port, master_addr=master_addr, ssh=ssh,
                           ssh_local=ssh_local, preflight_timeout=preflight_timeout, launcher=launcher)
    except BaseException:
        if check is not None:
            check.stop()
        raise
    source = "--run-dir" if run_dir else "log.dir"  # where the folder came from, for its write errors
    from zerorun.telemetry.jobfiles import earlier_rank_hosts, replay

    earlier = earlier_rank_hosts(run_dir) if started is not None and run_dir else {}  # before job.json goes
    run_dir = _make_run_dir(prepared, job, recipe, run_dir, check)
    state = _job_state(prepared.plan, job, recipe, started, earlier)
    if started is not None:  # a restart: the job's earlier tries are in its run folder
        replay(state, run_dir)
    shown = (view or (lambda st: open_view(st, out, dashboard)))(state)
    return _supervise(prepared, state, run_dir, recipe, check, shown, source)


def _make_run_dir(prepared, job, recipe, run_dir: str | None, check) -> str:
    """Make the run folder (``run_dir``, else a new :func:`new_run_dir`) and write what it records before the
    job starts (launch/record.py); inside a SLURM allocation, record it under the job's id for ``zerorun
    attach``. Returns its path.

    Raises:
        ZerorunError: the folder cannot be made (the nodes' connections and the model check are closed first).
    """
    from zerorun.launch import record

    plan = prepared.plan
    name = recipe.name if recipe is not None else job.name
    source = "--run-dir" if run_dir else "log.dir"  # where the folder came from, for the error below
    run_dir = run_dir or new_run_dir(recipe.log.dir if recipe is not None else job.log_dir, name, plan.job_id)
    existed = os.path.exists(run_dir)
    try:
        record.write(run_dir, plan, recipe, prepared.workdir, prepared.user_env, prepared.srun)
        if os.path.exists(os.path.join(run_dir, runfolder.JOB)):  # a folder given again (a requeued batch job)
            os.remove(os.path.join(run_dir, runfolder.JOB))  # says how an earlier job ended, not this one
    except OSError as e:
        prepared.close()
        if check is not None:
            check.stop()
        if not existed:  # no half-written folder left (a 0-byte recipe.yaml on a full disk)
            shutil.rmtree(run_dir, ignore_errors=True)
        raise ZerorunError(f"{source}: cannot create the run directory {run_dir}: {e.strerror}") from None
    if os.environ.get("SLURM_JOB_ID"):
        from zerorun.slurm.jobs import JOB_FILE, remember

        # a zerorun submit folder submitted again: its slurm-job.json names the job now writing into it
        remember(os.environ["SLURM_JOB_ID"], run_dir, in_run_dir=os.path.isfile(os.path.join(run_dir, JOB_FILE)))
    return run_dir


def _job_state(plan, job, recipe, started: float | None, earlier: dict[int, str] | None = None):
    """The job's :class:`~zerorun.telemetry.state.JobState` before it starts, for the views; ``earlier``: the
    hosts of a restarted job's ranks in its earlier tries (a rank left out of a smaller world keeps its host)."""
    from zerorun.telemetry.state import JobState

    return JobState(name=recipe.name if recipe is not None else job.name,
                    stage=recipe.zero.stage if recipe is not None else None,
                    precision=recipe.precision if recipe is not None else None, world_size=plan.world_size,
                    hosts=[f"{n.host.name}x{n.nproc}" for n in plan.nodes],
                    steps=recipe.train.steps if recipe is not None else None,
                    rank_hosts={**(earlier or {}), **{r: n.host.name for n in plan.nodes
                                                      for r in range(n.first_rank, n.first_rank + n.nproc)}},
                    started=started)


def new_run_dir(log_dir: str, name: str, job_id: str) -> str:
    """A new run folder's path (not made): ``log_dir/name/YYYYmmdd-HHMMSS-xxxx``, ``xxxx`` the first four
    characters of ``job_id`` (``zerorun show`` orders runs by this name)."""
    return os.path.join(log_dir, name, time.strftime("%Y%m%d-%H%M%S") + f"-{job_id[:4]}")


def prefer_check(result, check):
    """The job's result, or the model check's one line when a rank crashed (exit status 1) or reported bad
    input itself (exit status 2: its factory raised) and the check finds a problem: the check's line names the
    recipe's field that caused it (an optimizer argument the recipe names, a ``model.kwargs`` typo) where the
    ranks only report the TypeError; and the same input then gives the same line whichever saw it first.

    The check is waited for (up to 60 s, the CPUs are free now) whether it still runs, at the lowest priority,
    or ended in the same moment as the ranks: the supervisor sees the crash first in both cases.

    Args:
        result: the supervisor's :class:`Outcome`.
        check: the :class:`zerorun.rank.modelcheck.ModelCheck` or None.
    Returns:
        ``result``, or a failed result with exit status 2 and the check's line.
    """
    if result.status != "failed" or check is None or not (
            result.exit_code == 1 or result.exit_code == 2 and result.rank is not None):
        return result
    problem = check.wait(timeout=60.0)  # returns at once when the check is done
    if problem:
        return type(result)("failed", 2, message=problem, elapsed_s=result.elapsed_s)
    return result


def _supervise(prepared, state, run_dir: str, recipe, check, view, source: str = "log.dir") -> Outcome:
    """Print the header, run the nodes under the supervisor with the model check beside them, record
    everything, and return the :class:`Outcome`. A run folder that cannot be written (``source`` named it)
    stops the job with one line (Note [Run folder write failure] in telemetry/console.py)."""
    from zerorun.launch.supervisor import Supervisor
    from zerorun.telemetry.console import RunRecorder
    plan = prepared.plan
    hosts = ", ".join(f"{n.host.name}x{n.nproc}" for n in plan.nodes)
    what = f"ZeRO stage {recipe.zero.stage}, {recipe.precision}" if recipe is not None else "user script"
    view.print(f"zerorun: {state.name}: {count(plan.world_size, 'rank')} on {hosts}, {what}; job {plan.job_id}; "
               f"run dir {run_dir}")
    try:
        recorder = RunRecorder(run_dir, recipe, source, job=plan.job_id)
    except ZerorunError:
        prepared.close()
        if check is not None:
            check.stop()
        raise

    def on_event(e):
        recorder.event(e)
        try:
            view.event(e)
        except Exception:  # noqa: BLE001 - an event the view cannot show is shown as a log line, never fatal
            view.line(-1, f"[rank {e.rank}] unreadable event: {json.dumps(e.to_json(), default=str)}")

    def on_line(node_rank, line):
        recorder.line(node_rank, line)
        view.line(node_rank, line)

    supervisor = Supervisor(plan, prepared.nodes, prepared.lines, on_event, on_line, grace_s=prepared.grace_s,
                            require_finish=recipe is not None,
                            check=lambda: recorder.failed or (check.problem() if check else None),
                            on_stopping=state.stopping)
    result = None
    try:
        result = prefer_check(supervisor.run(), check)
    finally:
        if check is not None:
            check.stop()
        recorder.close()
        prepared.close()
        for rank, code in supervisor.rank_exits.items():  # what happened to ranks that ended on their own
            state.rank_exited(rank, code)
        state.end()
        view.close()  # the summary table, also after a failure or Ctrl-C
        if result is not None:
            result = _record_end(run_dir, state, result, source)
    for host, why in supervisor.unverified.items():
        sys.stderr.write(f"zerorun: warning: {host}: could not check that the job's processes are gone: {why}\n")
    return _finish(result, state, run_dir, view)


def _record_end(run_dir: str, state, result: Outcome, source: str) -> Outcome:
    """Write ``job.json`` for ``result``; when it cannot be written, a job that succeeded fails with one line
    naming ``source`` and the file (exit code 2), a job that failed keeps its own line and a warning says it.
    A run folder removed while the job ran (made at its start, gone now: Note [Run folder removed] in
    telemetry/console.py) is a warning, whatever the result."""
    from zerorun.telemetry.jobfiles import write_job_file

    try:
        write_job_file(run_dir, state, result.status, result.exit_code, result.message, result.rank, result.host)
    except OSError as e:
        try:
            os.remove(os.path.join(run_dir, runfolder.JOB + ".tmp"))  # never a half-written file left
        except OSError:
            pass
        why = f"{source}: cannot write {os.path.join(run_dir, runfolder.JOB)}: {e.strerror or e}"
        if not os.path.isdir(run_dir):
            why += " (the run folder was removed while the job ran)"
        elif result.ok:
            return dataclasses.replace(result, status="failed", exit_code=2, message=why)
        if not result.message.startswith(f"{source}: cannot write"):  # else the job's line says it already
            sys.stderr.write(f"zerorun: warning: {why}\n")
    return result


def _finish(result: Outcome, state, run_dir: str, view) -> Outcome:
    """The job's :class:`Outcome` with its run folder and state: a failure's message names the rank and host
    (or the job) and the logs; success prints the summary line."""
    if result.status != "ok":
        if result.rank is not None:
            where = f"rank {result.rank}" + (f" on {result.host}" if result.host else "")
            message = f"{where}: {result.message} (logs: {run_dir})"
        elif result.exit_code == 2:  # the model check: the recipe's own line, as before the launch
            message = result.message
        else:
            message = f"job: {result.message} (logs: {run_dir})"
        return dataclasses.replace(result, message=message, run_dir=run_dir, state=state)
    summary = f"done in {state.elapsed_s():.1f} s"  # the job's, every try: the summary's total time
    if len(state.evals) > 1:
        summary += f"; validation loss {state.evals[0][1]:.4f} -> {state.final_val:.4f} (best {state.best_val:.4f})"
    elif state.evals:  # one evaluation (a resumed job's last): no "from" value was ever taken
        summary += f"; validation loss {state.final_val:.4f} at step {state.evals[0][0]}"
    metrics = os.path.join(run_dir, runfolder.METRICS)
    view.print(f"zerorun: {summary}; " + (f"metrics: {metrics}" if os.path.exists(metrics) else
                                          f"no metrics: {run_dir} was removed"))  # Note [Run folder removed]
    return dataclasses.replace(result, run_dir=run_dir, state=state)
