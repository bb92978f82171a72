"""The launcher's views of a job (telemetry/state.py, dashboard.py, console.PlainView), fed with hand-made events:
no processes (``zerorun show`` and ``--plot``: tests/test_show.py)."""

from __future__ import annotations

import io
import queue
import re
import sys
import time

import pytest
from rich.console import Console

from zerorun.recipe.hostfile import Host
from zerorun.launch.plan import build_plan
from zerorun.launch.nodes import Line
from zerorun.launch.supervisor import Supervisor
from zerorun.telemetry.console import PlainView
from zerorun.telemetry.dashboard import LiveView, open_view, render
from zerorun.telemetry.events import Event, format_event
from zerorun.telemetry.format import log_lines
from zerorun.telemetry.probes import flops_per_token
from zerorun.telemetry.state import JobState
from zerorun.telemetry.summary import summary

GiB, MiB = 1024 ** 3, 1024 ** 2
T0 = 1_800_000_000.0


def step_event(rank: int, step: int, *, step_time=0.150, wait=0.060, every=20, rss=400 * MiB, host_used=8 * GiB,
               **extra) -> Event:
    n = 1 if step == 1 else every
    return Event("step", rank, T0 + 10 + step * step_time, {
        "step": step, "steps": 100, "loss": 3.0 - step / 100, "lr": 1e-3, "grad_norm": 1.0,
        "step_time_s": step_time, "samples_per_s": 8 / step_time, "tokens_per_s": 1024 / step_time,
        "job_samples_per_s": 24 / step_time, "job_tokens_per_s": 3072 / step_time, "tflops": 0.02,
        "rss_bytes": rss, "peak_rss_bytes": rss + 50 * MiB, "host_mem_bytes": 16 * GiB,
        "host_mem_used_bytes": host_used,
        "model_state_bytes": {"params": 4 * MiB, "grads": 2 * MiB, "optimizer": 4 * MiB},
        "comm_bytes": 1000, "comm_wait_s": wait * n, "interval_steps": n, "interval_s": step_time * n,
        "telemetry_s": 0.001, **extra})


def three_rank_events() -> list[Event]:
    """Rank 2 computes longest (its peers wait for it: it waits least); rank 1's host is 94% full."""
    events = []
    for r in range(3):
        events.append(Event("start", r, T0 + 1, {"host": f"node{r}", "pid": 100 + r, "torch": "2.13",
                                                 "device": "cpu", "host_mem_bytes": 16 * GiB}))
        events.append(Event("model_ready", r, T0 + 2, {"params": 842_496, "stage": 2}))
    for step in (1, 20, 40):
        for r in range(3):
            events.append(step_event(r, step, wait=0.005 if r == 2 else 0.060,
                                     host_used=15 * GiB if r == 1 else 8 * GiB))
    events.append(Event("eval", 0, T0 + 20, {"step": 40, "val_loss": 2.5}))
    events.append(Event("checkpoint", 0, T0 + 21, {"step": 40, "path": "runs/x/ckpt/step-40", "seconds": 1.5,
                                                   "bytes": 30 * MiB}))
    return events


def make_state(**kw) -> JobState:
    state = JobState(name="gpt-stdlib", stage=2, precision="fp32", world_size=3,
                     hosts=["node0x1", "node1x1", "node2x1"], steps=100, started=T0, **kw)
    for e in three_rank_events():
        state.update(e)
    return state


def rendered(renderable, width=150) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text().replace("│", " ")


def test_header_counts_one_rank_in_the_singular():
    state = JobState(name="tiny", stage=2, precision="fp32", world_size=1, hosts=["localhostx1"], steps=3, started=T0)
    assert "ZeRO stage 2 · fp32 · 1 rank on localhostx1" in rendered(render(state, now=T0 + 1, width=150))


def row_of(text: str, rank: int) -> str:
    [row] = [line for line in text.splitlines() if re.match(rf"\s*node{rank}\s+{rank}\s", line)]
    return row


