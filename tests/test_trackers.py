"""``log.trackers``: TensorBoard, wandb (offline), MLflow (a local store) and CSV, read back through each
library's own reader and compared with metrics.jsonl (Note [Trackers in the launcher], Note [Tracker resume] in
zerorun/telemetry/trackers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tracker_readers import csv_scalars, mlflow_scalars, tensorboard_scalars, wandb_run
from zerorun.errors import ZerorunError
from zerorun.recipe import MASK, load_recipe
from zerorun.telemetry.events import Event

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")
ALL = "log.trackers=[tensorboard,wandb,mlflow,csv]"
#: the names the issue asks for -> the event field they carry (rank 0's step events; eval events)
NAMES = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
         "perf/samples_per_s": "job_samples_per_s", "perf/tokens_per_s": "job_tokens_per_s",
         "memory/peak_rss_bytes": "peak_rss_bytes", "comm/wait_s": "comm_wait_s", "comm/bytes": "comm_bytes",
         "comm/bytes_inter_node": "comm_bytes_inter_node"}


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline, every wandb folder in tmp: nothing goes to the network or the home folder."""
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def expected(events: list[dict]) -> dict[str, dict[int, float]]:
    """What every tracker must hold: rank 0's step and eval events of metrics.jsonl under the stable names."""
    out: dict[str, dict[int, float]] = {}
    for e in events:
        if e["rank"] == 0 and e["event"] == "step":
            for name, field in NAMES.items():
                if e.get(field) is not None:
                    out.setdefault(name, {})[e["step"]] = float(e[field])
        elif e["rank"] == 0 and e["event"] == "eval":
            out.setdefault("eval/loss", {})[e["step"]] = e["val_loss"]
    return out


def identity(folder) -> dict:
    return json.loads((folder / "trackers.json").read_text())


@pytest.mark.slow
def test_a_job_writes_every_tracker_with_the_scalars_of_metrics_jsonl(offline):
    runs = offline / "runs"
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", TINY, f"log.dir={runs}", "train.steps=6",
                          "train.eval_every=3", "log.every=2", ALL, "launch.env.MY_TOKEN=hunter2-secret",
                          "log.wandb.mode=offline", "--no-dashboard"], cwd=ROOT, capture_output=True, text=True,
                         timeout=240, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "warning" not in out.stderr, out.stderr
    [run_dir] = [p for p in (runs / "tiny").iterdir() if p.name != "checkpoints"]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = expected(events)
    assert sorted(want["train/loss"]) == [1, 2, 4, 6] and sorted(want["eval/loss"]) == [0, 3, 6]
    ids = identity(run_dir)
    assert ids["name"] == run_dir.name and ids["tensorboard"] == str(run_dir / "tensorboard")

    wandb_id, config, wandb_values = wandb_run(str(run_dir / "wandb"))
    assert wandb_id == ids["wandb"] and wandb_values == want
    assert config["train"]["steps"] == 6 and config["launch"]["env"] == {"MY_TOKEN": MASK}
    assert mlflow_scalars(ids["mlflow"]["tracking_uri"], ids["mlflow"]["run_id"], list(want)) == want
    assert csv_scalars(str(run_dir / "metrics.csv")) == want
    board = tensorboard_scalars(ids["tensorboard"])  # float32 in the event files
    assert {k: sorted(v) for k, v in board.items()} == {k: sorted(v) for k, v in want.items()}
    for name, values in want.items():
        assert board[name] == pytest.approx(values, rel=1e-6)

    from mlflow.tracking import MlflowClient

    run = MlflowClient(ids["mlflow"]["tracking_uri"]).get_run(ids["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    assert run.data.params["train.steps"] == "6" and run.data.params["launch.env.MY_TOKEN"] == MASK
    assert run.data.params["log.trackers"] == '["tensorboard", "wandb", "mlflow", "csv"]'
    for folder, _, files in os.walk(offline):  # the secret is in no file the job left
        for name in files:
            assert b"hunter2-secret" not in open(os.path.join(folder, name), "rb").read(), os.path.join(folder, name)


@pytest.mark.parametrize("tracker,module", [("tensorboard", "tensorboard"), ("wandb", "wandb"),
                                            ("mlflow", "mlflow")])
def test_a_missing_tracker_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, tracker, module):
    recipe = tmp_path / "r.yaml"
    text = open(TINY).read().replace("models/gpt.py", os.path.join(ROOT, "recipes/models/gpt.py"))
    recipe.write_text(text.replace("log: {every: 5, dir: runs}", f"log:\n  every: 5\n  trackers: [csv, {tracker}]\n"))
    monkeypatch.setitem(sys.modules, module, None)  # hidden: import fails, find_spec finds nothing
    with pytest.raises(ZerorunError) as e:
        load_recipe(str(recipe))
    assert str(e.value) == (f"{recipe}:23: log.trackers.1: the {tracker} tracker needs the {module} package: "
                            f"pip install 'zerorun[{tracker}]'")


def test_the_cli_refuses_a_missing_tracker_package_in_one_line_exit_2(tmp_path):
    code = ("import sys; sys.modules['wandb'] = None; from zerorun.cli import main; "
            f"sys.argv = ['zerorun', 'train', {TINY!r}, 'log.trackers=[wandb]', '--dry-run']; main()")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "zerorun: error: override 'log.trackers=[wandb]': log.trackers.0: the wandb tracker needs the wandb "
        "package: pip install 'zerorun[wandb]'"], out.stdout + out.stderr


