"""The launcher's live dashboard (rich ``Live``): a job header, one row per rank, the last log lines, and the
summary table printed when the job ends.

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

import threading
import time
from typing import TextIO

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from zerorun.telemetry.console import PlainView, human_bytes, human_rate
from zerorun.telemetry.events import Event
from zerorun.telemetry.state import MEMORY_ALERT, JobState, RankState, describe

BAR_WIDTH = 8


def human_duration(seconds: float | None) -> str:
    """``seconds`` as ``42 s``, ``3:07`` (m:ss) or ``1:02:03`` (h:mm:ss); ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{s} s"
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def human_flops(tflops: float) -> str:
    """A TFLOP/s figure in the unit that keeps it readable: ``41.2 TFLOP/s``, ``815 GFLOP/s``, ``3.1 MFLOP/s``."""
    for scale, unit in ((1.0, "TFLOP/s"), (1e-3, "GFLOP/s"), (1e-6, "MFLOP/s")):
        if tflops >= scale:
            return f"{tflops / scale:.3g} {unit}"
    return f"{tflops * 1e6:.3g} MFLOP/s"


def _pct(frac: float | None) -> str:
    return "-" if frac is None else f"{100 * frac:.0f}%"


def _bytes(n: float | None) -> str:
    """Bytes in binary units with three significant digits (``409 MiB``, ``8.04 MiB``); ``-`` when unknown."""
    if n is None:
        return "-"
    text = human_bytes(n)  # one decimal: "408.7 MiB"
    value, unit = text.split(" ")
    if unit == "B":
        return text
    v = float(value) if float(value) < 1000 else round(float(value))
    return f"{v:.0f} {unit}" if v >= 100 else f"{v:.1f} {unit}" if v >= 10 else f"{v:.2f} {unit}"


def memory_bar(r: RankState) -> Text:
    """A bar of the host's memory: ``█`` this rank's RSS, ``▒`` the rest in use on the host, ``░`` free, then
    the host's use in percent."""
    if not r.host_mem_bytes:
        return Text("-")
    own = min(1.0, (r.rss_bytes or 0) / r.host_mem_bytes)
    used = max(own, min(1.0, r.host_mem_frac or own))
    n_own = max(1 if r.rss_bytes else 0, round(own * BAR_WIDTH))
    n_used = max(n_own, round(used * BAR_WIDTH))
    alert = (r.memory_frac or 0) > MEMORY_ALERT
    bar = Text("█" * n_own, style="red" if alert else "cyan")
    bar.append("▒" * (n_used - n_own), style="red" if alert else "blue")
    bar.append("░" * (BAR_WIDTH - n_used), style="dim")
    bar.append(f" {_pct(used)}")
    return bar


def header(state: JobState, now: float | None = None) -> Panel:
    """Recipe, stage, precision, world size and hosts; progress bar with elapsed time and ETA; job-wide
    throughput, latest loss and validation loss, latest checkpoint."""
    now = now or time.time()
    plan = [f"ZeRO stage {state.stage}" if state.stage is not None else None, state.precision,
            f"{state.world_size or len(state.ranks)} ranks" + (f" on {', '.join(state.hosts)}" if state.hosts else "")]
    total, step = state.steps or 0, state.step
    progress = Table.grid(padding=(0, 1))
    progress.add_row(Text(f"step {step}/{total or '?'}", style="bold"),
                     ProgressBar(total=max(total, 1), completed=min(step, total or 1), width=30),
                     Text(f"{100 * step / total:.0f}%" if total else ""),
                     Text(f"elapsed {human_duration(state.elapsed_s(now))}  ETA {human_duration(state.eta_s(now))}"))
    rates = [f"{human_rate(v)} {unit}" for v, unit in ((state.job_rate("samples_per_s"), "samples/s"),
                                                      (state.job_rate("tokens_per_s"), "tokens/s"))
             if v is not None]
    tflops = state.job_rate("tflops")
    if tflops is not None:
        rates.append(human_flops(tflops))
    facts = ["job " + " · ".join(rates)] if rates else []
    if state.last_loss is not None:
        facts.append(f"loss {state.last_loss:.4f}")
    if state.final_val is not None:
        facts.append(f"val {state.final_val:.4f} (best {state.best_val:.4f})")
    if state.checkpoints:
        facts.append(f"checkpoint step {state.checkpoints[-1].get('step', '?')}")
    body = Group(Text(" · ".join(p for p in plan if p)), progress, Text("   ".join(facts) or "waiting for ranks"))
    return Panel(body, title=Text(f"zerorun · {state.name}", style="bold"), title_align="left", border_style="blue")