def test_dashboard_shows_every_rank_marks_straggler_and_memory_with_units():
    text = rendered(render(make_state(), now=T0 + 25, width=150))
    for r in range(3):
        assert re.search(rf"node{r}\s+{r}\s+40\s+2\.6000\s+53\.3/s\s+150 ms", row_of(text, r)), text
    assert "straggler" in row_of(text, 2) and "straggler" not in row_of(text, 0) + row_of(text, 1)
    assert "memory 94%" in row_of(text, 1) and "memory" not in row_of(text, 0) + row_of(text, 2)
    assert "40%" in row_of(text, 0) and "3%" in row_of(text, 2)  # comm wait: 0.06 s of each 0.15 s step
    assert "400 MiB / 450 MiB" in row_of(text, 0) and "10.0 MiB" in row_of(text, 0)  # RSS now/peak, model states
    assert "ZeRO stage 2 · fp32 · 3 ranks on node0x1, node1x1, node2x1" in text
    assert re.search(r"step 40/100 .* 40% elapsed 25 s\s+ETA ", text)
    assert "job 160.0 samples/s · 20.5k tokens/s · 60 GFLOP/s" in text
    assert "val 2.5000 (best 2.5000)" in text and "checkpoint step 40" in text
    assert "[rank 0] checkpoint step 40: runs/x/ckpt/step-40 (30.0 MiB, 1.5 s)" in text  # log panel


def test_many_ranks_fit_the_terminal_marked_ones_first():
    state = JobState(name="big", world_size=40, steps=100, started=T0)
    for r in range(40):
        state.update(step_event(r, 40, wait=0.005 if r == 35 else 0.060, host_used=15 * GiB if r == 20 else 8 * GiB))
    text = rendered(render(state, now=T0 + 25, height=30))
    shown = [r for r in range(40) if re.search(rf"\s{r}\s+40\s+2\.6000", text)]
    assert len(text.splitlines()) <= 29  # the header, the log panel, and as many ranks as the rest holds
    assert shown == [*range(len(shown) - 2), 20, 35] and len(shown) >= 12, text
    assert f"{40 - len(shown)} more ranks not shown" in text
    assert re.search(r"\s20\s+40\s.*memory 94%", text) and re.search(r"\s35\s+40\s.*straggler", text)


def test_no_straggler_when_ranks_compute_alike():
    state = JobState(world_size=2, started=T0)
    for r in range(2):
        state.update(step_event(r, 20, step_time=0.150 + 0.005 * r))
    assert state.straggler() is None and state.memory_alerts() == set()


def test_comm_wait_is_a_fraction_of_the_logged_interval_not_of_one_step():
    state = JobState(world_size=1, started=T0)
    state.update(step_event(0, 20, step_time=0.150, wait=0.030, every=20))  # 0.6 s waited over 20 steps (3 s)
    assert state.ranks[0].comm_wait == pytest.approx(0.2)


def test_device_memory_column_when_ranks_report_cuda():
    state = make_state()
    state.update(step_event(0, 60, cuda_allocated_bytes=3 * GiB, cuda_reserved_bytes=4 * GiB,
                            cuda_peak_bytes=5 * GiB, cuda_total_bytes=4 * GiB + 100 * MiB))
    text = rendered(render(state, now=T0 + 30))
    assert "device mem" in text and "3.00 GiB / 4.00 GiB" in row_of(text, 0)
    assert "memory 98%" in row_of(text, 0)  # reserved / device total
    assert "5.00 GiB" in rendered(summary(state))  # peak device memory


def test_events_with_unexpected_fields_never_break_the_views():
    state = make_state()
    odd = [Event("step", 0, T0, {"step": "x", "loss": "nan?"}), Event("step", 1, T0, {"step": 41, "loss": None}),
           Event("model_ready", 2, T0, {"params": "many", "model_state_bytes": [1]}),
           Event("checkpoint", 0, T0, {}), Event("error", 2, T0, {"traceback": 7}), Event("start", 5, T0, {})]
    for e in odd:
        state.update(e)
    text = rendered(render(state, now=T0 + 30)) + rendered(summary(state))
    assert "[rank 2] error: Error:" in text and re.search(r"\?\s+5\s+0\s", text)
    out = io.StringIO()
    view = PlainView(out, make_state())
    for e in odd:
        view.event(e)
    view.close()