@pytest.mark.parametrize("value,expected", [
    ("[csv,csv]", "log.trackers.1: 'csv' is named twice"),
    ("[comet]", "log.trackers.0: Input should be 'tensorboard', 'wandb', 'mlflow' or 'csv'"),
    ("csv", "log.trackers: expected a list: [csv] (got the text 'csv')"),
])
def test_bad_tracker_lists_are_refused_naming_the_field(value, expected):
    with pytest.raises(ZerorunError) as e:
        load_recipe(TINY, [f"log.trackers={value}"])
    assert str(e.value) == f"override 'log.trackers={value}': {expected}"


def _sink_run(run_dir, overrides, events, job=None):
    """A job's tracker writing, without the job: ``events`` fed to the launcher's tracker thread (``job``: the
    launcher's job id)."""
    from zerorun.telemetry.trackers import TrackerSink

    warnings = []
    sink = TrackerSink(str(run_dir), load_recipe(TINY, overrides), warn=warnings.append, job=job)
    for e in events:
        sink.event(e)
    sink.close()
    return warnings


def _steps(first, last, offset=0.0):
    events = []
    for s in range(first, last + 1):
        events.append(Event("step", 0, 0.0, {"step": s, "steps": 6, "loss": 5.0 - s / 10 + offset, "lr": 1e-3 * s,
                                        "grad_norm": 2.0, "job_samples_per_s": 100.0 + s, "comm_wait_s": None}))
        events.append(Event("step", 1, 0.0, {"step": s, "loss": 99.0}))  # another rank's: not a tracker's
    return events


