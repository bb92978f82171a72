"""``zerorun attach JOBID`` (and ``zerorun show RUN_DIR`` on a ``zerorun submit`` run folder whose job has not
ended): follow a SLURM job's run folder with the launcher's own views until the job ends.

A pending job: one line says so (and why it waits), then it is polled until it starts. A running job: its
``metrics.jsonl`` and ``output.log`` are followed (telemetry/follow.py) in the live dashboard, or in plain
lines without a terminal, until SLURM says it ended; then the summary and how it ended, as ``zerorun show``
prints them. An ended job: ``zerorun show``'s summary at once. The exit status is the job's: the one its
``zerorun train`` recorded in ``job.json``, else SLURM's (``ExitCode``), so ``zerorun attach`` can wait for a
job in a script. Ctrl-C stops following (exit status 130), never the job.

Note [Following a requeued job]: SLURM requeues a job (``scontrol requeue``, a node lost with ``--requeue``,
preemption) by signalling its run like an end (COMPLETING, the run's ``zerorun train`` saves and records exit
143 in ``job.json``), then holds it PENDING (``BeginTime``, two minutes by default) and runs the same job id
again. ``scontrol show job`` counts the requeue in ``Restarts`` from its first moment, so a run followed while
``Restarts`` grows has ended by requeue: attach says so and follows the next run (pending first), and exits
only when the job itself ends, with the last run's status (a script ``zerorun attach $J || alert`` sees the
job's end, not the requeue's). A ``job.json`` that started before the job's current run (``StartTime``) is
an earlier run's and is not taken as this run's end.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from zerorun import runfolder
from zerorun.errors import ZerorunError
from zerorun.slurm.jobs import JobInfo, check_job_id, find_run_dir, job_info, submitted_job
from zerorun.telemetry.jobfiles import read_json

POLL_S = 1.0  # how often SLURM is asked whether the job still waits or runs
#: seconds a run's own start (job.json ``started``, the batch node's clock) may read before SLURM's StartTime
#: (the controller's clock, whole seconds)
_CLOCK_SLACK_S = 2.0


def attach(job_id: str, *, dashboard: bool = True, out=None, poll_s: float = POLL_S) -> int:
    """Follow SLURM job ``job_id`` (module docstring) and return its exit status (130 after Ctrl-C).

    Raises:
        ZerorunError: not a job id, unknown to SLURM and to zerorun's records, no run folder known for it, or
            scontrol missing or failing (one line each).
    """
    job_id = check_job_id(job_id)
    out = out or sys.stdout
    info = job_info(job_id)
    try:
        run_dir = find_run_dir(job_id, info)
    except ZerorunError:
        if info is None or not info.active:
            raise
        # your own sbatch script or salloc: zerorun train records the folder once it runs
        out.write(f"zerorun: job {job_id} is {info.state.lower()} ({info.reason or 'no reason given'}); waiting "
                  "for zerorun train in it to record its run folder (Ctrl-C stops waiting, not the job)\n")
        out.flush()
        try:
            run_dir = _wait_for_record(job_id, poll_s)
        except KeyboardInterrupt:
            out.write(f"\nzerorun: stopped waiting; job {job_id} goes on (zerorun attach {job_id})\n")
            return 130
        info = job_info(job_id)
    return follow_job(job_id, run_dir, info, dashboard=dashboard, out=out, poll_s=poll_s)


def _wait_for_record(job_id: str, poll_s: float) -> str:
    """The run folder of ``job_id`` once a ``zerorun train`` in it recorded one (slurm/jobs.py).

    Raises:
        ZerorunError: the job ended (or SLURM forgot it) before any did.
    """
    completing_until = None
    while True:
        time.sleep(poll_s)
        info = job_info(job_id)
        try:
            return find_run_dir(job_id, info)
        except ZerorunError:
            # SLURM's clean-up: the line names the state the job ends in (COMPLETED, FAILED), or COMPLETING where a
            # node is stuck in it for COMPLETING_WAIT_S (found by a suite run: "ended (COMPLETING)", now and then)
            if info is not None and info.state == "COMPLETING":
                completing_until = completing_until or time.monotonic() + COMPLETING_WAIT_S
                if time.monotonic() < completing_until:
                    continue
            if info is None or not info.active:
                raise ZerorunError(f"job {job_id} ended ({info.state if info else 'SLURM no longer knows it'}) "
                                   "and no zerorun train in it recorded a run folder") from None


def follow_submitted(run_dir: str, *, dashboard: bool = True, out=None, poll_s: float = POLL_S) -> int | None:
    """For ``zerorun show RUN_DIR``: when ``run_dir`` is a ``zerorun submit`` run folder whose job SLURM still
    knows as queued or running (or that ended before any rank wrote a metric), follow it as :func:`attach`
    does and return the exit status; else None (the folder is shown as any run is)."""
    job_id = submitted_job(run_dir)
    if job_id is None or shutil.which("scontrol") is None:
        return None
    try:
        info = job_info(job_id)
    except ZerorunError:
        return None
    if (info is None or not info.active) and os.path.isfile(os.path.join(run_dir, runfolder.METRICS)):
        return None
    return follow_job(job_id, run_dir, info, dashboard=dashboard, out=out, poll_s=poll_s)


#: final SLURM states of a job that was stopped from outside: 128 + SIGTERM, as zerorun train exits then
STOPPED = frozenset({"CANCELLED", "TIMEOUT", "PREEMPTED", "DEADLINE"})


def job_record(run_dir: str, job_id: str, info: JobInfo | None = None) -> dict:
    """``run_dir/job.json`` when it records job ``job_id``'s run, else ``{}``: a folder submitted again
    (``sbatch RUN_DIR/submit.sbatch``) holds the last job's record (its ``slurm_job_id``); a record without
    one (no SLURM, or an older zerorun) is taken as this job's. With ``info`` of a requeued job (Note
    [Following a requeued job]), a record that started before the job's current run is an earlier run's."""
    job = read_json(os.path.join(run_dir, runfolder.JOB))
    owner = job.get("slurm_job_id")
    if owner is not None and str(owner) != job_id:
        return {}
    started = job.get("started")
    if (info is not None and info.restarts and info.started is not None and isinstance(started, (int, float))
            and started < info.started - _CLOCK_SLACK_S):
        return {}
    return job


def exit_status(info: JobInfo | None, run_dir: str, job_id: str) -> int:
    """The job's exit status: its ``zerorun train``'s (:func:`job_record`), else SLURM's ``ExitCode``
    ("status:signal"; a signal N gives 128 + N), else 0 for ``COMPLETED``, 143 for a job stopped from outside
    (:data:`STOPPED`: scancel, time limit, preemption) and 1 for any other end."""
    code = job_record(run_dir, job_id, info).get("exit_code")
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    if info is None:
        return 1
    status, _, sig = info.exit_code.partition(":")
    if status.isdigit() and int(status):
        return int(status)
    if sig.isdigit() and int(sig):
        return 128 + int(sig)
    return 0 if info.state == "COMPLETED" else 143 if info.state in STOPPED else 1


#: seconds attach waits for a COMPLETING job's record at most (a node stuck in SLURM's clean-up: then SLURM's
#: state is the answer)
COMPLETING_WAIT_S = 180.0


def settled(job_id: str, run_dir: str, info: JobInfo | None, poll_s: float,
            limit_s: float = COMPLETING_WAIT_S) -> JobInfo | None:
    """``info`` once the job is no longer COMPLETING without its record (SLURM signalled it, and its ``zerorun
    train`` may still be saving: Note on ``jobs.ACTIVE``), or after ``limit_s`` seconds of that."""
    deadline = time.monotonic() + limit_s
    while (info is not None and info.state == "COMPLETING" and not job_record(run_dir, job_id, info)
           and time.monotonic() < deadline):
        time.sleep(poll_s)
        info = job_info(job_id)
    return info


def _how(info: JobInfo | None) -> str:
    """How SLURM says a job ended: ``"CANCELLED, exit code 0:15"``."""
    return f"{info.state}, exit code {info.exit_code}" if info is not None else "SLURM no longer knows it"


def _output(run_dir: str, job_id: str) -> str:
    """``"; its output: PATH"`` when the job's ``slurm-JOBID.out`` exists (a job cancelled before it ran has
    none), else ``""``; with the last ``zerorun: error:`` line in it, that line's message first (a review: a
    recipe broken before the job started was told only by the file)."""
    path = os.path.join(run_dir, f"slurm-{job_id}.out")
    if not os.path.isfile(path):
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        lines = []
    error = next((line.removeprefix("zerorun: error: ") for line in reversed(lines)
                  if line.startswith("zerorun: error: ")), None)
    return (f": {error}" if error else "") + f"; its output: {path}"


def _ended(job_id: str, run_dir: str, info: JobInfo | None, out) -> int:
    """An ended job: ``zerorun show``'s summary, or one line when no rank wrote a metric."""
    from zerorun.telemetry.show import show
    other = None if job_record(run_dir, job_id, info) else (
        read_json(os.path.join(run_dir, runfolder.JOB)).get("slurm_job_id") or submitted_job(run_dir))
    if other is not None and str(other) != job_id:  # the folder was submitted again
        out.write(f"zerorun: job {job_id} ended ({_how(info)}); its run folder now holds job {other}'s run: "
                  f"zerorun attach {other} ({run_dir})\n")
    elif os.path.isfile(os.path.join(run_dir, runfolder.METRICS)):
        show(run_dir, out=out)
    else:
        out.write(f"zerorun: job {job_id} ended ({_how(info)}) before any rank wrote a metric"
                  f"{_output(run_dir, job_id)}\n")
    out.flush()
    return exit_status(info, run_dir, job_id)