def rank_table(state: JobState, max_rows: int | None = None) -> Table:
    """One row per rank; the straggler and ranks near their memory limit are coloured and named in the status
    column (Note [Straggler and memory marks]). With more ranks than ``max_rows``, the marked and failed
    ranks are shown first, then the others in rank order, and a caption counts those left out."""
    cuda = any(r.cuda for r in state.ranks.values())
    straggler, alerts = state.straggler(), state.memory_alerts()
    rows = sorted(state.ranks.values(), key=lambda r: r.rank)
    if max_rows is not None and len(rows) > max_rows:
        marked = {r.rank for r in rows if r.rank == straggler or r.rank in alerts or r.status in ("error", "stopped", "killed")}
        rows = sorted(sorted(rows, key=lambda r: r.rank not in marked)[:max_rows], key=lambda r: r.rank)
    left_out = len(state.ranks) - len(rows)
    table = Table(box=box.SIMPLE_HEAD, header_style="bold", padding=(0, 1), pad_edge=False,
                  caption=f"{left_out} more ranks not shown" if left_out else None, caption_justify="left")
    for name, justify in (("host", "left"), ("rank", "right"), ("step", "right"), ("loss", "right"),
                          ("samples\n/s", "right"), ("step\ntime", "right"), ("comm\nwait", "right"),
                          ("RSS\nnow / peak", "right"), ("host\nmemory", "left"), ("model\nstates", "right"),
                          *((("device mem\nalloc / reserved", "right"),) if cuda else ()), ("status", "left")):
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")
    for r in rows:
        status = Text(r.status, style={"error": "bold red", "killed": "bold red", "done": "green",
                                    "stopped": "yellow"}.get(r.status, ""))
        style = ""
        if r.rank == straggler:
            status.append(" straggler", style="bold yellow")
            style = "yellow"
        if r.rank in alerts:
            status.append(f" memory {_pct(r.memory_frac)}", style="bold red")
            style = "red"
        cells = [r.host or "?", str(r.rank), str(r.step), "-" if r.loss is None else f"{r.loss:.4f}",
                 "-" if r.samples_per_s is None else f"{human_rate(r.samples_per_s)}/s", _seconds(r.step_time_s),
                 _pct(r.comm_wait), f"{_bytes(r.rss_bytes)} / {_bytes(r.peak_rss_bytes)}", memory_bar(r),
                 _bytes(r.model_state_total)]
        if cuda:
            cells.append(f"{_bytes(r.cuda.get('cuda_allocated_bytes'))} / {_bytes(r.cuda.get('cuda_reserved_bytes'))}"
                         if r.cuda else "-")
        table.add_row(*(Text(c) if isinstance(c, str) else c for c in cells), status, style=style)
    return table


def log_panel(state: JobState) -> Panel:
    """The last log lines of all ranks (worker lines carry ``[rank R]``, launcher-side ones ``[node N]``)."""
    text = Text("\n".join(state.log) if state.log else "(no output yet)", no_wrap=True, overflow="ellipsis")
    return Panel(text, title="log", title_align="left", border_style="dim")


def render(state: JobState, now: float | None = None, height: int | None = None) -> Group:
    """The whole live view for ``state`` at time ``now`` (Unix s), fitting the rank table into ``height``
    lines of terminal when given (the header and log panel take about 20)."""
    max_rows = max(3, height - 21) if height else None
    return Group(header(state, now), rank_table(state, max_rows), log_panel(state))


