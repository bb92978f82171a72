"""``zerorun show PATH``: the summary of a run again, from its run folder, and how the job ended.

PATH is a run folder (``runs/<name>/<timestamp>``) or the recipe's folder above it (``runs/<name>``), which
stands for its latest run. What the run folder records: ``metrics.jsonl`` (the events), ``recipe.yaml``,
``job.json`` (written by the launcher when the job ended: status, exit status, message, failing rank).
"""

from __future__ import annotations

import os
import re
import sys
from typing import TextIO

from zerorun import runfolder
from zerorun.errors import ZerorunError
from zerorun.telemetry.jobfiles import load_run, read_json
from zerorun.telemetry.state import JobState

_STAMP = re.compile(r"^\d{8}-\d{6}")  # the launcher's run folder names: 20261130-194757-d519


def find_run(path: str) -> tuple[str, int]:
    """The run folder ``path`` names and how many runs it chose from: ``path`` itself when it holds a
    ``metrics.jsonl``, else its latest run folder (by the time in its name, then by modification time).

    Raises:
        ZerorunError: ``path`` is not a folder, or neither it nor any folder in it holds a run.
    """
    if os.path.isfile(os.path.join(path, runfolder.METRICS)):
        return path, 1
    if os.path.isfile(path) and os.path.basename(path) == runfolder.METRICS:  # its folder, as meant
        return os.path.dirname(path) or ".", 1
    if not os.path.isdir(path):
        what = "a file, not a run folder" if os.path.exists(path) else "no such run folder"
        raise ZerorunError(f"{path}: {what} (give runs/<name> or runs/<name>/<timestamp>)")
    runs = [os.path.join(path, d) for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, runfolder.METRICS))]
    if not runs:
        raise ZerorunError(f"{path}: no run in it: neither it nor a folder in it holds a metrics.jsonl "
                           "(give runs/<name> or runs/<name>/<timestamp>)")

    def when(run: str) -> tuple[str, float]:
        stamp = _STAMP.match(os.path.basename(run))
        return (stamp.group(0) if stamp else "", os.path.getmtime(os.path.join(run, runfolder.METRICS)))

    return max(runs, key=when), len(runs)


def outcome(run_dir: str, state: JobState | None = None) -> str:
    """One line on how the job of ``run_dir`` ended, from its ``job.json`` (and, for a failure that does not
    name its rank, the ranks of ``state`` that failed or exited on their own)."""
    path = os.path.join(run_dir, runfolder.JOB)
    job = read_json(path)
    status, code, message = job.get("status"), job.get("exit_code"), str(job.get("message") or "")
    if status is None and os.path.exists(path):
        return f"the job's record of how it ended cannot be read ({path}: not the JSON object zerorun writes)"
    if status is None:
        return ("the job did not record how it ended (no job.json: the launcher was killed, or is still running)")
    if status == "ok":
        return "the job finished (exit status 0)"
    where = ""
    if isinstance(job.get("rank"), int):
        where = f"rank {job['rank']}" + (f" on {job['host']}" if job.get("host") else "") + ": "
    elif state is not None and status == "failed":
        failed = [r for r in sorted(state.ranks.values(), key=lambda r: r.rank)
                  if r.status in ("error", "killed") or r.status.startswith("exit ")]
        if failed:
            r = failed[0]
            where = f"rank {r.rank}" + (f" on {r.host}" if r.host else "") + f" ({r.status}): "
    what = "was interrupted" if status == "interrupted" else "FAILED" if status == "failed" else f"ended: {status}"
    return f"the job {what} (exit status {code}): {where}{message}".rstrip(": ")


def show(path: str, plot: str | None = None, out: TextIO | None = None) -> None:
    """Print the summary of the run at ``path`` (:func:`find_run`) and how its job ended; with ``plot``, also
    draw loss and memory per rank into that image file (telemetry/plot.py).

    Raises:
        ZerorunError: no run at ``path``, its metrics cannot be read, or the plot cannot be written.
    """
    from zerorun.telemetry.summary import print_summary

    out = out or sys.stdout
    if plot:
        from zerorun.telemetry.plot import check_plot_path

        check_plot_path(plot)  # before anything is printed or written
    run_dir, count = find_run(path)
    if count > 1 or os.path.normpath(run_dir) != os.path.normpath(path):
        out.write(f"zerorun: the latest of {count} run{'s' * (count != 1)} in {path}: {run_dir}\n")
    try:
        state, events = load_run(run_dir)
    except ZerorunError as e:
        if os.path.exists(os.path.join(run_dir, runfolder.JOB)):
            raise ZerorunError(f"{e}; {outcome(run_dir)}") from None
        raise
    print_summary(state, out)
    out.write(f"zerorun: {outcome(run_dir, state)}\n")
    out.flush()
    if plot:
        from zerorun.telemetry.plot import plot_run

        plot_run(state, events, plot)
        out.write(f"zerorun: wrote {plot}\n")