def test_a_resumed_job_continues_the_same_runs(offline):
    """Run 1 logs steps 1-4 (checkpoint after step 2, then it fails); run 2 resumes step 2's checkpoint and
    logs 3-6: one wandb run id, one MLflow run, one TensorBoard folder whose steps 3-4 are run 2's."""
    ckpt = offline / "ckpt"
    base = [ALL, "log.wandb.mode=offline", f"log.dir={offline / 'runs'}", f"checkpoint.dir={ckpt}"]
    assert _sink_run(offline / "run1", base, _steps(1, 4), job="job1") == []  # no finish event: a failed job
    first = identity(offline / "run1")
    assert identity(ckpt) == {"jobs": {"job1": first}} and first["name"] == "run1"
    _checkpoint(ckpt, 2, "job1")
    time.sleep(1.0)  # TensorBoard reads event files in name order (<second>.<pid>.<count>: "10" before "9")
    finish = [Event("finish", 0, 0.0, {"steps": 6}), Event("eval", 0, 0.0, {"step": 6, "val_loss": 4.5})]
    assert _sink_run(offline / "run2", base + [f"checkpoint.resume={ckpt / 'step-00000002'}"],
                     _steps(3, 6, offset=0.5) + finish, job="job2") == []
    second = identity(offline / "run2")
    assert second == first and identity(ckpt) == {"jobs": {"job1": first, "job2": first}}  # the same runs

    resumed = {s: 5.0 - s / 10 + (0.5 if s > 2 else 0.0) for s in range(1, 7)}
    board = tensorboard_scalars(first["tensorboard"])
    assert board["train/loss"] == pytest.approx(resumed, rel=1e-6) and board["eval/loss"] == {6: 4.5}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(first["mlflow"]["tracking_uri"])
    history = sorted((m.step, m.timestamp) + (m.value,) for m in client.get_metric_history(
        first["mlflow"]["run_id"], "train/loss"))  # MLflow cannot take points back: steps 3-4 twice, run 2's later
    assert [s for s, _, _ in history] == [1, 2, 3, 3, 4, 4, 5, 6]
    assert {s: v for s, _, v in history} == pytest.approx(resumed, rel=1e-6)
    assert client.get_run(first["mlflow"]["run_id"]).info.status == "FINISHED"
    assert len(client.search_runs([client.get_experiment_by_name("tiny").experiment_id])) == 1
    assert wandb_run(str(offline / "run1" / "wandb"))[0] == wandb_run(str(offline / "run2" / "wandb"))[0] \
        == first["wandb"]
    assert csv_scalars(str(offline / "run2" / "metrics.csv"))["train/loss"] == {s: resumed[s] for s in (3, 4, 5, 6)}


def _checkpoint(ckpt, step, job):
    """A checkpoint folder of ``step`` saved by launcher job ``job`` (as far as the trackers read it)."""
    folder = ckpt / f"step-{step:08d}"
    folder.mkdir(parents=True)
    (folder / "zerorun.json").write_text(json.dumps({"format": 1, "step": step, "job": job}))
    return folder


def test_a_resume_continues_the_runs_of_the_job_that_saved_the_checkpoint(offline):
    """Job A saves step 2; job B starts on the same checkpoint folder without --resume and is killed before it
    saves; --resume of A's step 2 continues A's runs (before: trackers.json beside the checkpoints named the last
    job started, so the resumed job wrote A's weights' losses into B's TensorBoard folder and MLflow run). A
    checkpoint folder of an earlier zerorun (one identity, no jobs) is continued as before."""
    ckpt = offline / "ckpt"
    base = ["log.trackers=[tensorboard,mlflow]", f"log.dir={offline / 'runs'}", f"checkpoint.dir={ckpt}"]
    assert _sink_run(offline / "a", base, _steps(1, 2), job="a") == []
    _checkpoint(ckpt, 2, "a")
    assert _sink_run(offline / "b", base, _steps(1, 1, offset=1.0), job="b") == []
    a, b = identity(offline / "a"), identity(offline / "b")
    assert a["mlflow"]["run_id"] != b["mlflow"]["run_id"] and a["tensorboard"] != b["tensorboard"]
    assert _sink_run(offline / "c", base + [f"checkpoint.resume={ckpt / 'step-00000002'}"], _steps(3, 4),
                     job="c") == []
    assert identity(offline / "c") == a
    assert tensorboard_scalars(a["tensorboard"])["train/loss"] == pytest.approx({1: 4.9, 2: 4.8, 3: 4.7, 4: 4.6})
    assert tensorboard_scalars(b["tensorboard"])["train/loss"] == pytest.approx({1: 5.9})
    no_job = _checkpoint(ckpt, 3, None)  # saved by a program of its own: its job's runs are unknown, new ones
    assert _sink_run(offline / "d", base + [f"checkpoint.resume={no_job}"], _steps(4, 4), job="d") == []
    assert identity(offline / "d")["mlflow"]["run_id"] not in (a["mlflow"]["run_id"], b["mlflow"]["run_id"])
    (ckpt / "trackers.json").write_text(json.dumps(b))  # an earlier zerorun's file
    assert _sink_run(offline / "e", base + [f"checkpoint.resume={ckpt / 'step-00000002'}"], _steps(3, 3),
                     job="e") == []
    assert identity(offline / "e") == b and identity(ckpt)["earlier"] == b
    # kept for the next resume of a checkpoint that names no job (a review: continued once, then forgotten)
    assert _sink_run(offline / "f", base + [f"checkpoint.resume={no_job}"], _steps(4, 4), job="f") == []
    assert identity(offline / "f") == b