def summary(state: JobState) -> Group:
    """The end-of-job tables: per rank peak memory and mean throughput, job totals and losses."""
    ranks = Table(title="per rank", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    cuda = any(r.cuda for r in state.ranks.values())
    for name in ("host", "rank", "status", "steps", "peak\nRSS", "model states\nparams/grads/optim",
                 *(("peak\ndevice",) if cuda else ()), "mean\nsamples/s", "mean\ntokens/s", "mean\nstep",
                 "comm\nwait", "telemetry\nper event"):
        ranks.add_column(name, justify="left" if name in ("host", "status") else "right", no_wrap=True)
    for r in sorted(state.ranks.values(), key=lambda r: r.rank):
        ms = r.model_state_bytes
        parts = "/".join(_bytes(ms.get(k)) for k in ("params", "grads", "optimizer")) if ms else "-"
        mean = (lambda total: f"{human_rate(total / r.train_s)}/s") if r.train_s else (lambda total: "-")
        row = [r.host or "?", str(r.rank), r.status, str(r.step), _bytes(r.peak_rss_bytes), parts]
        if cuda:
            row.append(_bytes(r.cuda.get("cuda_peak_bytes")))
        row += [mean(r.samples), mean(r.tokens), _seconds(r.train_s / r.train_steps if r.train_steps else None),
                _pct(r.comm_wait_s / r.train_s if r.train_s else None),
                _seconds(r.telemetry_s / r.telemetry_events if r.telemetry_events else None)]
        ranks.add_row(*map(Text, row))
    job = Table.grid(padding=(0, 2))
    job.add_column(style="bold")
    job.add_column()
    rows = [("total time", human_duration(state.elapsed_s())),
            ("time to first step", human_duration(state.time_to_first_step_s())),
            ("steps", f"{state.step}/{state.steps or '?'}")]
    if state.last_loss is not None:
        rows.append(("final training loss", f"{state.last_loss:.4f}"))
    rows.append(("final validation loss", "-" if state.final_val is None else f"{state.final_val:.4f}"))
    rows.append(("best validation loss", "-" if state.best_val is None else f"{state.best_val:.4f}"))
    if state.checkpoints:
        c = state.checkpoints[-1]
        rows.append(("last checkpoint", f"step {c.get('step', '?')}: {c.get('path', '?')}"))
    for name, value in rows:
        job.add_row(name, Text(value))  # values are not markup: a path may hold '[...]'
    return Group(Text(f"zerorun · {state.name} · summary", style="bold"), ranks, job)


class LiveView:
    """The live dashboard on ``console`` (a terminal), redrawn ``refresh_per_second`` times a second by rich's
    own thread; events and lines only update the :class:`JobState` (under a lock, so a redraw never sees it
    half-changed). Once a second is enough for people and keeps the launcher's share of the CPU, which it
    shares with the ranks on the first host, small: a frame costs about 10 ms of CPU with a few ranks
    (``benchmarks/telemetry_overhead.py``)."""

    def __init__(self, state: JobState, console: Console, refresh_per_second: float = 1) -> None:
        self.state, self.console = state, console
        self._lock = threading.Lock()
        self.live = Live(console=console, get_renderable=self._render, refresh_per_second=refresh_per_second,
                         redirect_stdout=False, redirect_stderr=False)
        self.live.start()

    def _render(self):
        with self._lock:
            return render(self.state, height=self.console.size.height)

    def event(self, e: Event) -> None:
        with self._lock:
            self.state.update(e)
        milestone = e.kind in ("eval", "checkpoint") or (e.kind in ("model_ready", "log") and e.rank == 0)
        if milestone or (e.kind == "error" and not e.data.get("user_error")):  # user errors: the launcher's line
            for line in describe(e):  # milestones also go to the scrollback above the live view
                self.print(line)

    def line(self, node_rank: int, line: str) -> None:
        with self._lock:
            self.state.add_line(node_rank, line)

    def print(self, text: str) -> None:
        self.console.print(Text(text))

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


def print_summary(state: JobState, out: TextIO | None = None, console: Console | None = None) -> None:
    """Print :func:`summary` on ``console``, or on ``out`` at the terminal's width, or in 160 columns of plain
    text into a file or pipe (rich would assume 80 and squeeze the table). A job that never sent an event
    has nothing to sum up: nothing is printed. An unfinished ``state`` is ended now."""
    if state.ended is None:
        state.end()
    if state.received:
        (console or Console(file=out, width=None if out.isatty() else 160)).print(summary(state))
