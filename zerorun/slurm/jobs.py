"""SLURM jobs and their run folders: what ``zerorun submit`` and ``zerorun train`` inside an allocation record,
and what ``zerorun attach JOBID`` asks SLURM (``scontrol``) to find and follow a job.

Note [Finding a job's run folder]: a job's run folder is found, in this order, from
  1. the job's own batch script (``scontrol write batch_script JOBID -``): a script written by ``zerorun submit``
     sets ``RUN_DIR=...`` (slurm/submit.py), also after the user edited and resubmitted it with sbatch;
  2. the record ``$XDG_STATE_HOME/zerorun/slurm-jobs/JOBID.json`` (default ``~/.local/state``), written by
     ``zerorun submit`` and by every ``zerorun train``/``launch`` run inside an allocation (your own sbatch
     script, salloc): on a cluster the home folder is shared, so a record made on a compute node is read on
     the login node; it outlives the controller's memory of the job (``MinJobAge``, 300 s by default).
A record older than the job (another cluster's job of the same id) is ignored when SLURM still knows the job:
its ``submitted`` time must not be before the job's ``SubmitTime`` less a minute.
The run folder also holds ``slurm-job.json`` (the job id, written by submit), so ``zerorun show RUN_DIR``
knows which job to follow while it runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass

from zerorun import runfolder
from zerorun.errors import ZerorunError
from zerorun.telemetry.jobfiles import read_json

#: SLURM job states in which the job's batch script may still run (squeue's long names). Not COMPLETING: SLURM
#: enters it as soon as it signals the job (scancel, time limit), while ``zerorun train`` in the batch script
#: may still save a checkpoint and write ``job.json``; and it lasts while SLURM cleans up the nodes (a minute
#: when a process does not end with SIGKILL: UnkillableStepTimeout). ``zerorun attach`` follows a COMPLETING
#: job until that job's ``job.json`` appears or SLURM settles on the final state (slurm/attach.py).
ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                    "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"})
JOB_FILE = runfolder.SLURM_JOB  # in the run folder
_JOB_ID = re.compile(r"^[1-9]\d*(_\d+)?$")  # not 0: "scontrol show job 0" lists every job
_SCONTROL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class JobInfo:
    """What ``scontrol show job`` says of a job: ``state`` (``PENDING``, ``RUNNING``, ``COMPLETED``, ...),
    ``reason`` (why it waits, ``None`` when none), ``exit_code`` (``"0:0"``: the batch script's exit status and
    the signal that ended it), ``nodes`` (the node list, ``None`` before it starts), ``submitted`` (Unix s),
    ``restarts`` (how often SLURM requeued it: counted up as soon as the requeue begins) and ``started`` (Unix
    s: when its current run started, or is expected to)."""

    job_id: str
    state: str
    reason: str | None = None
    exit_code: str = "0:0"
    nodes: str | None = None
    submitted: float | None = None
    restarts: int = 0
    started: float | None = None

    @property
    def active(self) -> bool:
        """The job has not ended (pending, running, completing, suspended, requeued)."""
        return self.state in ACTIVE

    @property
    def pending(self) -> bool:
        return self.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING")


def check_job_id(job_id: str) -> str:
    """``job_id`` stripped, when it is a SLURM job id (``123``, or ``123_4`` for an array task).

    Raises:
        ZerorunError: anything else.
    """
    job_id = job_id.strip()
    if not _JOB_ID.match(job_id):
        raise ZerorunError(f"{job_id!r} is not a SLURM job id (digits, as sbatch and squeue print it)")
    return job_id


def state_dir() -> str:
    """The folder of the job records: ``$XDG_STATE_HOME/zerorun/slurm-jobs`` (default ``~/.local/state``)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "zerorun", "slurm-jobs")


def remember(job_id: str, run_dir: str, *, in_run_dir: bool = False) -> None:
    """Record that SLURM job ``job_id`` writes into ``run_dir`` (Note [Finding a job's run folder]); with
    ``in_run_dir`` also write ``run_dir/slurm-job.json``. Never fails: a record that cannot be written only
    means ``zerorun attach`` has to be given the folder (``zerorun show RUN_DIR``)."""
    data = {"job_id": job_id, "run_dir": os.path.abspath(run_dir), "submitted": time.time(),
            "slurm_conf": os.environ.get("SLURM_CONF")}
    targets = [os.path.join(state_dir(), f"{job_id}.json")]
    if in_run_dir:
        targets.append(os.path.join(run_dir, JOB_FILE))
    for path in targets:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError:
            pass


def recorded_run_dir(job_id: str, info: JobInfo | None = None) -> str | None:
    """The run folder recorded for ``job_id``, or None; a record made before SLURM's job was submitted (another
    cluster's job of the same id) is not this job's."""
    data = read_json(os.path.join(state_dir(), f"{job_id}.json"))
    run_dir, made = data.get("run_dir"), data.get("submitted")
    if not isinstance(run_dir, str):
        return None
    older = info is not None and info.submitted is not None and isinstance(made, (int, float))
    if older and made < info.submitted - 60:
        return None
    return run_dir


