"""Experiment trackers (the recipe's ``log.trackers``): TensorBoard, Weights & Biases, MLflow and CSV, each
through its own library, fed the step and eval events the launcher receives.

Note [Trackers in the launcher]: DeepSpeed's monitors write on the job's rank 0, the HF Trainer's
``report_to`` on its main process. zerorun writes them in the launcher, beside ``metrics.jsonl``, from rank 0's
events (the loss in them is already the job-wide mean, the rates the job's): the trackers then get the same
numbers as ``metrics.jsonl`` by construction, they work the same when rank 0 runs on a remote node over SSH or
SLURM (its files land in the run folder the user looks at, and only the launcher's host needs the tracker
libraries and any network access), and no rank spends time in a tracker library during training (wandb starts
a service process, MLflow and TensorBoard write files). The trackers are opened and written on a thread of
their own (:class:`TrackerSink`), so the seconds of importing them (torch for TensorBoard) delay neither the
launch nor the dashboard. A tracker that fails (a server down, a full disk) is one warning line on stderr and
then left out: it never stops the job.

Note [Tracker resume]: a run's identity (its name, the TensorBoard folder, the wandb run id, the MLflow tracking
URI and run id) is written as ``trackers.json`` into the run folder, and into ``checkpoint.dir`` beside the
checkpoints under the launcher's job id (``{"jobs": {job: identity}}``): every job that starts on the folder adds
its own, and each checkpoint's ``zerorun.json`` names the job that saved it. A job resuming a checkpoint
(``checkpoint.resume``, set by ``--resume``) continues the runs of the job that saved that checkpoint (a job started
on the folder since, killed before it saved anything, is not the one continued): TensorBoard writes into the same
folder with ``purge_step`` and the CSV drops its rows after the checkpoint (the steps after it that a failed job
logged are gone; from step 0, step 0's evaluation too, which the job makes again); wandb resumes the run id
(``resume="allow"``) and MLflow reopens the run, and neither can take back a point once logged: wandb ignores the steps logged again (its values stay the failed job's), MLflow keeps
both (the later timestamp is the resumed job's). The same job started again in its run folder (a restart, a
requeued batch job) finds the file there first. The CSV is the run folder's, as ``metrics.jsonl`` is. A
``trackers.json`` of an earlier zerorun (one identity, no ``jobs``) is kept as ``earlier`` and continued by a
resume of a checkpoint that names no job (saved by an earlier zerorun).
"""

from __future__ import annotations

import csv
import json
import os
import queue
import re
import sys
import threading
import time
from typing import Any, Callable

from zerorun import runfolder
from zerorun.telemetry.jobfiles import read_json
from zerorun.telemetry.trackers_spec import SCALAR_NAMES, flat_params, scalars

IDENTITY = runfolder.TRACKERS
_MLFLOW_PARAM_CHARS, _MLFLOW_KEY_CHARS = 6000, 250  # MLflow's longest parameter value and name
CLOSE_S = 60.0  # the most seconds the launcher waits for the trackers at the end (a wandb upload, a server)
_MLFLOW_BATCH = 100  # MLflow's most parameters per log_batch


class Context:
    """What a tracker is opened with: the run folder, the recipe, the run's name, the identity of the run it
    continues (Note [Tracker resume]; ``{}`` for a new run), the step the job resumes after (0: from the start)
    and ``first_step``, the first it logs (0 from the start: its evaluation at step 0 comes again)."""

    def __init__(self, run_dir: str, recipe, identity: dict[str, Any], resumed_step: int) -> None:
        from zerorun.recipe.text import masked

        self.run_dir, self.recipe, self.identity, self.resumed_step = run_dir, recipe, identity, resumed_step
        self.first_step = resumed_step + 1 if resumed_step else 0  # from step 0: its evaluation comes again
        self.name = str(identity.get("name") or os.path.basename(os.path.normpath(run_dir)))
        self.params = masked(json.loads(recipe.model_dump_json()))  # Note [Masked environment values]