def test_a_resume_of_a_renamed_checkpoint_and_a_restart_from_step_0_keep_what_came_before(offline):
    """The step a job resumes after is its checkpoint's (zerorun.json), whatever the folder's name: a copy named
    ``best`` made TensorBoard hide every step (purge from step 1) and the CSV drop every row. A restart from
    step 0 evaluates step 0 again: the first try's step-0 evaluation goes (before: twice in TensorBoard and
    the CSV)."""
    import shutil

    ckpt = offline / "ckpt"
    base = ["log.trackers=[tensorboard,csv]", f"log.dir={offline / 'runs'}", f"checkpoint.dir={ckpt}"]
    step0 = [Event("eval", 0, 0.0, {"step": 0, "val_loss": 6.0})]
    assert _sink_run(offline / "a", base, step0 + _steps(1, 2), job="a") == []
    shutil.copytree(_checkpoint(ckpt, 2, "a"), ckpt / "best")
    assert _sink_run(offline / "b", base + [f"checkpoint.resume={ckpt / 'best'}"], _steps(3, 3), job="b") == []
    a = identity(offline / "a")
    assert tensorboard_scalars(a["tensorboard"])["train/loss"] == pytest.approx({1: 4.9, 2: 4.8, 3: 4.7})
    again = [Event("eval", 0, 0.0, {"step": 0, "val_loss": 5.5})] + _steps(1, 1)
    time.sleep(1.0)  # TensorBoard reads event files in name order (see above)
    assert _sink_run(offline / "a", base, again, job="a") == []  # restarted from step 0 in its run folder
    board = tensorboard_scalars(a["tensorboard"])
    assert board["eval/loss"] == {0: 5.5} and board["train/loss"] == pytest.approx({1: 4.9})
    rows = (offline / "a" / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows] == ["step", "0", "1"] and "recipe" in _tensorboard_texts(a["tensorboard"])


def _tensorboard_texts(folder) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder)
    acc.Reload()
    return [t.removesuffix("/text_summary") for t in acc.Tags()["tensors"]]


def test_a_restarted_job_drops_its_csv_rows_after_the_checkpoint(offline):
    """A restart from step 2's checkpoint into the same run folder: metrics.csv's rows of steps 3-4 that the
    failed try wrote go, as TensorBoard purges them (before: the CSV ran 1, 2, 3, 4, 3, 4, 5)."""
    base = ["log.trackers=[csv]", f"log.dir={offline / 'runs'}", f"checkpoint.dir={offline / 'ckpt'}"]
    assert _sink_run(offline / "run", base, _steps(1, 4), job="j") == []
    with open(offline / "run" / "metrics.csv", "a") as f:
        f.write("5,1.0,4.5")  # a row cut short (a full disk)
    resume = _checkpoint(offline / "ckpt", 2, "j")
    assert _sink_run(offline / "run", base + [f"checkpoint.resume={resume}"], _steps(3, 5, offset=0.5), job="j") == []
    rows = (offline / "run" / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows] == ["step", "1", "2", "3", "4", "5"]
    assert csv_scalars(str(offline / "run" / "metrics.csv"))["train/loss"] == pytest.approx(
        {1: 4.9, 2: 4.8, 3: 5.2, 4: 5.1, 5: 5.0})