def test_malformed_event_lines_reach_the_view_as_log_lines():
    """Through the supervisor's routing: a truncated event line is a log line of its rank, not a crash."""
    plan = build_plan([Host("localhost", 2)], "{}", "job", 12345)
    out = io.StringIO()
    view = PlainView(out, JobState(world_size=2, started=T0))
    q: queue.Queue = queue.Queue()
    sup = Supervisor(plan, [], q, view.event, view.line)
    good = format_event("eval", 0, step=5, val_loss=2.25)
    for line in ["[rank 1] " + good[:-7], "[rank 0] " + good, "[rank 1] plain print", "torchrun says hi"]:
        q.put(Line(0, line))
    while not q.empty():
        sup._drain(0.01)
    assert log_lines(view.state.log) == ["[rank 1] " + good[:-7], "eval step 5: validation loss 2.2500",
                                    "[rank 1] plain print", "[node 0] torchrun says hi"]
    assert view.state.evals == [(5, 2.25)]
    assert "[rank 1] plain print" in out.getvalue() and "validation loss 2.2500" in out.getvalue()


def test_plain_view_when_not_a_terminal_is_periodic_lines_and_a_summary():
    out = io.StringIO()
    view = open_view(JobState(name="tiny", world_size=3, steps=100, started=T0), out, dashboard=True)
    assert isinstance(view, PlainView)
    view.min_interval_s = 3600.0  # only the first and the last step
    for e in three_rank_events():
        view.event(e)
    view.event(step_event(0, 100))
    view.line(0, "[rank 2] hello from rank 2")
    view.close()
    text = out.getvalue()
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and steps[0].startswith("step   1/100  loss 2.9900") and "150 ms/step" in steps[0]
    assert steps[1].startswith("step 100/100") and "straggler: rank 2" in steps[1]
    assert "memory > 90%: rank 1" in steps[1]
    assert "eval step 40: validation loss 2.5000" in text and "[rank 2] hello from rank 2" in text
    assert "zerorun · tiny · summary" in text and "\x1b[" not in text  # plain text, no terminal escapes


def test_steps_skipped_on_an_fp16_overflow_are_said(tmp_path):
    """A review: an fp16 run whose every step was skipped (the model never updated) showed ordinary step lines, then
    'steps 8/8' and done."""
    out = io.StringIO()
    view = open_view(JobState(name="tiny", world_size=1, steps=8, started=T0), out, dashboard=True)
    view.min_interval_s = 0.0
    for step in (1, 8):
        e = step_event(0, step)
        e.data.update(skipped=True, skipped_steps=step, loss_scale=2.0 ** (16 - step))
        view.event(e)
    view.close()
    steps = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert "tok/s" in steps[0]
    assert "  skipped 1 (fp16 overflow, loss scale 32768)" in steps[0] and "  skipped 8 (fp16 overflow, loss scale " \
        "256)" in steps[-1], steps
    assert re.search(r"skipped steps\s+8 of 8 \(fp16 overflow: the model was not updated at them\)", out.getvalue())


def test_live_view_on_a_terminal_and_summary_at_close():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=150, record=True)
    state = JobState(name="gpt-stdlib", world_size=3, steps=100, started=T0)
    view = LiveView(state, console, refresh_per_second=20)
    for e in three_rank_events():
        view.event(e)
    view.line(1, "a torchrun line")
    time.sleep(0.2)
    view.close()
    text = console.export_text().replace("│", " ")
    assert "zerorun · gpt-stdlib" in text and "[node 1] a torchrun line" in text
    assert "eval step 40: validation loss 2.5000" in text  # milestones go to the scrollback too
    assert "zerorun · gpt-stdlib · summary" in text and re.search(r"node2\s+2\s+stopped\s+40\s+450 MiB", text)
    assert isinstance(open_view(state, io.StringIO(), dashboard=True), PlainView)


