"""The launcher's live dashboard (rich ``Live``): a job header, one row per rank, the last log lines, and the
summary table printed when the job ends; everything laid out for the terminal's width (Note [Fitting the
width] in telemetry/layout.py). The job's picture is a :class:`~zerorun.telemetry.state.JobState`: this
module reads it and never the other way round.

Note [Straggler and memory marks]: in synchronous data parallelism every rank's step takes about as long,
because the fast ranks wait for the slow one inside the collectives. So the straggler is found from the time
a rank computed rather than waited (step time x (1 - comm wait fraction), ``RankState.busy_s``), and it is
marked when that is over ``STRAGGLER_RATIO`` times the other ranks' median. A rank is marked for memory when
its host's memory in use, its own RSS, or its CUDA reserved memory is above ``MEMORY_ALERT`` of the total:
several ranks share a host, so the host's use is what runs out first.

The view interface (shared with ``console.PlainView``): ``event(e)``, ``line(node_rank, text)``,
``print(text)``, ``close()``; :func:`open_view` picks one.
"""

from __future__ import annotations

import io
import threading
import time
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from zerorun.telemetry.console import PlainView
from zerorun.telemetry.events import Event
from zerorun.telemetry.format import (count, describe, human_duration, human_flops, human_rate, log_lines, pack, pct,
                                      seconds, short_bytes, sparkline)
from zerorun.telemetry.layout import Column, render_table
from zerorun.telemetry.phases import SCRIPT, slowest
from zerorun.telemetry.state import MEMORY_ALERT, JobState, RankState
from zerorun.telemetry.summary import host_groups, print_summary

BAR_WIDTH = 8  # the host memory bar (WIDE_BAR on a terminal of WIDE columns or more)
WIDE, WIDE_BAR = 160, 16
STEP_TREND = 16  # step times in a rank's step time trend (shown where the terminal has room)
PROGRESS_BAR = 30  # the progress bar, on a terminal wide enough (wider on a wide one: a quarter of it)
WIDTH = 150  # when no width is given
LOG_HEIGHT = 8  # terminal lines of the log panel's text


def memory_bar(r: RankState, bar_width: int = BAR_WIDTH) -> Text:
    """A bar of the host's memory, ``bar_width`` characters: ``█`` this rank's RSS, ``▒`` the rest in use on
    the host, ``░`` free, then the host's use in percent."""
    if not r.host_mem_bytes:
        return Text("-")
    own = min(1.0, (r.rss_bytes or 0) / r.host_mem_bytes)
    used = max(own, min(1.0, r.host_mem_frac or own))
    n_own = max(1 if r.rss_bytes else 0, round(own * bar_width))
    n_used = max(n_own, round(used * bar_width))
    alert = (r.memory_frac or 0) > MEMORY_ALERT
    bar = Text("█" * n_own, style="red" if alert else "cyan")
    bar.append("▒" * (n_used - n_own), style="red" if alert else "blue")
    bar.append("░" * (bar_width - n_used), style="dim")
    bar.append(f" {pct(used)}")
    return bar


