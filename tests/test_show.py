"""``zerorun show`` and ``--plot``: a run folder read back (telemetry/jobfiles.py ``load_run``, telemetry/plot.py),
fed with hand-made events written as a run writes them: no processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from test_dashboard import T0, step_event, three_rank_events
from zerorun.errors import ZerorunError
from zerorun.telemetry.console import RunRecorder
from zerorun.telemetry.events import Event
from zerorun.telemetry.jobfiles import load_run, write_job_file
from zerorun.telemetry.state import JobState
from zerorun.telemetry.show import find_run


def write_run(tmp_path, events, lines=()) -> str:
    run_dir = str(tmp_path / "runs" / "gpt-stdlib" / "20261130-000000-abcd")
    rec = RunRecorder(run_dir)
    for e in events:
        rec.event(e)
    rec.close()
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.writelines(lines)
    with open(os.path.join(run_dir, "recipe.yaml"), "w") as f:
        f.write("name: gpt-stdlib\nzero: {stage: 2}\nprecision: fp32\ntrain: {steps: 100}\n")
    state = JobState(world_size=3, hosts=["node0x1"], started=T0)
    state.end(T0 + 50)
    write_job_file(run_dir, state, "ok", 0)
    return run_dir


def test_show_reprints_the_summary_from_the_run_directory(tmp_path, capsys):
    from zerorun import cli

    run_dir = write_run(tmp_path, three_rank_events(), lines=['{"v": 1, "event": "step", "rank": 0, "ti\n'])
    state, events = load_run(run_dir)
    assert len(events) == len(three_rank_events())  # the cut-off last line is skipped
    assert (state.name, state.stage, state.steps, state.world_size) == ("gpt-stdlib", 2, 100, 3)
    cli.show(run_dir, plot=None)
    text = capsys.readouterr().out.replace("│", " ")
    assert "zerorun · gpt-stdlib · summary" in text and re.search(r"total time\s+50 s", text)
    assert all(re.search(rf"node{r}\s+{r}\s", text) for r in range(3))


def test_show_of_a_missing_run_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zerorun", "show", str(tmp_path / "nope")], capture_output=True,
                         text=True)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "nope: no such run folder (give runs/<name> or runs/<name>/<timestamp>)" in out.stderr
    # a file given was "no such run folder" (a review); its metrics.jsonl is read as its folder
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    with pytest.raises(ZerorunError, match=r"notes\.txt: a file, not a run folder \(give runs/<name>"):
        find_run(str(notes))
    full = write_run(tmp_path / "full", three_rank_events())
    assert find_run(os.path.join(full, "metrics.jsonl"))[0] == full
    empty = write_run(tmp_path, [])
    with pytest.raises(ZerorunError, match=r"metrics\.jsonl: no telemetry events in it"):
        load_run(empty)


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    from zerorun.telemetry.plot import plot_run

    run_dir = write_run(tmp_path, three_rank_events())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ZerorunError, match=r"--plot needs matplotlib .*: pip install matplotlib"):
        plot_run(*load_run(run_dir), str(tmp_path / "loss.png"))


def test_plot_draws_loss_and_memory(tmp_path):
    pytest.importorskip("matplotlib")
    from zerorun.telemetry.plot import plot_run

    path = tmp_path / "loss.png"
    plot_run(*load_run(write_run(tmp_path, three_rank_events())), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    with pytest.raises(ZerorunError, match="no such folder"):  # found before drawing
        plot_run(*load_run(write_run(tmp_path, three_rank_events())), str(tmp_path / "no" / "dir" / "x.png"))


@pytest.mark.parametrize("name", ["", "noext", "loss.txt"])
def test_plot_path_without_an_image_extension_is_refused_before_writing(tmp_path, name):
    """`--plot DIR` used to write DIR.png and report DIR; `--plot noext` wrote noext.png and then failed."""
    from zerorun.telemetry.plot import check_plot_path

    path = str(tmp_path / name) if name else str(tmp_path)
    with pytest.raises(ZerorunError, match=re.escape(f"--plot {path}: give an image file name ending in .png")):
        check_plot_path(path)
    assert sorted(os.listdir(tmp_path)) == []
    check_plot_path(str(tmp_path / "loss.png"))  # a good name passes
    with pytest.raises(ZerorunError, match="no such folder"):
        check_plot_path(str(tmp_path / "missing" / "loss.png"))


def test_a_restarted_jobs_steps_and_evaluations_are_its_last_tries(tmp_path):
    """A job that failed at step 60 and was restarted from its checkpoint at 40 wrote steps 41-60 twice (Note [Job
    restarts]): the plot's series and the validation losses are the last try's, one point per step, from the
    restart event on (before: the lines went back from 60 to 41, the failed try's evaluation at 60 was the final
    and best validation loss until the new try evaluated, and a rank the new try ran without kept its steps)."""
    from zerorun.telemetry.plot import latest_try

    events = [step_event(r, s) for s in (20, 40, 60) for r in (0, 1)]
    events += [Event("eval", 0, T0 + 29, {"step": 40, "val_loss": 1.5}),
               Event("eval", 0, T0 + 30, {"step": 60, "val_loss": 1.0})]
    events.append(Event("restart", 0, T0 + 31, {"attempt": 1, "max_restarts": 1, "cause": "rank 1 died",
                                                "failed_step": 60, "resume_step": 40}))
    state, _ = load_run(write_run(tmp_path, events))
    assert state.evals == [(40, 1.5)] and state.final_val == 1.5  # before the new try's first evaluation
    assert state.step == 40 and state.eta_s() is None  # the new try starts at 40, its pace not known yet (was 60)
    events += [step_event(0, s, wait=0.5) for s in (41, 60, 80)]  # the new try runs on rank 0 only
    events.append(Event("eval", 0, T0 + 40, {"step": 60, "val_loss": 2.0}))
    series = latest_try(events)
    assert [e.data["step"] for e in series[0]] == [20, 40, 41, 60, 80]
    assert [e.data["comm_wait_s"] for e in series[0]][2:] == [0.5 * 20] * 3  # the second try's events
    assert [e.data["step"] for e in series[1]] == [20, 40]
    state, _ = load_run(write_run(tmp_path, events))
    assert state.evals == [(40, 1.5), (60, 2.0)] and state.best_val == 1.5
    script = events + [Event("restart", 0, T0 + 50, {"attempt": 2, "max_restarts": 2, "cause": "x",
                                                     "failed_step": 80, "resume_step": None})]
    # a user's script resumes from checkpoints of its own: its restart names no step and drops nothing (before:
    # taken as step 0, every step and evaluation of the first tries went)
    assert [e.data["step"] for e in latest_try(script)[0]] == [20, 40, 41, 60, 80]
    assert load_run(write_run(tmp_path, script))[0].evals == [(40, 1.5), (60, 2.0)]
    again = events + [step_event(0, 60, wait=0.7)]  # a --resume into the same folder: no restart event
    assert [e.data["comm_wait_s"] for e in latest_try(again)[0]][-1] == 0.7 * 20


def test_show_gives_each_rank_the_status_the_live_view_gave(tmp_path):
    """A rank that exited with code 3 showed ``exit 3`` live but ``stopped`` in ``zerorun show``: the exits
    torchrun reported were not kept (a review). job.json keeps them, and show applies them as the live view."""
    run_dir = write_run(tmp_path, three_rank_events())
    state = JobState(world_size=3, hosts=["node0x1"], started=T0)
    state.rank_exited(2, 3)
    state.rank_exited(1, -9)
    state.end(T0 + 50)
    write_job_file(run_dir, state, "failed", 1, "rank process ended (exit code 3)", 2, "node2")
    shown, _ = load_run(run_dir)
    assert {r: s.status for r, s in shown.ranks.items()} == {0: "stopped", 1: "killed", 2: "exit 3"}


def test_a_resumed_or_restarted_job_says_so(tmp_path, capsys):
    """A review: a run resumed from step 16 showed 'steps 40/40' with nothing saying 24 were trained by it, a
    restarted one no restart, and the done line of a resumed job evaluated once read 'validation loss 4.7302 ->
    4.7302', a 'from' value never taken."""
    from types import SimpleNamespace

    from zerorun.launch.outcome import Outcome
    from zerorun.launch.run import _finish
    from zerorun.telemetry.summary import summary

    events = [Event("log", r, T0 + 1, {"message": "resumed from ckpt/step-00000016 after step 16",
                                       "resumed_step": 16}) for r in (0, 1, 2)]
    events += [step_event(r, s) for s in (20, 40) for r in (0, 1, 2)]
    events += [Event("restart", 0, T0 + 20, {"attempt": 1, "max_restarts": 1, "cause": "x", "failed_step": 40,
                                             "resume_step": 20}),
               Event("log", 0, T0 + 21, {"message": "resumed from ckpt/step-00000020 after step 20",
                                         "resumed_step": 20}),
               step_event(0, 40), Event("eval", 0, T0 + 30, {"step": 40, "val_loss": 4.7302})]
    run_dir = write_run(tmp_path, events)
    state, _ = load_run(run_dir)
    assert (state.resumed_step, state.restarts) == (16, 1)  # the job's own start, not the restart's
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(summary(state))
    text = console.export_text()
    assert re.search(r"resumed from\s+step 16 \(24 steps trained by this job\)", text), text
    assert re.search(r"restarts\s+1 \(after a failure; from the last checkpoint\)", text), text
    lines = []
    _finish(Outcome("ok", 0), state, run_dir, SimpleNamespace(print=lines.append))
    assert "; validation loss 4.7302 at step 40; metrics:" in lines[0], lines
    fresh, _ = load_run(write_run(tmp_path / "fresh", three_rank_events()))
    assert (fresh.resumed_step, fresh.restarts) == (None, 0)
    # a SLURM requeue resumes into the same run folder with no restart event: still the job's own start (a review)
    requeued = events[:9] + [Event("log", 0, T0 + 22, {"message": "resumed", "resumed_step": 40})]
    assert load_run(write_run(tmp_path / "requeued", requeued))[0].resumed_step == 16
