"""Issue 37 part 4: what the live dashboard and the plain view answer: lr, gradient norm and the loss trend,
CPU and GPU use per rank, columns that stay put between redraws, eval lines printed once, a wide terminal
used, and what the ranks are doing before the first step (their phase events). In-process, hand-made events."""

from __future__ import annotations

import io
import re

from rich.console import Console

from test_dashboard import T0, make_state, rendered, row_of, step_event
from zerorun.telemetry.console import PlainView
from zerorun.telemetry.dashboard import LiveView, render, trend_length
from zerorun.telemetry.events import Event
from zerorun.telemetry.format import SPARKS, sparkline
from zerorun.telemetry.state import JobState


def test_header_has_lr_grad_norm_and_the_loss_trend():
    state = make_state()
    for step in range(41, 61):
        for r in range(3):
            state.update(step_event(r, step, loss=3.0 - step / 100, lr=2.5e-4, grad_norm=0.8125))
    for width in (80, 120):
        text = rendered(render(state, now=T0 + 30, width=width), width)
        trend = sparkline([3.0 - s / 100 for s in (1, 20, 40, *range(41, 61))], trend_length(width))
        assert f"loss 2.4000 {trend}" in text and "lr 2.50e-04" in text and "grad norm 0.812" in text, text
        assert len(trend) == trend_length(width) and trend[0] == SPARKS[-1] and trend[-1] == SPARKS[0]
    assert sparkline([2.0, 2.0], 8) == SPARKS[3] * 2 and sparkline([], 8) == ""
    assert sparkline([1.0, 1.1], 8, spread=0.5) == SPARKS[0] + SPARKS[1]  # within half: no spike


def test_cpu_use_per_rank_and_gpu_utilization_where_reported():
    state = make_state()
    for r in range(3):
        state.update(step_event(r, 60, cpu_percent=95.0 + r, host_cpu_percent=61.4))
    text = rendered(render(state, now=T0 + 30, width=150), 150)
    assert "CPU" in text and "95% / 61%" in row_of(text, 0) and "97% / 61%" in row_of(text, 2), text
    assert "GPU" not in text  # no rank reports utilization: no column
    state.update(step_event(0, 61, cpu_percent=90.0, host_cpu_percent=50.0, gpu_util_percent=87,
                            cuda_allocated_bytes=2 ** 30, cuda_reserved_bytes=2 ** 31, cuda_total_bytes=2 ** 34))
    text = rendered(render(state, now=T0 + 30, width=200), 200)
    assert "GPU" in text, text
    assert re.search(r"\s87%\s", row_of(text, 0)) and "1.00 GiB / 2.00 GiB" in row_of(text, 0), text