def test_a_job_started_again_in_its_run_folder_continues_its_runs(offline):
    """A restart from step 0 (no checkpoint yet) or a requeued batch job writes into the same run folder: the
    same runs, TensorBoard's steps from the first attempt replaced; a parameter name MLflow refuses (any
    character a model.kwargs key may hold) is made one it takes, not the end of the MLflow run."""
    base = ["log.trackers=[tensorboard,mlflow]", f"log.dir={offline / 'runs'}", "model.kwargs.x@y=1"]
    assert _sink_run(offline / "run", base, _steps(1, 3)) == []
    first = identity(offline / "run")
    time.sleep(1.0)  # TensorBoard reads event files in name order (see the test above)
    assert _sink_run(offline / "run", base, _steps(1, 2, offset=0.5)) == []
    assert identity(offline / "run") == first
    board = tensorboard_scalars(first["tensorboard"])
    assert board["train/loss"] == pytest.approx({1: 5.4, 2: 5.3}, rel=1e-6)
    from mlflow.tracking import MlflowClient

    run = MlflowClient(first["mlflow"]["tracking_uri"]).get_run(first["mlflow"]["run_id"])
    assert run.data.params["model.kwargs.x_y"] == "1" and run.info.status == "FAILED"  # no finish event


def test_wandb_online_without_a_key_is_one_warning_not_a_prompt(offline, monkeypatch):
    monkeypatch.setenv("HOME", str(offline))  # no ~/.netrc
    monkeypatch.delenv("WANDB_MODE")
    warnings = _sink_run(offline / "run", ["log.trackers=[wandb]", "log.wandb.mode=online"], _steps(1, 1))
    assert warnings == ["zerorun: warning: log.trackers: wandb could not start, not recorded: RuntimeError: no W&B "
                        "API key on this host (wandb login, or WANDB_API_KEY); or set log.wandb.mode: offline and "
                        "wandb sync the run folder's wandb/ later"]


def test_a_failing_tracker_is_one_warning_and_the_others_go_on(offline):
    (offline / "not-a-folder").write_text("")
    warnings = _sink_run(offline / "run", ["log.trackers=[mlflow,csv]", f"log.dir={offline}",
                                           f"log.mlflow.tracking_uri={offline / 'not-a-folder'}"], _steps(1, 2))
    assert len(warnings) == 1 and warnings[0].startswith(
        "zerorun: warning: log.trackers: mlflow could not start, not recorded: "), warnings
    assert sorted(csv_scalars(str(offline / "run" / "metrics.csv"))["train/loss"]) == [1, 2]


def test_each_tracker_has_its_extra_and_the_test_extra_has_them_all():
    import re
    import tomllib

    from zerorun.recipe.log import PACKAGES

    extras = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]
    names = {k: {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0] for d in v} for k, v in extras.items()}
    for tracker, (_, extra) in PACKAGES.items():
        assert names[extra] and names[extra] <= names["test"], (tracker, names)


def test_bytes_sent_and_to_other_nodes_are_tracker_scalars():
    """A step event's ``comm_bytes`` and ``comm_bytes_inter_node`` (Note [Nodes of a group]) reach every tracker as
    ``comm/bytes`` and ``comm/bytes_inter_node``; a baseline's null is not logged (before: neither was)."""
    from zerorun.telemetry.trackers_spec import scalars

    assert scalars("step", {"comm_bytes": 4096, "comm_bytes_inter_node": 1024, "comm_wait_s": None}) == {
        "comm/bytes": 4096.0, "comm/bytes_inter_node": 1024.0}
    assert scalars("step", {"comm_bytes": 4096, "comm_bytes_inter_node": None}) == {"comm/bytes": 4096.0}
