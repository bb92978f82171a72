"""Issue 18: the live dashboard and the summary at 80-160 columns (no number cut to '…'), the job's step
and ETA between step events, torchrun's stop traceback as one log line, the state module free of views, and
`zerorun show` on a recipe folder and on failed jobs. In-process, hand-made events: no ranks."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time

import pytest
from rich.console import Console

from zerorun.telemetry.console import PlainView, RunRecorder
from zerorun.telemetry.dashboard import LiveView, render
from zerorun.telemetry.events import Event
from zerorun.telemetry.format import log_lines, short_bytes
from zerorun.telemetry.jobfiles import write_job_file
from zerorun.telemetry.state import JobState
from zerorun.telemetry.summary import summary

GiB, MiB = 1024 ** 3, 1024 ** 2
T0 = 1_800_000_000.0
HOSTS = ["gpu-node-017.cluster-east.internal.example.com", "gpu-node-018.cluster-east.internal.example.com"]
NUMBER = re.compile(r"\d[\d,.:]*")


def big_state(cuda: bool = True) -> JobState:
    """16 ranks on two hosts with long names, seven-digit steps, GiB memory, CUDA: a large job's picture."""
    state = JobState(name="llama-7b-pretrain", stage=3, precision="bf16", world_size=16,
                     hosts=[f"{h}x8" for h in HOSTS], steps=2_500_000, started=T0,
                     rank_hosts={r: HOSTS[r // 8] for r in range(16)})
    for r in range(16):
        state.update(Event("start", r, T0 + 1, {"host": HOSTS[r // 8], "pid": 123456 + r, "torch": "2.13"}))
        state.update(Event("model_ready", r, T0 + 2, {"params": 6_738_415_616, "stage": 3, "model_state_bytes": {
            "params": 842 * MiB + r, "grads": 842 * MiB, "optimizer": 5052 * MiB}}))
    for step, t in ((1, T0 + 100), (1_234_560, T0 + 500_100)):
        for r in range(16):
            cu = {"cuda_allocated_bytes": 51 * GiB + r * MiB, "cuda_reserved_bytes": 60 * GiB,
                  "cuda_peak_bytes": 77 * GiB, "cuda_total_bytes": 80 * GiB} if cuda else {}
            state.update(Event("step", r, t, {
                "step": step, "steps": 2_500_000, "loss": 12.3456 - r / 1000, "step_time_s": 0.4051,
                "samples_per_s": 1_234_567.0, "tokens_per_s": 98_765_432.0, "tflops": 412.5,
                "rss_bytes": 123 * GiB + r * GiB, "peak_rss_bytes": 187 * GiB, "host_mem_bytes": 2048 * GiB,
                "host_mem_used_bytes": 1900 * GiB if r == 11 else 900 * GiB, "comm_wait_s": 0.0 if r == 5 else 0.2,
                "interval_steps": 1, "interval_s": 0.4051, "telemetry_s": 0.0012, **cu}))
    state.update(Event("eval", 0, T0 + 500_200, {"step": 1_234_560, "val_loss": 10.9876}))
    state.update(Event("checkpoint", 0, T0 + 500_300, {"step": 1_234_560, "seconds": 312.5, "bytes": 1234 * GiB,
                                                       "path": "/scratch/ckpt/llama-7b/step-01234560"}))
    return state


def text_of(renderable, width: int) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize("width", [80, 100, 120, 160])
@pytest.mark.parametrize("view", ["dashboard", "summary"])
def test_views_fit_the_width_and_never_cut_a_number(width, view):
    """At 80 and 120 columns every column used to be cut to '…' (the summary needed ~127 columns)."""
    state = big_state()
    state.ended = T0 + 500_400  # the elapsed time, without ending the ranks
    make = (lambda w: render(state, now=T0 + 500_400, width=w)) if view == "dashboard" else \
        (lambda w: summary(state, w))
    text, wide = text_of(make(width), width), text_of(make(400), 400)
    assert "…" not in text, text
    assert max(map(len, text.splitlines())) <= width
    alt = [short_bytes(v) for r in state.ranks.values()  # the narrower forms of columns (layout.Column.alt)
           for v in (r.model_state_total, r.rss_bytes, r.cuda.get("cuda_reserved_bytes"))]
    whole = set(NUMBER.findall(wide + " ".join(alt)))
    cut = [n for n in NUMBER.findall(text) if n not in whole and n.rstrip(".,:") not in whole]
    assert not cut, (cut, text)
    rows = {r: [line for line in text.splitlines() if re.match(rf"\s*{r}\s+", line)] for r in range(16)}
    for r in range(16):  # every rank, with its step, loss and status, whole
        assert len(rows[r]) == 1, text
        if view == "dashboard":
            assert re.match(rf"\s*{r}\s+1234560\s+{12.3456 - r / 1000:.4f}\s", rows[r][0]), rows[r][0]
        else:
            assert re.match(rf"\s*{r}\s+training\s+1234560\s", rows[r][0]), rows[r][0]
    assert all(h in text for h in HOSTS)  # as a column or as a heading over its ranks
    if view == "dashboard":
        assert "step 1234560/2500000" in text and "memory 93%" in text and "straggler" in text
        assert "job 19.75M samples/s · 1.58G tokens/s · 6600 TFLOP/s" in text.replace("│", " ")
        assert "loss 12.3456" in text and "ranks 0-7" in text
    else:
        assert re.search(r"steps\s+1234560/2500000", text) and "187 GiB" in text


@pytest.mark.parametrize("width,height", [(80, 24), (100, 40), (160, 50)])
def test_live_view_fits_the_terminal_height(width, height):
    text = text_of(render(big_state(), now=T0 + 500_400, width=width, height=height), width)
    assert len(text.splitlines()) <= height and "…" not in text
    assert "straggler" in text and "memory 93%" in text
    assert ("more ranks not shown" in text) == (height == 24)  # 16 ranks fit 40 lines


def test_rows_stack_when_even_the_kept_columns_do_not_fit():
    text = text_of(summary(big_state(), 20), 20)
    assert "…" not in text and "rank 7" in text and "steps 1234560" in text and "1234560/2500000" in text


def test_step_and_eta_move_between_step_events():
    """Step events come every log.every steps; rank 0's progress events in between move the step count, and
    the ETA counts down between events instead of up (it used to grow with the time since the last event)."""
    state = JobState(world_size=2, steps=1000, started=T0)
    for r in range(2):
        state.update(Event("step", r, T0 + 10, {"step": 1, "steps": 1000, "loss": 3.0}))
    for step in range(2, 38):
        state.update(Event("progress", 0, T0 + 10 + (step - 1) * 0.5, {"step": step, "steps": 1000}))
    assert state.step == 37 and "step 37/1000" in text_of(render(state, now=T0 + 28.1, width=100), 100)
    etas = [state.eta_s(now=T0 + 28 + dt) for dt in (0.0, 1.0, 5.0, 1000.0)]
    assert etas[0] == pytest.approx(0.5 * 963) and etas == sorted(etas, reverse=True) and etas[-1] == 0.0
    out = io.StringIO()
    view = PlainView(out, JobState(world_size=2, steps=1000, started=T0), quiet_s=3600.0)
    now = time.time()
    view.event(Event("progress", 0, now - 1, {"step": 1, "steps": 1000}))  # within quiet_s of the start
    view._last_print -= 3600.0  # an hour without a line: the next progress event prints one
    view.event(Event("progress", 0, now, {"step": 3, "steps": 1000}))
    view.event(Event("progress", 0, now + 1, {"step": 5, "steps": 1000}))
    assert out.getvalue().splitlines() == ["step 3/1000  eta 498 s"]  # 0.5 s/step x 997


def test_rank_0_sends_a_progress_event_per_step_at_most_ten_a_second():

    from zerorun.telemetry.events import parse_line
    from zerorun.telemetry.steplog import PROGRESS_EVERY_S, StepLog

    out, other = io.StringIO(), io.StringIO()
    log, log1 = StepLog(0, 2, None, stream=out), StepLog(1, 2, None, stream=other)
    for step in range(1, 1001):
        log.progress(step, 1000)
        log1.progress(step, 1000)
        if step == 500:
            time.sleep(PROGRESS_EVERY_S)
    sent = [parse_line(line) for line in out.getvalue().splitlines()]
    steps = [e.data["step"] for e in sent]
    assert all(e.kind == "progress" and e.rank == 0 and e.data["steps"] == 1000 for e in sent)
    assert steps[0] == 1 and 501 in steps and steps[-1] == 1000 and len(steps) < 20
    assert other.getvalue() == "" and log.telemetry_s > 0


def test_recorder_leaves_progress_events_out_of_metrics(tmp_path):
    rec = RunRecorder(str(tmp_path))
    rec.event(Event("progress", 0, T0, {"step": 3, "steps": 10}))
    rec.event(Event("eval", 0, T0, {"step": 3, "val_loss": 1.0}))
    rec.close()
    assert [json.loads(line)["event"] for line in open(tmp_path / "metrics.jsonl")] == ["eval"]


TORCHRUN_STOPPED = """\
W1130 19:48:23.497000 9750 site-packages/torch/distributed/elastic/agent/server/api.py:753] Received 2 death signal, shutting down workers
W1130 19:48:23.497000 9750 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 9753 closing signal SIGTERM
W1130 19:48:23.497000 9750 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 9754 closing signal SIGTERM
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/usr/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run
    elastic_launch(
  File "/usr/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py", line 923, in _invoke_run
    time.sleep(monitor_interval)
  File "/usr/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 9750 got signal: 2""".splitlines()


def test_interrupted_job_is_one_log_line_not_torchruns_traceback():
    state = JobState(world_size=4, started=T0)
    state.add_line(0, "[rank 0] training on")
    for a, b in zip(TORCHRUN_STOPPED, TORCHRUN_STOPPED[3:] + [""] * 3):  # two nodes, their lines interleaved
        state.add_line(0, a)
        if b:
            state.add_line(1, b.replace("9750", "9860"))
    state.end(T0 + 5)
    shown = log_lines(state.log)
    assert shown == ["[rank 0] training on", "[node 0] job interrupted: torchrun got SIGINT and stops every rank "
                     "(full output: the run folder's output.log)"], shown
    out = io.StringIO()
    view = PlainView(out, JobState(world_size=2, started=T0))
    for line in TORCHRUN_STOPPED[3:]:  # a traceback alone (torchrun stopped by the launcher's SIGTERM)
        view.line(0, line.replace("signal: 2", "signal: 15"))
    assert out.getvalue().splitlines() == ["[node 0] job interrupted: torchrun got SIGTERM and stops every rank "
                                           "(full output: the run folder's output.log)"]


def test_other_tracebacks_and_rank_ctrl_c_stay_readable():
    state = JobState(world_size=2, started=T0)
    boom = ["[rank 1] Traceback (most recent call last):", '[rank 1]   File "train.py", line 3, in <module>',
            "[rank 1] ValueError: bad batch"]
    for line in boom:
        state.add_line(0, line)
    state.update(Event("error", 0, T0, {"type": "KeyboardInterrupt", "message": "", "traceback": "T\n  F\nK"}))
    assert log_lines(state.log) == boom + ["[rank 0] interrupted (Ctrl-C)"]
    cut = JobState(world_size=1, started=T0)
    cut.add_line(0, "Traceback (most recent call last):")  # the node ended inside a traceback: kept at the end
    cut.end(T0)
    assert log_lines(cut.log) == ["[node 0] Traceback (most recent call last):"]


def test_live_view_log_panel_after_ctrl_c():
    console = Console(file=io.StringIO(), force_terminal=True, width=100, record=True)
    view = LiveView(JobState(name="j", world_size=2, steps=10, started=T0), console, refresh_per_second=50)
    for line in TORCHRUN_STOPPED:
        view.line(0, line)
    view.live.refresh()
    view.close()
    text = console.export_text()
    assert "job interrupted: torchrun got SIGINT" in text and "Traceback" not in text and "Signal" not in text


def test_state_module_imports_no_view():
    code = ("import sys, zerorun.telemetry.state; "
            "print(sorted(m for m in sys.modules if m == 'rich' or m.startswith('rich.') or m in "
            "('zerorun.telemetry.dashboard', 'zerorun.telemetry.console', 'zerorun.telemetry.summary', "
            "'zerorun.telemetry.format', 'zerorun.telemetry.layout')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    root = os.path.join(os.path.dirname(__file__), "..", "zerorun", "telemetry")
    assert all(sum(1 for _ in open(os.path.join(root, f))) <= 400 for f in os.listdir(root) if f.endswith(".py"))


def write_run(folder, name: str, status: str | None = "ok", rank=None, host=None, message="",
              events=None) -> str:
    run_dir = str(folder / name)
    rec = RunRecorder(run_dir)
    if events is None:
        events = [Event("start", r, T0, {"host": "node1"}) for r in range(2)]
        events += [Event("step", r, T0 + 1, {"step": 5, "steps": 10, "loss": 2.0}) for r in range(2)]
    for e in events:
        rec.event(e)
    rec.close()
    if status is not None:
        state = JobState(world_size=2, started=T0)
        state.end(T0 + 9)
        write_job_file(run_dir, state, status, {"ok": 0, "interrupted": 130}.get(status, 1), message, rank, host)
    return run_dir


def show(path) -> str:
    out = subprocess.run([sys.executable, "-m", "zerorun", "show", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_show_takes_the_latest_run_of_a_recipe_folder_and_says_how_it_ended(tmp_path):
    from zerorun.telemetry.show import find_run, outcome

    recipe = tmp_path / "runs" / "tiny"
    write_run(recipe, "20261130-101500-aaaa")
    latest = write_run(recipe, "20261130-121500-bbbb", "failed", 1, "node1", "RuntimeError: boom (at m.py:3 in f)")
    os.makedirs(recipe / "bench-20261130-130000-cccc")  # bench folders hold no run
    assert find_run(str(recipe)) == (latest, 2) and find_run(latest) == (latest, 1)
    text = show(recipe)
    assert text.startswith(f"zerorun: the latest of 2 runs in {recipe}: {latest}\n")
    assert text.rstrip().endswith("zerorun: the job FAILED (exit status 1): rank 1 on node1: RuntimeError: boom "
                                  "(at m.py:3 in f)")
    ok = write_run(tmp_path, "ok")
    assert outcome(ok) == "the job finished (exit status 0)" and "job finished" in show(ok)
    stopped = write_run(tmp_path, "stopped", "interrupted", message="stopped by SIGINT: every rank was terminated")
    assert outcome(stopped) == ("the job was interrupted (exit status 130): stopped by SIGINT: every rank was "
                                "terminated")
    assert "did not record how it ended" in outcome(write_run(tmp_path, "killed", None))
    for i, text in enumerate(["{bad", "[]"]):  # a review: said "no job.json: the launcher was killed"
        broken = write_run(tmp_path, f"broken{i}", "ok")
        with open(os.path.join(broken, "job.json"), "w") as f:
            f.write(text)
        assert outcome(broken) == (f"the job's record of how it ended cannot be read ({broken}/job.json: not the "
                                   "JSON object zerorun writes)")


def test_show_names_the_failed_rank_from_the_events_when_job_json_does_not(tmp_path):
    from zerorun.telemetry.show import outcome
    from zerorun.telemetry.jobfiles import load_run

    events = [Event("start", r, T0, {"host": "node1"}) for r in range(2)]
    events.append(Event("error", 1, T0 + 1, {"type": "RuntimeError", "message": "boom", "user_error": False}))
    run_dir = write_run(tmp_path, "old", "failed", message="RuntimeError: boom", events=events)
    assert outcome(run_dir, load_run(run_dir)[0]) == ("the job FAILED (exit status 1): rank 1 on node1 (error): "
                                                      "RuntimeError: boom")
    empty = write_run(tmp_path, "empty", "failed", message="node 0 ended (exit code 1)", events=[])
    out = subprocess.run([sys.executable, "-m", "zerorun", "show", empty], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "no telemetry events in it" in out.stderr and "the job FAILED (exit status 1)" in out.stderr


def test_output_width_of_a_pipe_is_columns_when_set(monkeypatch):
    """The summary and the estimate written to a file or pipe: ``$COLUMNS`` when it is a positive whole number
    (rich reads it for a terminal only), else the view's plain width."""
    import io

    from zerorun.telemetry.layout import output_width

    for columns, expected in (("200", 200), (" 90 ", 90), ("0", 160), ("wide", 160), ("-5", 160), ("", 160),
                              ("²", 160), ("٣", 160)):  # digits int() refuses, or reads as another script's
        monkeypatch.setenv("COLUMNS", columns)
        assert output_width(io.StringIO(), 160) == expected, columns
    monkeypatch.delenv("COLUMNS")
    assert output_width(io.StringIO(), 160) == 160