def progress_lines(state: JobState, width: int, now: float) -> list[Text]:
    """``step 40/100 ━━━━━━━━━━━━━━━━━━ 40%  elapsed 25 s  ETA 37 s`` on one line of ``width``, the bar
    shortened (to 10) or the times moved to a second line when it does not fit."""
    total, step = state.steps or 0, state.step
    label = f"step {step}/{total or '?'}"
    done = f"{100 * step / total:.0f}%" if total else ""
    times = f"elapsed {human_duration(state.elapsed_s(now))}  ETA {human_duration(state.eta_s(now))}"
    fixed = len(label) + len(done) + 3
    most = max(PROGRESS_BAR, width // 4)
    bar_width = min(most, width - fixed - len(times) - 1)
    one_line = bar_width >= 10
    bar_width = bar_width if one_line else max(1, min(most, width - fixed))
    filled = round(bar_width * min(step, total) / total) if total else 0
    line = Text(label + " ", style="bold")
    line.append("━" * filled, style="magenta")
    line.append("━" * (bar_width - filled), style="grey23")
    line.append(f" {done}" if done else "")
    if one_line:
        line.append(" " + times)
        return [line]
    return [line, Text(times)]


def trend_length(width: int) -> int:
    """Losses in the header's loss trend at ``width`` columns: 8 at 80, 32 at 200."""
    return max(8, min(48, (width - 40) // 5))


def header(state: JobState, now: float | None = None, width: int = WIDTH) -> Panel:
    """Recipe, stage, precision, world size and hosts; progress bar with elapsed time and ETA; job-wide
    throughput, latest loss with its trend (:func:`trend_length` losses), learning rate and gradient norm,
    validation loss, latest checkpoint; before the first step, what the slowest rank is doing (Note [Rank
    phases] in telemetry/phases.py). Lines wrap between facts, never inside one."""
    now = now or time.time()
    inner = max(20, width - 4)  # the panel's border and padding
    plan = [f"ZeRO stage {state.stage}" if state.stage is not None else None, state.precision,
            count(state.world_size or len(state.ranks), "rank")
            + (f" on {', '.join(state.hosts)}" if state.hosts else "")]
    rates = [f"{human_rate(v)} {unit}" for v, unit in ((state.job_rate("samples_per_s"), "samples/s"),
                                                      (state.job_rate("tokens_per_s"), "tokens/s"))
             if v is not None]
    tflops = state.job_rate("tflops")
    if tflops is not None:
        rates.append(human_flops(tflops))
    facts = ["job " + " · ".join(rates)] if rates else []
    first = state.ranks[min(state.ranks)] if state.ranks else None
    if state.last_loss is not None:
        losses = first.trends.get("loss", []) if first else []
        trend = sparkline(losses, trend_length(width)) if len(losses) > 1 else ""
        facts.append(f"loss {state.last_loss:.4f}" + (f" {trend}" if trend else ""))
    if first is not None and first.lr is not None:
        facts.append(f"lr {first.lr:.2e}")
    if first is not None and first.grad_norm is not None:
        facts.append(f"grad norm {first.grad_norm:.3f}")
    if state.final_val is not None:
        facts.append(f"val {state.final_val:.4f} (best {state.best_val:.4f})")
    if state.checkpoints:
        facts.append(f"checkpoint step {state.checkpoints[-1].get('step', '?')}")
    waiting = slowest(state.ranks.values()) if state.ended is None else None
    if waiting is not None:
        facts.append(waiting.describe(now, state.started))
    idle = "the ranks run the script" if any(r.phase == SCRIPT for r in state.ranks.values()) else "waiting for ranks"
    body = [Text(" · ".join(p for p in plan if p)), *progress_lines(state, inner, now),
            *(Text(line) for line in (pack(facts, inner) or [idle]))]
    return Panel(Group(*body), title=Text(f"zerorun · {state.name}", style="bold"), title_align="left",
                 border_style="blue")


def percent(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}%"


def rank_columns(ranks: list[RankState], steps: int | None = None, width: int = WIDTH) -> list[Column]:
    """The live rank table's columns, highest priority kept longest (rank, step, loss and status always),
    each with the width its values typically reach reserved (Note [Columns chosen once per width] in
    telemetry/layout.py; ``steps``: the job's, for the step column). CPU: this rank's process (100% = one
    core) / its whole host (100% = every core); GPU utilization only where a rank reports it (CUDA with
    nvidia-ml-py, ``probes.GpuUtilization``). At ``width`` :data:`WIDE` or more the memory bar is wider, and
    where there is room the tokens/s and each rank's step time trend (its last :data:`STEP_TREND`) are shown."""
    bar = WIDE_BAR if width >= WIDE else BAR_WIDTH
    cols = [Column("rank", [str(r.rank) for r in ranks]),
            Column("step", [str(r.step) for r in ranks], reserve=len(str(steps or ""))),
            Column("loss", ["-" if r.loss is None else f"{r.loss:.4f}" for r in ranks], reserve=6),
            Column("samples\n/s", ["-" if r.samples_per_s is None else f"{human_rate(r.samples_per_s)}/s"
                                   for r in ranks], priority=8, reserve=7),
            Column("step\ntime", [seconds(r.step_time_s) for r in ranks], priority=9, reserve=6),
            Column("comm\nwait", [pct(r.comm_wait) for r in ranks], priority=4),
            Column("CPU\nrank / host", [f"{percent(r.cpu_percent)} / {percent(r.host_cpu_percent)}" for r in ranks],
                   priority=7, reserve=11, alt=Column("CPU\nrank", [percent(r.cpu_percent) for r in ranks],
                                                      priority=7, reserve=5)),
            Column("RSS\nnow / peak", [f"{short_bytes(r.rss_bytes)} / {short_bytes(r.peak_rss_bytes)}" for r in ranks],
                   priority=6, reserve=19, alt=Column("RSS\nnow", [short_bytes(r.rss_bytes) for r in ranks],
                                                       priority=6, reserve=8)),
            Column("host\nmemory", [memory_bar(r, bar) for r in ranks], justify="left", priority=2, reserve=bar + 4),
            Column("model\nstates", [short_bytes(r.model_state_total) for r in ranks], priority=3, reserve=8),
            Column("tokens\n/s", ["-" if r.tokens_per_s is None else f"{human_rate(r.tokens_per_s)}/s"
                                  for r in ranks], priority=-1, reserve=8),
            Column("step time\ntrend", [sparkline(r.trends.get("step_time_s", []), STEP_TREND, 0.5) or "-"
                                        for r in ranks], justify="left", priority=-2, reserve=STEP_TREND)]
    if any(r.cuda for r in ranks):
        alloc = [f"{short_bytes(r.cuda.get('cuda_allocated_bytes'))} / {short_bytes(r.cuda.get('cuda_reserved_bytes'))}"
                 if r.cuda else "-" for r in ranks]
        cols.append(Column("device mem\nalloc / reserved", alloc, priority=5, reserve=19,
                           alt=Column("device\nreserved", [short_bytes(r.cuda.get("cuda_reserved_bytes"))
                                                           for r in ranks], priority=5, reserve=8)))
    if any(r.gpu_util_percent is not None for r in ranks):
        cols.append(Column("GPU\nutil", [percent(r.gpu_util_percent) for r in ranks], priority=5))
    return cols


def rank_table(state: JobState, max_rows: int | None = None, width: int = WIDTH, chosen: dict | None = None) -> Group:
    """One row per rank, fitting ``width``; the straggler and ranks near their memory limit are coloured and
    named in the status column (Note [Straggler and memory marks]). With more ranks than ``max_rows``, the
    marked and failed ranks are shown first, then the others in rank order, and a line counts those left out.
    ``chosen``: the live view's columns kept per width (Note [Columns chosen once per width] in layout.py). A
    training rank that is marked shows its marks only (``straggler memory 94%``): narrower, and stable."""
    straggler, alerts = state.straggler(), state.memory_alerts()
    rows = sorted(state.ranks.values(), key=lambda r: r.rank)
    if max_rows is not None and len(rows) > max_rows:
        marked = {r.rank for r in rows if r.rank == straggler or r.rank in alerts or r.status in ("error", "stopped", "killed")}
        rows = sorted(sorted(rows, key=lambda r: r.rank not in marked)[:max_rows], key=lambda r: r.rank)
    left_out = len(state.ranks) - len(rows)
    statuses, styles = [], []
    for r in rows:
        marked = r.status == "training" and (r.rank == straggler or r.rank in alerts)  # its marks say it trains
        status = Text("" if marked else r.status, style={"error": "bold red", "killed": "bold red", "done": "green",
                                                         "stopped": "yellow"}.get(r.status, ""))
        style = ""
        if r.rank == straggler:
            status.append(" straggler", style="bold yellow")
            style = "yellow"
        if r.rank in alerts:
            status.append(f" memory {pct(r.memory_frac)}", style="bold red")
            style = "red"
        statuses.append(status[1:] if marked else status)
        styles.append(style)
    columns = rank_columns(rows, state.steps, width) + [Column("status", statuses, justify="left",
                                                                 reserve=len("straggler memory 99%"))]
    table = render_table(columns, width, row_styles=styles, groups=host_groups(rows), chosen=chosen,
                         host=Column("host", [r.host or "?" for r in rows], justify="left", priority=0))
    return Group(table, Text(f"{left_out} more ranks not shown", style="dim")) if left_out else table


def printed_above(e: Event) -> bool:
    """Whether the live view prints event ``e`` into the scrollback above it (milestones: evaluations,
    checkpoints, rank 0's model, messages and stop, crashes): the log panel then leaves it out, so that each
    is on screen once."""
    milestone = e.kind in ("eval", "checkpoint") or (e.kind in ("model_ready", "log", "stopped") and e.rank == 0)
    return milestone or (e.kind == "error" and not e.data.get("user_error"))  # user errors: the launcher's line


def log_panel(state: JobState, width: int = WIDTH, height: int = LOG_HEIGHT, live: bool = False) -> Panel:
    """The last log lines of all ranks (worker lines carry ``[rank R]``, launcher-side ones ``[node N]``),
    wrapped rather than cut, as many of the newest as fill ``height`` lines of the panel's ``width``; ``live``:
    without the events the live view printed above it (:func:`printed_above`)."""
    inner = max(20, width - 4)
    lines, used = [], 0
    entries = [x for x in state.log if not (live and isinstance(x, Event) and printed_above(x))]
    for line in reversed(log_lines(entries)):
        need = lines_of(Text(line, overflow="fold"), inner)
        if lines and used + need > height:
            break
        lines.insert(0, line)
        used += need
    text = Text("\n".join(lines) if lines else "(no output yet)", overflow="fold")
    return Panel(text, title="log", title_align="left", border_style="dim")


def lines_of(renderable, width: int) -> int:
    """Terminal lines ``renderable`` takes at ``width`` columns."""
    console = Console(width=width, file=io.StringIO(), color_system=None)
    return len(console.render_lines(renderable, console.options, pad=False))


def render(state: JobState, now: float | None = None, height: int | None = None, width: int = WIDTH,
           chosen: dict | None = None, live: bool = False) -> Group:
    """The whole live view for ``state`` at time ``now`` (Unix s), ``width`` columns wide. With ``height``, it
    fits that many lines of terminal: the log panel gets up to a quarter of them, and the rank table shows as
    many ranks as the lines left after the header and the log hold (at least 3; more are counted in a line).
    ``chosen``: the view's columns kept per width (Note [Columns chosen once per width] in layout.py);
    ``live``: the milestones printed above the view are left out of its log panel (:func:`printed_above`)."""
    top = header(state, now, width)
    if not height:
        return Group(top, rank_table(state, None, width, chosen), log_panel(state, width, live=live))
    log = log_panel(state, width, min(LOG_HEIGHT, max(2, height // 4)), live)
    budget = height - lines_of(top, width) - lines_of(log, width) - 1  # one spare: rich's cursor line
    if budget < 10:  # a small terminal: the rank table first (3 ranks, 2 host headings, its header)
        log = log_panel(state, width, 2, live)
        budget = height - lines_of(top, width) - lines_of(log, width) - 1
    max_rows = max(3, budget - 3)
    table = rank_table(state, max_rows, width, chosen)
    while max_rows > 3 and lines_of(table, width) > budget:  # host headings, stacked rows: measure, shrink
        max_rows = max(3, max_rows - (lines_of(table, width) - budget))
        table = rank_table(state, max_rows, width, chosen)
    return Group(top, table, log)


class LiveView:
    """The live dashboard on ``console`` (a terminal), redrawn ``refresh_per_second`` times a second by rich's
    own thread; events and lines only update the :class:`JobState` (under a lock, so a redraw never sees it
    half-changed). Once a second is enough for people and keeps the launcher's share of the CPU, which it
    shares with the ranks on the first host, small: a frame costs about 10 ms of CPU with a few ranks
    (``benchmarks/telemetry_overhead.py``)."""

    def __init__(self, state: JobState, console: Console, refresh_per_second: float = 1) -> None:
        self.state, self.console = state, console
        self._lock = threading.Lock()
        self._chosen: dict = {}  # Note [Columns chosen once per width] in telemetry/layout.py
        self.live = Live(console=console, get_renderable=self._render, refresh_per_second=refresh_per_second,
                         redirect_stdout=False, redirect_stderr=False)
        self.live.start()

    def _render(self):
        with self._lock:
            return render(self.state, height=self.console.size.height, width=self.console.size.width,
                          chosen=self._chosen, live=True)

    def event(self, e: Event) -> None:
        with self._lock:
            self.state.update(e)
        if printed_above(e):
            for line in describe(e):  # milestones go to the scrollback above the live view (not its log panel)
                self.print(line)

    def line(self, node_rank: int, line: str) -> None:
        with self._lock:
            self.state.add_line(node_rank, line)  # into the log panel, torchrun's noise folded (state.LogTail)

    def print(self, text: str) -> None:
        """``text`` above the live view, as one line the terminal wraps itself: rich's wrap put line breaks into
        the paths of the done line (a review), which a copy then carried."""
        self.console.print(Text(text), soft_wrap=True)

    def close(self) -> None:
        """Stop the live view (its last frame stays on screen) and print the summary below it."""
        with self._lock:
            if self.state.ended is None:
                self.state.end()
        self.live.stop()
        print_summary(self.state, console=self.console)


def open_view(state: JobState, out: TextIO, dashboard: bool = True):
    """The live dashboard when ``dashboard`` and ``out`` is a terminal, else the plain one-line progress view
    (CI, ``| tee``, ``--no-dashboard``)."""
    console = Console(file=out)
    if dashboard and console.is_terminal and not console.is_dumb_terminal:
        return LiveView(state, console)
    return PlainView(out, state)