class TensorBoardTracker:
    """``torch.utils.tensorboard.SummaryWriter`` event files in ``log.tensorboard.dir`` or the run folder's
    ``tensorboard``; the recipe as the text ``recipe`` at step 0."""

    def __init__(self, ctx: Context) -> None:
        from torch.utils.tensorboard import SummaryWriter

        spec = ctx.recipe.log.tensorboard
        folder = ctx.identity.get("tensorboard") or os.path.abspath(spec.dir or os.path.join(ctx.run_dir,
                                                                                              runfolder.TENSORBOARD))
        continued = bool(ctx.identity)  # what the earlier job logged from the first step logged again is hidden
        self.writer = SummaryWriter(folder, purge_step=ctx.first_step if continued else None)
        if not continued or ctx.first_step == 0:
            self.writer.add_text("recipe", "```\n" + json.dumps(ctx.params, indent=2) + "\n```", 0)
        self.identity = {"tensorboard": folder}

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self, ok: bool) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run (``log.wandb``: project, entity, mode, tags) with the recipe as its config, files under the
    run folder's ``wandb``; nothing of the launcher's environment, command line, output or machine recorded
    (its command line may hold a ``launch.env`` override)."""

    def __init__(self, ctx: Context) -> None:
        import wandb

        spec = ctx.recipe.log.wandb
        mode = spec.mode or os.environ.get("WANDB_MODE") or "online"
        if mode not in ("offline", "disabled", "dryrun") and not wandb.login(prompt=False, verify=False):
            # wandb.init would ask for a key on the terminal the dashboard draws on, from this thread
            raise RuntimeError("no W&B API key on this host (wandb login, or WANDB_API_KEY); or set "
                               "log.wandb.mode: offline and wandb sync the run folder's wandb/ later")
        run_id = ctx.identity.get("wandb")  # None: a new run, its id chosen by wandb
        settings = wandb.Settings(console="off", x_disable_meta=True, x_disable_stats=True, save_code=False,
                                  disable_git=True, x_save_requirements=False, silent=True)
        self.run = wandb.init(project=spec.project or ctx.recipe.name, entity=spec.entity, name=ctx.name,
                              id=run_id, resume="allow" if run_id else None, mode=spec.mode, dir=ctx.run_dir,
                              config=ctx.params, tags=spec.tags or None, settings=settings, reinit="create_new")
        self.identity = {"wandb": self.run.id}

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


def mlflow_uri(recipe) -> str:
    """``log.mlflow.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else the folder ``<log.dir>/mlruns`` as a
    ``file:`` URI."""
    from pathlib import Path

    return recipe.log.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
        Path(os.path.abspath(os.path.join(recipe.log.dir, "mlruns"))).as_uri()


class MlflowTracker:
    """An MLflow run in ``log.mlflow.experiment`` (default: the recipe's name) at :func:`mlflow_uri`, through
    ``MlflowClient`` (no global active run); the recipe as dotted parameters.

    MLflow 3 refuses a folder store unless ``MLFLOW_ALLOW_FILE_STORE`` is set (it asks for a database); a
    folder is what needs no server and no SQL packages (the ``mlflow`` extra installs ``mlflow-skinny``), so
    the launcher sets it for a ``file:`` URI; ``tracking_uri: sqlite:///...`` or a server works as MLflow's own.
    """

    def __init__(self, ctx: Context) -> None:
        uri = (ctx.identity.get("mlflow") or {}).get("tracking_uri") or mlflow_uri(ctx.recipe)
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        run_id = (ctx.identity.get("mlflow") or {}).get("run_id")
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            name = ctx.recipe.log.mlflow.experiment or ctx.recipe.name
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment, run_name=ctx.name).info.run_id
            params = [Param(re.sub(r"[^\w\-. /]", "_", k)[:_MLFLOW_KEY_CHARS], v[:_MLFLOW_PARAM_CHARS])
                      for k, v in flat_params(ctx.params).items()]  # a model.kwargs key may hold any character
            for i in range(0, len(params), _MLFLOW_BATCH):
                self.client.log_batch(run_id, params=params[i:i + _MLFLOW_BATCH])
        self.run_id = run_id
        self.identity = {"mlflow": {"tracking_uri": uri, "run_id": run_id}}

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class CsvTracker:
    """``metrics.csv`` in the run folder: a header ``step,time,<every scalar name>``, a row per step or eval
    event (``time`` in Unix seconds), a name the event does not carry left empty."""

    def __init__(self, ctx: Context) -> None:
        os.makedirs(ctx.run_dir, exist_ok=True)
        path = os.path.join(ctx.run_dir, runfolder.METRICS_CSV)
        names = ["step", "time", *SCALAR_NAMES]
        if ctx.identity and os.path.exists(path):  # continued: the rows after the checkpoint go (Note [Tracker resume])
            _keep_rows(path, names, ctx.first_step - 1)
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        self.file = open(path, "a", encoding="utf-8", newline="")
        self.writer = csv.DictWriter(self.file, names)
        if new:
            self.writer.writeheader()
        self.identity: dict[str, Any] = {}

    def log(self, step: int, values: dict[str, float]) -> None:
        self.writer.writerow({"step": step, "time": round(time.time(), 3), **{k: repr(v) for k, v in values.items()}})
        self.file.flush()

    def close(self, ok: bool) -> None:
        self.file.close()


def _keep_rows(path: str, names: list[str], last: int) -> None:
    """Rewrite the CSV ``path`` (whole or not at all) with its rows of steps up to ``last`` only, under the header
    ``names`` (a row cut short by a full disk goes too)."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = [row for row in csv.DictReader(f) if (row.get("step") or "").isdigit() and int(row["step"]) <= last]
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


TRACKERS: dict[str, Callable[[Context], Any]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                                 "mlflow": MlflowTracker, "csv": CsvTracker}


def read_identity(run_dir: str, recipe) -> tuple[dict[str, Any], int]:
    """The identity of the runs a job continues (Note [Tracker resume]): the run folder's ``trackers.json`` (the
    same job started again in its folder), else the identity of the job that saved ``checkpoint.resume``; ``{}``
    when there is none (new runs). And the step the job resumes after: ``checkpoint.resume``'s (its
    ``zerorun.json``'s, whatever the folder is named), 0 when it starts from step 0."""
    from zerorun.checkpoint.files import META

    resume = recipe.checkpoint.resume
    meta = read_json(os.path.join(resume, META)) if resume else {}
    match = re.search(r"step-(\d+)$", os.path.normpath(resume)) if resume else None
    step = meta.get("step") if isinstance(meta.get("step"), int) else int(match.group(1)) if match else 0
    own = read_json(os.path.join(run_dir, IDENTITY))
    if own or not resume:
        return own, step
    beside = read_json(os.path.join(os.path.dirname(os.path.normpath(resume)), IDENTITY))
    if "jobs" not in beside:  # an earlier zerorun's file: one identity, the last job's
        return beside, step
    job, jobs = meta.get("job"), beside["jobs"] if isinstance(beside["jobs"], dict) else {}
    identity = jobs.get(job) if isinstance(job, str) else beside.get("earlier")  # saved by an earlier zerorun
    return (identity, step) if isinstance(identity, dict) else ({}, step)


def _write_json(folder: str, value: dict[str, Any]) -> None:
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{IDENTITY}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, os.path.join(folder, IDENTITY))


