"""A run folder read back and written: ``metrics.jsonl``, ``recipe.yaml`` and ``job.json`` folded into the
:class:`~zerorun.telemetry.state.JobState` that ``zerorun show``, ``zerorun attach`` and a restarted job's views
display (:func:`load_run`, :func:`replay`), and ``job.json`` written at the job's end (:func:`write_job_file`)."""

from __future__ import annotations

import json
import os

from zerorun import runfolder
from zerorun.errors import ZerorunError
from zerorun.telemetry.events import Event, from_json, integer, number
from zerorun.telemetry.state import JobState


def load_run(run_dir: str) -> tuple[JobState, list[Event]]:
    """A finished (or stopped) run's :class:`JobState` and events, from ``run_dir``'s ``metrics.jsonl``,
    ``recipe.yaml`` and ``job.json`` (the last two optional). Lines that are not events (a line cut short when
    the launcher was killed) are skipped.

    Raises:
        ZerorunError: ``run_dir`` has no readable ``metrics.jsonl``, or it holds no event.
    """
    path = os.path.join(run_dir, runfolder.METRICS)
    try:
        events = _events(path)
    except OSError as err:
        raise ZerorunError(f"{path}: cannot read the run's metrics ({err.strerror}); "
                           "is RUN_DIR a run directory (runs/<name>/<timestamp>)?") from None
    if not events:
        raise ZerorunError(f"{path}: no telemetry events in it (the job ended before any rank started)")
    job = read_json(os.path.join(run_dir, runfolder.JOB))
    started, ended = number(job, "started"), number(job, "ended")
    hosts = job.get("hosts") if isinstance(job.get("hosts"), list) else None
    state = JobState(**run_header(run_dir), world_size=integer(job, "world_size"),
                     hosts=[str(h) for h in hosts or []], rank_hosts=_rank_hosts(job),
                     started=started if started is not None else min((e.time for e in events), default=0.0))
    for e in events:
        state.update(e)
    exits = job.get("rank_exits") if isinstance(job.get("rank_exits"), dict) else {}
    for rank, code in exits.items():  # as the live view had them: show said "stopped" for a rank's "exit 3"
        if str(rank).isdigit() and isinstance(code, int) and not isinstance(code, bool):
            state.rank_exited(int(rank), code)
    state.end(ended if ended is not None else max((e.time for e in events), default=state.started))
    return state, events


def _events(path: str) -> list[Event]:
    """The events of the metrics.jsonl ``path``, lines that are not events skipped.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        return [e for e in map(from_json, f) if e is not None]


def earlier_rank_hosts(run_dir: str) -> dict[int, str]:
    """The hosts of the ranks of the try recorded in ``run_dir``'s job.json (a restarted job's earlier one), by
    rank; ``{}`` when there is none or it cannot be read."""
    return _rank_hosts(read_json(os.path.join(run_dir, runfolder.JOB)))


def _rank_hosts(job: dict) -> dict[int, str]:
    found = job.get("rank_hosts")
    return {int(r): str(h) for r, h in found.items() if str(r).isdigit()} if isinstance(found, dict) else {}


def replay(state: JobState, run_dir: str) -> None:
    """Fold the events already in ``run_dir``'s metrics.jsonl into ``state``: a restarted job's earlier tries
    (Note [Job restarts] in launch/restart.py), so that its views and summary count the whole job as ``zerorun
    show`` does (before: the last try only, with the first try's start). A file that cannot be read adds
    nothing."""
    try:
        events = _events(os.path.join(run_dir, runfolder.METRICS))
    except OSError:
        return
    for e in events:
        state.update(e)


def run_header(run_dir: str) -> dict:
    """``name``, ``stage``, ``precision`` and ``steps`` of the run in ``run_dir`` from its ``recipe.yaml``
    (the name of the folder above when there is none), as :class:`JobState`'s keyword arguments."""
    recipe = _read_yaml(os.path.join(run_dir, runfolder.RECIPE))
    train = recipe.get("train") if isinstance(recipe.get("train"), dict) else {}
    zero = recipe.get("zero") if isinstance(recipe.get("zero"), dict) else {}
    return {"name": str(recipe.get("name", os.path.basename(os.path.dirname(os.path.abspath(run_dir))))),
            "stage": integer(zero, "stage"), "precision": recipe.get("precision"), "steps": integer(train, "steps")}


def read_json(path: str) -> dict:
    """The JSON object in ``path``; ``{}`` when it cannot be read or is not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def write_job_file(run_dir: str, state: JobState, status: str, exit_code: int, message: str = "",
                   rank: int | None = None, host: str | None = None) -> None:
    """Write ``run_dir/job.json``: start and end (Unix s), world size, hosts (and the host of each rank, as
    the hostfile names it), how the job ended: ``status`` (ok | failed | interrupted), the launcher's
    ``exit_code``, a one-line ``message``, for a failure the failing ``rank`` and ``host`` when known, the
    SLURM job it ran in (``slurm_job_id``: ``SLURM_JOB_ID``, for ``zerorun attach JOBID``; None outside it),
    and the exit status of each rank that ended on its own (``rank_exits``, as torchrun reported them)."""
    data = {"started": state.started, "ended": state.ended, "world_size": state.world_size, "hosts": state.hosts,
            "rank_hosts": {str(r): h for r, h in state.rank_hosts.items()}, "status": status, "exit_code": exit_code,
            "message": message, "rank": rank, "host": host, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "rank_exits": {str(r): c for r, c in state.rank_exit_codes.items()}}
    tmp = os.path.join(run_dir, runfolder.JOB + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(run_dir, runfolder.JOB))