def frames(width: int, events: list[Event]) -> tuple[list[str], str]:
    """The live view's frame after each of ``events`` at ``width`` columns (its rank table's header lines
    each time), and what it printed into the scrollback."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=width, height=60, record=True)
    view = LiveView(JobState(name="j", world_size=3, steps=100, started=T0), console, refresh_per_second=0.01)
    heads, text = [], ""
    for e in events:
        view.event(e)
        text = rendered(view._render(), width)
        lines = text.splitlines()
        i = next(i for i, line in enumerate(lines) if line.startswith("rank ") or re.match(r"host\s+rank ", line))
        heads.append("\n".join(lines[i - 1:i + 1]))
    view.live.stop()
    scrollback = console.export_text()
    return heads, text + "\n@@\n" + scrollback


def job_events() -> list[Event]:
    """Start, ready, then steps in which RSS, rates and the status (a straggler, a memory alert) grow wider."""
    events = [Event("start", r, T0 + 1, {"host": "node0", "host_mem_bytes": 16 * 2 ** 30}) for r in range(3)]
    events += [Event("model_ready", r, T0 + 2, {"params": 1000, "stage": 2}) for r in range(3)]
    for step in (1, 20, 40, 60):
        for r in range(3):
            events.append(step_event(r, step, wait=0.001 if r == 2 and step > 1 else 0.06,
                                     host_used=15 * 2 ** 30 if step == 60 else 2 ** 30, rss=(40 + step * 30) * 2 ** 20,
                                     cpu_percent=9.0 + step, host_cpu_percent=9.0))
    events.append(Event("eval", 0, T0 + 30, {"step": 60, "val_loss": 2.125}))
    return events


def test_columns_stay_put_between_redraws_at_each_width():
    """At 80 columns the host memory and model states columns came and went as the status grew to
    ``training straggler`` and RSS from ``-`` to ``338 MiB / 338 MiB`` (Note [Columns chosen once per width])."""
    for width in (80, 100, 120):
        heads, _ = frames(width, job_events())
        assert len(set(heads)) == 1, (width, heads)


def test_eval_lines_are_printed_once():
    """The live view prints an eval (a milestone) into the scrollback above it; its log panel showed it again."""
    _, text = frames(100, job_events())
    frame, scrollback = text.split("\n@@\n")
    assert "eval step 60: validation loss 2.1250" not in frame and "val 2.1250" in frame
    assert scrollback.count("eval step 60: validation loss 2.1250") == 1


def test_a_wide_terminal_is_used():
    state = make_state()
    for step in range(41, 61):
        for r in range(3):
            state.update(step_event(r, step, step_time=0.15 + 0.01 * (step % 4), cpu_percent=90.0,
                                    host_cpu_percent=50.0))
    text = rendered(render(state, now=T0 + 30, width=200, height=40), 200)
    lines = text.splitlines()
    table = [line for line in lines if re.match(r"node\d\s+\d\s+60\s", line)]
    assert len(table) == 3 and min(len(line.rstrip()) for line in table) >= 140, text
    assert "tokens" in text and "step time" in text and "trend" in text
    assert max(line.count("━") for line in lines) >= 45  # the progress bar: a quarter of the width
    assert "█▒▒▒▒▒▒▒░░░░░░░░" in row_of(text, 0)  # the memory bar: 16 wide


def phase(rank: int, name: str, t: float) -> Event:
    return Event("phase", rank, T0 + t, {"phase": name})


def test_waiting_for_ranks_says_what_the_slowest_rank_does():
    """The 12-27 s before the first step said only "waiting for ranks" (Note [Rank phases])."""
    state = JobState(name="j", world_size=3, steps=10, started=T0)
    def header(now: float) -> str:
        text = rendered(render(state, now=T0 + now, width=100), 100)
        return [line for line in text.splitlines() if "waiting" in line][0].strip(" │")

    assert header(2) == "waiting for ranks: starting (all 3 ranks) for 2.0 s"
    for r, t in ((0, 3), (1, 3.5), (2, 4)):
        state.update(phase(r, "importing torch", t))
    state.update(phase(0, "joining the process group", 9))
    state.update(phase(2, "joining the process group", 9.5))
    assert header(11) == "waiting for ranks: importing torch (rank 1 of 3) for 7.5 s"
    state.update(phase(1, "joining the process group", 12))
    for r in range(3):
        state.update(phase(r, "building the model", 13))
    state.update(phase(0, "something newer", 14))  # a phase this launcher does not know: after the known ones
    assert header(15) == "waiting for ranks: building the model (ranks 1-2 of 3) for 2.0 s"
    for r in range(3):
        state.update(phase(r, "first step", 16))
    state.update(step_event(0, 1))
    assert "waiting" not in rendered(render(state, now=T0 + 30, width=100), 100)
    assert all(not isinstance(e, Event) or e.kind != "phase" for e in state.log)  # not in the log panel
    deferred = JobState(name="j", world_size=2, steps=10, started=T0)  # stage 3, zero.meta_init: data after ZeRO
    deferred.update(phase(0, "loading data after the model", 3))
    deferred.update(phase(1, "setting up ZeRO", 3))
    assert [line for line in rendered(render(deferred, now=T0 + 4, width=100), 100).splitlines()
            if "waiting" in line][0].strip(" │") == "waiting for ranks: setting up ZeRO (rank 1 of 2) for 1.0 s"
    one = JobState(name="j", world_size=1, steps=10, started=T0)  # a review: "(all 1 ranks)"
    assert [line for line in rendered(render(one, now=T0 + 2, width=100), 100).splitlines()
            if "waiting" in line][0].strip(" │") == "waiting for ranks: starting (the one rank) for 2.0 s"


def test_plain_view_prints_each_slowest_phase_once():
    out = io.StringIO()
    view = PlainView(out, JobState(world_size=2, steps=10, started=T0))
    for r in range(2):
        view.event(phase(r, "importing torch", 3 + r))
    for r in range(2):
        view.event(phase(r, "joining the process group", 9 + r))
    view.event(phase(0, "building the model", 11))
    assert out.getvalue().splitlines() == [
        "waiting for ranks: importing torch (all 2 ranks), 4.0 s after the launch",
        "waiting for ranks: joining the process group (all 2 ranks), 10 s after the launch"]


def test_a_script_that_runs_is_not_waited_for():
    """``zerorun launch``'s ranks run the user's script, which may never report a step: not "waiting"."""
    state = JobState(name="j", world_size=2, steps=None, started=T0)
    state.update(phase(0, "running the script", 2))
    assert "waiting for ranks: starting (rank 1 of 2)" in rendered(render(state, now=T0 + 3, width=100), 100)
    state.update(phase(1, "running the script", 2.5))
    text = rendered(render(state, now=T0 + 3, width=100), 100)
    assert "waiting" not in text and "the ranks run the script" in text
