"""A run folder that cannot be written (a full disk under ``log.dir``): one line naming the field and the file, the
job stopped, exit code 2, the lines written before kept whole (Note [Run folder write failure] in
zerorun/telemetry/console.py)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import uuid

import psutil
import pytest

from zerorun import runfolder
from zerorun.errors import ZerorunError
from zerorun.launch.outcome import Outcome
from zerorun.launch import run as launch_run
from zerorun.telemetry import console
from zerorun.telemetry.events import Event
from zerorun.telemetry.state import JobState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _event(step: int) -> Event:
    return Event("step", 0, 1.0, {"step": step, "loss": 2.5})


def _full_after(monkeypatch, room: int) -> None:
    """``os.write`` as on a device with ``room`` bytes left: it writes what fits, then fails with ENOSPC."""
    real, left = os.write, [room]

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real(fd, bytes(data[:left[0]]))
        left[0] -= n
        return n

    monkeypatch.setattr(console.os, "write", write)


@pytest.mark.parametrize("source", ["log.dir", "--run-dir"])
@pytest.mark.parametrize("name", [runfolder.METRICS, runfolder.OUTPUT])
def test_a_full_disk_keeps_whole_lines_and_names_the_file(tmp_path, monkeypatch, name, source):
    rec = console.RunRecorder(str(tmp_path), source=source)
    write = (lambda i: rec.event(_event(i))) if name == runfolder.METRICS else (lambda i: rec.line(0, f"line {i}"))
    for i in range(3):
        write(i)
    before = (tmp_path / name).read_bytes()
    assert rec.failed is None and before.count(b"\n") == 3
    _full_after(monkeypatch, 10)  # the next line is cut after 10 bytes
    write(3)
    assert rec.failed == f"{source}: cannot write {tmp_path / name}: No space left on device"
    monkeypatch.undo()
    write(4)  # room again: nothing more is written after the failure, so no line is missing in the middle
    rec.line(1, "other")
    rec.event(_event(5))
    rec.close()
    assert (tmp_path / name).read_bytes() == before
    if name == runfolder.METRICS:
        assert [json.loads(line)["step"] for line in before.decode().splitlines()] == [0, 1, 2]


def test_a_run_folder_that_cannot_be_opened_is_one_line(tmp_path):
    (tmp_path / "run").write_text("a file, not a folder")
    with pytest.raises(ZerorunError) as e:
        console.RunRecorder(str(tmp_path / "run"))
    assert str(e.value) == f"log.dir: cannot write {tmp_path / 'run' / runfolder.METRICS}: File exists"


def _job_of(proc) -> str | None:
    try:
        return proc.environ().get("ZERORUN_JOB_ID")
    except (psutil.Error, OSError):
        return None


def _no_room(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_job_file_that_cannot_be_written_fails_a_good_job(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(json, "dump", _no_room)
    result = launch_run._record_end(str(tmp_path), JobState(), Outcome("ok", 0), "log.dir")
    assert (result.status, result.exit_code) == ("failed", 2)
    assert result.message == f"log.dir: cannot write {tmp_path / runfolder.JOB}: No space left on device"
    assert os.listdir(tmp_path) == []  # no half-written job.json.tmp
    failed = launch_run._record_end(str(tmp_path), JobState(), Outcome("failed", 1, 0, "h", "rank crashed"), "log.dir")
    assert failed.message == "rank crashed"  # the job's own line stays; the job file's problem is a warning
    assert capsys.readouterr().err == (f"zerorun: warning: log.dir: cannot write {tmp_path / runfolder.JOB}: "
                                       "No space left on device\n")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root")
def test_a_full_log_dir_stops_the_job_with_one_line(tmp_path):
    fs = f"/tmp/zerorun-full-{uuid.uuid4().hex[:8]}"
    os.makedirs(fs)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60k", "tmpfs", fs], capture_output=True).returncode:
        os.rmdir(fs)
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = subprocess.run([sys.executable, "-m", "zerorun", "train", "recipes/tiny.yaml", "--no-dashboard",
                              f"log.dir={fs}", "log.every=1", "train.steps=300"], cwd=ROOT, capture_output=True,
                             text=True, timeout=240)
        [run_dir] = [os.path.join(fs, "tiny", d) for d in os.listdir(os.path.join(fs, "tiny"))]
        metrics = os.path.join(run_dir, runfolder.METRICS)
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stderr.splitlines() == [f"zerorun: error: log.dir: cannot write {metrics}: No space left on device"]
        with open(metrics, encoding="utf-8") as f:
            events = [json.loads(line) for line in f]  # every line whole
        assert {"start", "step"} <= {e["event"] for e in events}
        assert "Traceback" not in out.stdout + out.stderr
        job = re.search(r"job ([0-9a-f]{12})", out.stdout).group(1)
        assert not [p for p in psutil.process_iter() if _job_of(p) == job]  # the ranks were stopped
    finally:
        subprocess.run(["umount", fs], check=False)
        os.rmdir(fs)


def test_a_run_folder_that_cannot_be_made_is_not_left_half_written(tmp_path, monkeypatch):
    """A disk that fills while the run folder's first files are written: the one line as before, and no folder
    holding a 0-byte recipe.yaml left behind (a review found one)."""
    from types import SimpleNamespace

    from zerorun.launch import record

    def write(run_dir, *args):
        os.makedirs(run_dir)
        open(os.path.join(run_dir, "recipe.yaml"), "w").close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(record, "write", write)
    prepared = SimpleNamespace(plan=SimpleNamespace(job_id="abcd1234"), close=lambda: None, workdir=".",
                               user_env={}, srun=None)
    recipe = SimpleNamespace(name="tiny", log=SimpleNamespace(dir=str(tmp_path)))
    with pytest.raises(ZerorunError, match=r"^log\.dir: cannot create the run directory .*: No space left on device$"):
        launch_run._make_run_dir(prepared, None, recipe, None, None)
    assert list((tmp_path / "tiny").iterdir()) == []


def test_a_run_folder_removed_while_the_job_runs_is_a_warning_not_a_failure(tmp_path, capsys):
    """``rm -rf`` of the run folder during a job that then succeeds: it ended with "log.dir: cannot write
    .../job.json", exit code 2 (bad input), and no word when the folder went (a review). Now a warning at the
    next step event, once, and a warning at the end; the job's result stays its own (Note [Run folder removed])."""
    run_dir = tmp_path / "run"
    rec = console.RunRecorder(str(run_dir))
    rec.event(Event("step", 0, 1.0, {"step": 1}))
    assert rec.removed is None and capsys.readouterr().err == ""
    shutil.rmtree(run_dir)
    for step in (2, 3):
        rec.event(Event("step", 0, 1.0, {"step": step}))
    rec.close()
    assert rec.removed == str(run_dir) and rec.failed is None
    assert capsys.readouterr().err == (f"zerorun: warning: log.dir: {run_dir} was removed while the job runs: its "
                                       "record (metrics.jsonl, output.log, job.json) is lost from here; the job "
                                       "goes on\n")
    result = launch_run._record_end(str(run_dir), JobState(), Outcome("ok", 0), "log.dir")
    assert (result.status, result.exit_code) == ("ok", 0)
    assert capsys.readouterr().err == (f"zerorun: warning: log.dir: cannot write {run_dir / runfolder.JOB}: No "
                                       "such file or directory (the run folder was removed while the job ran)\n")


def test_the_done_line_does_not_point_into_a_removed_run_folder(tmp_path, capsys):
    """The last line named the removed folder's metrics.jsonl (a review of the change above)."""
    from zerorun.telemetry.console import PlainView

    view = PlainView(sys.stdout, JobState(world_size=1, started=0.0))
    view.state.end(1.0)
    launch_run._finish(Outcome("ok", 0), view.state, str(tmp_path / "gone"), view)
    assert capsys.readouterr().out.strip().endswith(f"no metrics: {tmp_path / 'gone'} was removed")
