"""The end-of-job summary (printed when a job ends and by ``zerorun show``): per rank peak memory and mean
throughput, then the job's totals and losses, laid out for the terminal's width (Note [Fitting the width] in
telemetry/layout.py)."""

from __future__ import annotations

from typing import TextIO

from rich.console import Console, Group
from rich.text import Text

from zerorun.telemetry.format import human_duration, human_rate, pct, rank_list, seconds, short_bytes
from zerorun.telemetry.layout import Column, output_width, render_table
from zerorun.telemetry.state import JobState, RankState

PLAIN_WIDTH = 160  # columns of the summary written to a file or pipe


def host_groups(ranks: list[RankState]) -> list[tuple[str, list[int]]] | None:
    """``(heading, row indices)`` per host for :func:`layout.render_table` when the ranks run on more than one
    host (rows in rank order); ``None`` for one host (the job header names it)."""
    hosts: dict[str, list[int]] = {}
    for i, r in enumerate(ranks):
        hosts.setdefault(r.host or "?", []).append(i)
    if len(hosts) < 2:
        return None
    return [(f"{host}: rank{'s' * (len(rows) > 1)} {rank_list(ranks[i].rank for i in rows)}", rows)
            for host, rows in hosts.items()]


def rank_columns(ranks: list[RankState], nodes: int = 1) -> list[Column]:
    """The summary's per-rank columns, highest priority kept longest: the mean bytes sent per step, and of them
    to other nodes where the job ran on more than one of its ``nodes`` or any rank sent some there."""
    def mean(r: RankState, total: float | None) -> str:
        return f"{human_rate(total / r.train_s)}/s" if r.train_s and total is not None else "-"

    def states(r: RankState, keys=("params", "grads", "optimizer")) -> str:
        ms = r.model_state_bytes
        return "/".join(short_bytes(ms.get(k)) for k in keys) if ms else "-"

    cuda = any(r.cuda for r in ranks)
    cols = [Column("rank", [str(r.rank) for r in ranks]),
            Column("status", [r.status for r in ranks], justify="left"),
            Column("steps", [str(r.step) for r in ranks]),
            Column("peak\nRSS", [short_bytes(r.peak_rss_bytes) for r in ranks], priority=7),
            Column("model states\nparams/grads/optim", [states(r) for r in ranks], priority=4,
                   alt=Column("model\nstates", [short_bytes(r.model_state_total) for r in ranks], priority=4))]
    if cuda:
        cols.append(Column("peak\ndevice", [short_bytes(r.cuda.get("cuda_peak_bytes")) for r in ranks], priority=6))
    cols += [Column("mean\nsamples/s", [mean(r, r.samples) for r in ranks], priority=5),
             Column("mean\ntokens/s", [mean(r, r.tokens) for r in ranks], priority=3),
             Column("mean\nstep", [seconds(r.train_s / r.train_steps if r.train_steps else None) for r in ranks],
                    priority=8),
             Column("comm\nwait", [pct(r.comm_wait_s / r.train_s if r.train_s else None) for r in ranks], priority=2),
             Column("sent\nper step", [short_bytes(r.comm.sent_per_step) for r in ranks], priority=2)]
    if nodes > 1 or any(r.comm.inter_node for r in ranks):  # Note [Nodes of a group] in zero/topology.py
        cols.append(Column("to other\nnodes", [short_bytes(r.comm.inter_node_per_step) for r in ranks], priority=2))
    per_event = [seconds(r.telemetry_s / r.telemetry_events if r.telemetry_events else None) for r in ranks]
    cols.append(Column("telemetry\nper event", per_event, priority=1))
    return cols


def summary(state: JobState, width: int = PLAIN_WIDTH) -> Group:
    """The end-of-job tables for ``state``, fitting ``width`` columns of terminal."""
    ranks = sorted(state.ranks.values(), key=lambda r: r.rank)
    nodes = max(len(state.hosts), len({r.host for r in ranks if r.host}))
    table = render_table(rank_columns(ranks, nodes), width, groups=host_groups(ranks),
                         host=Column("host", [r.host or "?" for r in ranks], justify="left", priority=0))
    rows = [("total time", human_duration(state.elapsed_s())),
            ("time to first step", human_duration(state.time_to_first_step_s())),
            ("steps", f"{state.step}/{state.steps or '?'}")]
    if state.resumed_step is not None:  # a review: a resumed job's summary read as if it had trained every step
        rows.append(("resumed from", f"step {state.resumed_step} ({max(0, state.step - state.resumed_step)} steps "
                                     "trained by this job)"))
    if state.skipped_steps:
        rows.append(("skipped steps", f"{state.skipped_steps} of {state.step} (fp16 overflow: the model was not "
                                      "updated at them)"))
    if state.restarts:
        rows.append(("restarts", f"{state.restarts} (after a failure; from the last checkpoint)"))
    if state.last_loss is not None:
        rows.append(("final training loss", f"{state.last_loss:.4f}"))
    rows.append(("final validation loss", "-" if state.final_val is None else f"{state.final_val:.4f}"))
    rows.append(("best validation loss", "-" if state.best_val is None else f"{state.best_val:.4f}"))
    if state.checkpoints:
        c = state.checkpoints[-1]
        rows.append(("last checkpoint", f"step {c.get('step', '?')}: {c.get('path', '?')}"))
    return Group(Text(f"zerorun · {state.name} · summary", style="bold"), Text("per rank", style="italic"), table,
                 Text(""), *key_values(rows, width))


def key_values(rows: list[tuple[str, str]], width: int) -> list[Text]:
    """``name  value`` lines, names bold in one column; a value that does not fit beside its name goes on the
    next line, indented (values are not markup: a path may hold ``[...]``)."""
    pad = max((len(name) for name, _ in rows), default=0) + 2
    lines = []
    for name, value in rows:
        if pad + len(value) <= width:
            lines.append(Text.assemble((name.ljust(pad), "bold"), value))
        else:
            lines += [Text(name, style="bold"), Text("  " + value, overflow="fold")]
    return lines


def print_summary(state: JobState, out: TextIO | None = None, console: Console | None = None) -> None:
    """Print :func:`summary` on ``console``, or on ``out`` at the terminal's width, or in :data:`PLAIN_WIDTH`
    columns (``$COLUMNS`` when set: :func:`~zerorun.telemetry.layout.output_width`) of plain text into a file or
    pipe. A job that never sent an event has nothing to sum up: nothing is
    printed. An unfinished ``state`` is ended now."""
    if state.ended is None:
        state.end()
    if state.received:
        console = console or Console(file=out, width=output_width(out, PLAIN_WIDTH))
        console.print(summary(state, console.size.width))