def _from_job_file(state, run_dir: str) -> None:
    """What ``job.json`` says once the job ended, as ``zerorun show`` has it: each rank's host as the launcher
    named it (the allocation's node names, not the host name the rank reported), and the job's start and end
    (not the moment attach started)."""
    job = read_json(os.path.join(run_dir, runfolder.JOB))
    started, ended = (job.get(k) if isinstance(job.get(k), (int, float)) else None for k in ("started", "ended"))
    if started is not None:
        state.started = float(started)
    if ended is not None:
        state.end(float(ended))
    rank_hosts = job.get("rank_hosts")
    if isinstance(rank_hosts, dict):
        for rank, host in rank_hosts.items():
            if str(rank).isdigit() and int(rank) in state.ranks:
                state.ranks[int(rank)].host = str(host)


def follow_job(job_id: str, run_dir: str, info: JobInfo | None, *, dashboard: bool = True, out=None,
               poll_s: float = POLL_S) -> int:
    """Follow job ``job_id`` writing into ``run_dir`` (``info``: what SLURM said of it last) until it ends,
    across SLURM's requeues of it (Note [Following a requeued job]); returns its exit status
    (:func:`exit_status`), 130 when Ctrl-C stopped following."""
    out = out or sys.stdout
    while True:
        if info is not None and info.state == "COMPLETING" and info.restarts:
            info = _past_completing(job_id, info, poll_s)  # a requeue in progress looks like an end at first
        info = settled(job_id, run_dir, info, poll_s)
        if info is not None and info.pending:
            try:
                info = _wait_to_start(job_id, run_dir, info, out, poll_s)
            except KeyboardInterrupt:
                out.write(f"\nzerorun: stopped waiting; job {job_id} is still queued (zerorun attach {job_id})\n")
                return 130
        if info is None or not info.active:
            return _ended(job_id, run_dir, info, out)
        code, info = _follow_run(job_id, run_dir, info, dashboard=dashboard, out=out, poll_s=poll_s)
        if code is not None:
            return code