def write_identity(identity: dict[str, Any], run_dir: str, checkpoints: str | None, job: str | None) -> None:
    """Write ``identity`` as ``trackers.json`` into ``run_dir``, and under ``job`` into the one in
    ``checkpoints`` (``checkpoint.dir``, which this job holds: Note [Checkpoint folder lock]; the other jobs'
    identities kept), each whole or not at all. Without ``checkpoints`` or ``job``: the run folder's only.

    Raises:
        OSError: a folder or file cannot be written.
    """
    _write_json(run_dir, identity)
    if checkpoints and job:
        found = read_json(os.path.join(checkpoints, IDENTITY))
        jobs = found.get("jobs") if isinstance(found.get("jobs"), dict) else {}
        earlier = found.get("earlier", found if found and "jobs" not in found else None)  # an earlier zerorun's
        _write_json(checkpoints, {"jobs": {**jobs, job: identity}, **({"earlier": earlier} if earlier else {})})


class TrackerSink:
    """Feeds rank 0's step and eval events to the recipe's ``log.trackers``, on a thread of its own (Note
    [Trackers in the launcher]). ``warn``: where a tracker's failure goes, one line (default: stderr); ``job``:
    the launcher's job id (Note [Tracker resume])."""

    def __init__(self, run_dir: str, recipe, warn: Callable[[str], None] | None = None,
                 job: str | None = None) -> None:
        self.run_dir, self.recipe, self.job = run_dir, recipe, job
        self.warn = warn or (lambda line: sys.stderr.write(line + "\n"))
        self.finished = False  # rank 0 sent its finish event: the runs end as FINISHED, else FAILED
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="zerorun-trackers", daemon=True)
        self._thread.start()

    def event(self, e) -> None:
        """Queue event ``e`` (a :class:`~zerorun.telemetry.events.Event`) if it is rank 0's step or eval event."""
        if e.rank != 0:
            return
        if e.kind == "finish":
            self.finished = True
        values = scalars(e.kind, e.data)
        step = e.data.get("step")
        if values and isinstance(step, int) and not isinstance(step, bool):
            self._queue.put((step, values))

    def close(self) -> None:
        """Write what is queued, end the runs and wait for the thread, at most :data:`CLOSE_S`."""
        self._queue.put(None)
        self._thread.join(CLOSE_S)
        if self._thread.is_alive():  # a daemon thread: the launcher's exit ends it
            self.warn(f"zerorun: warning: log.trackers: still writing after {CLOSE_S:.0f} s; left unfinished")

    def _open(self) -> list[tuple[str, Any]]:
        identity, resumed_step = read_identity(self.run_dir, self.recipe)
        ctx = Context(self.run_dir, self.recipe, identity, resumed_step)
        opened, merged = [], {"name": ctx.name}
        for name in self.recipe.log.trackers:
            try:
                tracker = TRACKERS[name](ctx)
            except Exception as e:  # noqa: BLE001 - any library's failure: one line, the job goes on
                self.warn(f"zerorun: warning: log.trackers: {name} could not start, not recorded: "
                          f"{type(e).__name__}: {e}")
                continue
            opened.append((name, tracker))
            merged.update(tracker.identity)
        try:
            write_identity(merged, self.run_dir, self.recipe.checkpoint.dir, self.job)
        except OSError as e:
            self.warn(f"zerorun: warning: log.trackers: cannot write {IDENTITY} ({e.strerror}): a resumed job "
                      "starts new tracker runs")
        return opened

    def _run(self) -> None:
        opened = self._open()
        while True:
            item = self._queue.get()
            if item is None:
                break
            for name, tracker in list(opened):
                try:
                    tracker.log(*item)
                except Exception as e:  # noqa: BLE001
                    self.warn(f"zerorun: warning: log.trackers: {name} failed, no longer recorded: "
                              f"{type(e).__name__}: {e}")
                    opened.remove((name, tracker))
        for name, tracker in opened:
            try:
                tracker.close(self.finished)
            except Exception as e:  # noqa: BLE001
                self.warn(f"zerorun: warning: log.trackers: {name} did not close cleanly: {type(e).__name__}: {e}")