def submitted_job(run_dir: str) -> str | None:
    """The SLURM job id ``zerorun submit`` recorded in ``run_dir`` (its ``slurm-job.json``), or None."""
    job_id = read_json(os.path.join(run_dir, JOB_FILE)).get("job_id")
    return str(job_id) if isinstance(job_id, (str, int)) and _JOB_ID.match(str(job_id)) else None


def _scontrol(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("scontrol") is None:
        raise ZerorunError("scontrol: not found on PATH (zerorun attach asks SLURM about the job; run it where "
                           "SLURM's client commands are, or give the run folder: zerorun show RUN_DIR)")
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ZerorunError(f"scontrol {' '.join(args)}: no answer in {_SCONTROL_TIMEOUT_S:.0f} s (is slurmctld "
                           "up?)") from None


def one_line(text: str) -> str:
    """A command's stderr as one line: its non-empty lines without the ``sbatch: error:`` style prefixes,
    joined by ``; ``."""
    lines = [re.sub(r"^\w+: (error: )?", "", line.strip()) for line in text.splitlines() if line.strip()]
    return "; ".join(lines) or "(no message)"


def field(text: str, key: str) -> str | None:
    """The value of ``key=`` in scontrol's one-line ``Key=Value`` output (values with spaces are not read)."""
    m = re.search(rf"(?:^|\s){key}=(\S+)", text)
    return m.group(1) if m else None


def _local_time(value: str | None) -> float | None:
    try:
        return time.mktime(time.strptime(value or "", "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_job(job_id: str, text: str) -> JobInfo:
    """A :class:`JobInfo` from ``scontrol show job -o JOBID``'s one line of ``Key=Value`` fields (values with
    spaces, such as ``Command=``, are not read)."""
    reason = field(text, "Reason")
    nodes = field(text, "NodeList")
    restarts = field(text, "Restarts") or "0"
    return JobInfo(job_id, field(text, "JobState") or "UNKNOWN", None if reason in (None, "None") else reason,
                   field(text, "ExitCode") or "0:0", None if nodes in (None, "(null)") else nodes,
                   _local_time(field(text, "SubmitTime")), int(restarts) if restarts.isdigit() else 0,
                   _local_time(field(text, "StartTime")))


def job_info(job_id: str) -> JobInfo | None:
    """What SLURM says of ``job_id`` now, or None when the controller does not know it (never submitted, or
    ended more than ``MinJobAge`` ago).

    Raises:
        ZerorunError: no scontrol on PATH, no answer, or another error of scontrol (one line).
    """
    out = _scontrol("show", "job", "-o", job_id)
    if out.returncode != 0:
        said = out.stderr.strip() or out.stdout.strip()  # scontrol says some of it on stdout
        if "Invalid job id" in said:
            return None
        raise ZerorunError(f"scontrol show job {job_id}: {one_line(said)}")
    return parse_job(job_id, out.stdout)


def script_run_dir(script: str) -> str | None:
    """The ``RUN_DIR=...`` a batch script written by ``zerorun submit`` sets (shell-unquoted; where a user's
    edit wrote ``$HOME``, ``${VAR}`` or ``~`` outside single quotes, expanded from this environment), or None."""
    for line in script.splitlines():
        m = re.match(r"^\s*(?:export\s+)?RUN_DIR=(.*)$", line)
        if m:
            try:
                words = shlex.split(m.group(1), comments=True)
            except ValueError:
                return None
            if len(words) != 1:
                return None
            if _expands(m.group(1)):
                return os.path.expanduser(os.path.expandvars(words[0]))
            return words[0]
    return None


def _expands(text: str) -> bool:
    """Whether bash would expand something in the word ``text``: a ``$`` outside single quotes (and not after
    a backslash), or a leading ``~``."""
    quote, escaped = None, False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\" and quote != "'":
            escaped = True
        elif quote == "'":
            quote = None if c == "'" else quote
        elif c in "'\"" and quote is None:
            quote = c
        elif c == '"' and quote == '"':
            quote = None
        elif c == "$":
            return True
    return text.startswith("~")


def find_run_dir(job_id: str, info: JobInfo | None) -> str:
    """The run folder of SLURM job ``job_id`` (Note [Finding a job's run folder]).

    Raises:
        ZerorunError: SLURM does not know the job and there is no record of it, or the job is not zerorun's.
    """
    if info is not None:
        out = _scontrol("write", "batch_script", job_id, "-")
        found = script_run_dir(out.stdout) if out.returncode == 0 else None
        if found:
            return found
    recorded = recorded_run_dir(job_id, info)
    if recorded:
        return recorded
    if info is None:
        raise ZerorunError(f"job {job_id}: unknown to SLURM (scontrol show job: Invalid job id) and no zerorun "
                           f"record of it in {state_dir()}")
    raise ZerorunError(f"job {job_id} ({info.state}): not started by zerorun submit (its batch script sets no "
                       "RUN_DIR) and no zerorun train recorded a run folder for it yet; give the folder: "
                       "zerorun show RUN_DIR")