def _past_completing(job_id: str, info: JobInfo | None, poll_s: float) -> JobInfo | None:
    """What SLURM says of the job once it is no longer COMPLETING (or after :data:`COMPLETING_WAIT_S`)."""
    deadline = time.monotonic() + COMPLETING_WAIT_S
    while info is not None and info.state == "COMPLETING" and time.monotonic() < deadline:
        time.sleep(poll_s)
        info = job_info(job_id)
    return info


def _wait_to_start(job_id: str, run_dir: str, info: JobInfo, out, poll_s: float) -> JobInfo | None:
    """Say that the job is pending and why, and wait until it is not.

    Raises:
        KeyboardInterrupt: Ctrl-C (the caller says the job stays queued).
    """
    why = info.reason or "no reason given yet"
    out.write(f"zerorun: job {job_id} is pending ({why}); waiting for it to start (Ctrl-C stops waiting, "
              f"the job stays queued); run dir {run_dir}\n")
    out.flush()
    while info is not None and info.pending:
        time.sleep(poll_s)
        info = job_info(job_id)
    return settled(job_id, run_dir, info, poll_s)


def _follow_run(job_id: str, run_dir: str, info: JobInfo, *, dashboard: bool, out,
                poll_s: float) -> tuple[int | None, JobInfo | None]:
    """Follow one run of the job in the view until it ends: ``(exit status, info)``, or ``(None, info)`` when
    SLURM requeued the job (Note [Following a requeued job]; ``info``: the job past its COMPLETING)."""
    from zerorun.telemetry.dashboard import open_view
    from zerorun.telemetry.follow import follow, new_state
    from zerorun.telemetry.show import outcome

    state = new_state(run_dir)
    view = open_view(state, out, dashboard)
    view.print(f"zerorun: attached to job {job_id} ({info.state} on {info.nodes or '?'}); run dir {run_dir}")
    last, restarts = [info], info.restarts
    completing: list[float] = []  # when the job was first seen COMPLETING

    def running() -> bool:  # a COMPLETING job runs until its record is written (Note on jobs.ACTIVE)
        last[0] = now = job_info(job_id)
        if now is None or now.restarts > restarts:  # forgotten, or requeued: this run ended
            return False
        if now.active:
            return True
        if now.state != "COMPLETING" or job_record(run_dir, job_id, now):
            return False
        completing[:1] = completing[:1] or [time.monotonic()]
        return time.monotonic() - completing[0] < COMPLETING_WAIT_S

    try:
        follow(run_dir, view, running, poll_s=min(0.5, poll_s), check_s=poll_s)
    except KeyboardInterrupt:
        live = getattr(view, "live", None)
        if live is not None:
            live.stop()
        out.write(f"\nzerorun: stopped following; job {job_id} goes on (zerorun attach {job_id})\n")
        return 130, last[0]
    if last[0] is not None and last[0].restarts > restarts:
        view.close()
        view.print(f"zerorun: SLURM requeued job {job_id} (restart {last[0].restarts}); following its next run")
        return None, _past_completing(job_id, last[0], poll_s)
    last[0] = settled(job_id, run_dir, last[0], poll_s, COMPLETING_WAIT_S - (time.monotonic() - completing[0]
                                                                             if completing else 0.0))
    _from_job_file(state, run_dir)
    view.close()  # the summary table
    if job_record(run_dir, job_id, last[0]):
        view.print(f"zerorun: {outcome(run_dir, state)}")
    else:
        view.print(f"zerorun: job {job_id} ended ({_how(last[0])}) before zerorun train recorded how"
                   f"{_output(run_dir, job_id)}")
    return exit_status(last[0], run_dir, job_id), last[0]