def test_a_step_of_no_token_ids_shows_no_tokens_per_second():
    """A new user's review: a regression's step lines said '0.0 tok/s' (its batches hold no token ids)."""
    out = io.StringIO()
    view = open_view(JobState(name="tiny", world_size=1, steps=8, started=T0), out, dashboard=True)
    e = step_event(0, 1)
    e.data.update(tokens_per_s=0.0, job_tokens_per_s=0.0)
    view.event(e)
    view.close()
    [line] = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert "samples/s" in line and "tok/s" not in line, line


def test_the_live_views_lines_above_it_are_not_broken_into_lines():
    """A review: at 60 columns the done line's metrics path was broken over lines by rich (a copy carried the
    breaks); the terminal wraps it itself now."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=40)
    view = LiveView(JobState(name="j", world_size=1, steps=1, started=T0), console, refresh_per_second=20)
    path = "/tmp/runs/gpt-stdlib/20261207-014548-42ff/metrics.jsonl"
    view.print(f"zerorun: done in 4.0 s; validation loss 5.4179 -> 3.4922 (best 3.4922); metrics: {path}")
    view.close()
    assert f"metrics: {path}\n" in out.getvalue(), out.getvalue()


def test_summary_means_over_the_whole_run():
    state = make_state()
    state.update(Event("finish", 0, T0 + 40, {"peak_rss_bytes": 600 * MiB}))
    state.end(T0 + 42)
    text = rendered(summary(state))
    r0 = row_of(text, 0)
    assert re.search(r"node0\s+0\s+done\s+40\s+600 MiB\s+4\.00 MiB/2\.00 MiB/4\.00 MiB\s+53\.3/s\s+6\.8k/s\s+150 ms"
                     r"\s+40%\s+73 B\s+-\s+1 ms", r0), r0  # 3,000 bytes sent in 41 steps; none to other nodes
    assert "stopped" in row_of(text, 1)
    assert re.search(r"total time\s+42 s", text) and re.search(r"time to first step\s+10 s", text)
    assert re.search(r"final validation loss\s+2\.5000", text) and "last checkpoint" in text


def test_summary_shows_bytes_sent_per_step_and_to_other_nodes_where_the_job_spans_nodes():
    """Per rank the mean bytes sent per step and, of them, to other nodes (``comm_bytes_inter_node``, Note
    [Nodes of a group]); the latter column only where the job runs on more than one node or sent some there."""
    state = JobState(name="gpt-stdlib", stage=3, precision="fp32", world_size=2, hosts=["a x 2", "b x 2"],
                     started=T0)
    for step in (1, 20, 40):
        state.update(step_event(0, step, comm_bytes=4 * MiB * (1 if step == 1 else 20),
                                comm_bytes_inter_node=MiB * (1 if step == 1 else 20)))
    assert re.search(r"sent\s+to other.*per step\s+nodes", rendered(summary(state)), re.S)
    assert re.search(r"40%\s+4\.00 MiB\s+1\.00 MiB\s", rendered(summary(state))), rendered(summary(state))
    one = JobState(name="gpt-stdlib", stage=3, precision="fp32", world_size=1, hosts=["a x 1"], started=T0)
    for step in (1, 20):
        one.update(step_event(0, step, comm_bytes_inter_node=0))
    assert "sent" in rendered(summary(one)) and "other" not in rendered(summary(one))


def test_flop_rates_in_readable_units():
    from zerorun.telemetry.format import human_flops

    assert [human_flops(x) for x in (41.23, 0.06, 0.000815, 0.0)] == ["41.2 TFLOP/s", "60 GFLOP/s", "815 MFLOP/s",
                                                                       "0 MFLOP/s"]


def test_flops_per_token_6n_plus_attention():
    assert flops_per_token(1000) == 6000
    assert flops_per_token(1000, {"n_layer": 4, "d_model": 128}, 128) == 6000 + 12 * 4 * 128 * 128
    assert flops_per_token(1000, {"d_model": 128}, 128) == 6000  # no n_layer: 6N alone


def test_no_summary_for_a_job_that_never_sent_an_event():
    out = io.StringIO()
    PlainView(out, JobState(world_size=2, started=T0)).close()
    console = Console(file=io.StringIO(), force_terminal=True, width=100, record=True)
    LiveView(JobState(world_size=2, started=T0), console).close()
    assert out.getvalue() == "" and "summary" not in console.export_text()


def test_peak_rss_is_never_below_the_rss_now():
    """Issue 34 item 10 (Note [Peak RSS]): ``ru_maxrss`` lags the RSS, so an event can say rss 344 MiB, peak 343
    MiB; the views show the larger as the peak, and a later, lower peak (a finish event) does not lower it."""
    state = JobState(name="x", world_size=2, rank_hosts={0: "node0", 1: "node1"}, started=T0)
    state.update(step_event(0, 1, rss=344 * MiB, peak_rss_bytes=343 * MiB))
    state.update(step_event(1, 1, rss=200 * MiB, peak_rss_bytes=300 * MiB))
    text = rendered(render(state, now=T0 + 30, width=150))
    assert "344 MiB / 344 MiB" in row_of(text, 0) and "200 MiB / 300 MiB" in row_of(text, 1), text
    state.update(Event("finish", 0, T0 + 40, {"peak_rss_bytes": 343 * MiB}))
    state.end(T0 + 42)
    text = rendered(summary(state))
    assert re.search(r"node0\s+0\s+done\s+1\s+344 MiB", text) and re.search(r"node1\s+1\s+stopped\s+1\s+300 MiB",
                                                                              text), text


def test_rates_a_script_does_not_report_are_a_dash_not_zero():
    """Issue 34 item 10: ``zerorun.report(step, loss)`` without ``samples=``/``tokens=`` (no rates in its step
    events): the summary's mean samples/s and tokens/s are ``-``, not ``0.0/s``; a rank that reports samples but
    no tokens gets its samples/s."""
    state = JobState(name="script", world_size=2, started=T0)
    for step in (1, 2, 3):
        state.update(Event("step", 0, T0 + step, {"step": step, "loss": 1.0, "step_time_s": 0.5}))
        state.update(Event("step", 1, T0 + step, {"step": step, "loss": 1.0, "step_time_s": 0.5,
                                                  "samples_per_s": 8.0}))
    state.end(T0 + 4)
    text = rendered(summary(state))
    assert re.search(r"^\?\s+0\s+stopped\s+3\s+-\s+-\s+-\s+-\s+500 ms", text, re.M), text
    assert re.search(r"^\?\s+1\s+stopped\s+3\s+-\s+-\s+8\.0/s\s+-\s+500 ms", text, re.M), text
    assert "0.0/s" not in text


def test_report_never_sends_a_peak_below_its_rss(monkeypatch, capsys):
    """Note [Peak RSS] at the source: zerorun.report()'s step event carries max(ru_maxrss, RSS) as the peak."""
    import json
    import resource

    from zerorun.telemetry import report
    from zerorun.telemetry.events import PREFIX

    lagging = type("Usage", (), {"ru_maxrss": 1})()  # 1 KiB: ru_maxrss not yet updated
    monkeypatch.setattr(resource, "getrusage", lambda who: lagging)
    monkeypatch.setattr("sys.__stdout__", sys.stdout)
    report.report(1, 0.5)
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith(PREFIX)]
    event = json.loads(line[len(PREFIX):])
    assert event["peak_rss_bytes"] == event["rss_bytes"] > 1024


def test_a_rank_whose_collective_failed_on_a_peer_stays_stopped_whatever_its_exit_code():
    """Rank 1 was killed; rank 0 then failed in a collective (a peer failure) and exited 1, which its torchrun
    announces (Note [Rank exits]): the summary shows rank 0 ``stopped`` and rank 1 ``killed``, on one node as on
    two (before, a rank 0 on rank 1's node showed ``exit 1``, one on another node ``stopped``)."""
    state = JobState(name="x", world_size=2, started=T0)
    state.update(step_event(0, 1))
    state.update(step_event(1, 1))
    state.update(Event("error", 0, T0 + 5, {"type": "RuntimeError", "message": "Connection closed by peer",
                                            "peer_failure": True}))
    for rank, code in ((0, 1), (1, -9)):
        state.rank_exited(rank, code)
    state.end(T0 + 6)
    assert (state.ranks[0].status, state.ranks[1].status) == ("stopped", "killed")
