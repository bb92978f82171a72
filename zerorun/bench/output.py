"""``zerorun bench``'s output: ``bench.json``, ``bench.csv``, ``bench.png``, the live rich table and the Markdown
table (bench/run.py runs the combinations, bench/rows.py measures them)."""

from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Callable

from zerorun.bench.rows import METRICS, Row
from zerorun.errors import ZerorunError
from zerorun.telemetry.console import human_bytes, human_rate


def _atomic_write(path: str, write: Callable[[io.TextIOBase], None]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        write(f)
    os.replace(tmp, path)


def write_json(path: str, rows: list[Row], info: dict[str, Any]) -> None:
    """``bench.json``: ``info`` (command, recipe, steps, ...) and one record per combination."""
    _atomic_write(path, lambda f: json.dump({**info, "rows": [r.to_json() for r in rows]}, f, indent=1))


def write_csv(path: str, rows: list[Row], baselines: list[str]) -> None:
    """``bench.csv``: one line per combination; each metric as its median with ``_min`` and ``_max``."""
    header = ["hostfile", "runtime", "stage", "variant", "status", "reason"]
    for name in METRICS:
        header += [name, f"{name}_min", f"{name}_max"]
    header += ["scaling_efficiency"] + [f"time_vs_{b}" for b in baselines]

    def write(f):
        w = csv.writer(f)
        w.writerow(header)
        for r in rows:
            line = [r.combo.hostfile or "localhost", r.combo.runtime, "" if r.combo.stage is None else r.combo.stage,
                    r.combo.variant or "", r.status, r.reason or ""]
            for name in METRICS:
                m = r.metrics.get(name)
                line += [m["median"], m["min"], m["max"]] if m else ["", "", ""]
            line += ["" if r.scaling_efficiency is None else r.scaling_efficiency]
            line += [r.time_vs.get(b, "") for b in baselines]
            w.writerow(line)

    _atomic_write(path, write)


def _maybe(value: float | None, fmt: Callable[[float], str]) -> str:
    """``fmt(value)``, or ``-`` where the metric was not observed (the baselines' bytes to other nodes)."""
    return "-" if value is None else fmt(value)


def write_png(path: str, rows: list[Row]) -> None:
    """``bench.png``: job samples/s and peak RSS per rank, grouped by runtime/stage, one bar per hostfile.

    Raises:
        ZerorunError: matplotlib is not installed (``pip install 'zerorun[plot]'``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ZerorunError("bench.png needs matplotlib, which is not importable here: pip install 'zerorun[plot]' "
                           "(bench.json and bench.csv are written)") from None
    measured = [r for r in rows if r.metrics]
    labels = list(dict.fromkeys(r.combo.label for r in rows))
    hosts = list(dict.fromkeys(r.combo.hostfile for r in rows))
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    width = 0.8 / max(1, len(hosts))
    for ax, (metric, scale, title) in zip(axes, (("samples_per_s", 1, "job throughput (samples/s)"),
                                                 ("peak_rss_bytes", 2**20, "peak RSS per rank (MiB)"))):
        for i, host in enumerate(hosts):
            xs, ys, lo, hi = [], [], [], []
            for x, label in enumerate(labels):
                r = next((r for r in rows if r.combo.label == label and r.combo.hostfile == host), None)
                if r is not None and not r.metrics and r.status == "failed":
                    ax.text(x + (i - (len(hosts) - 1) / 2) * width, 0, "failed", rotation=90, ha="center",
                            va="bottom", color="red", fontsize=8)
                elif r is not None and r.metrics:
                    m = r.metrics[metric]
                    xs.append(x + (i - (len(hosts) - 1) / 2) * width)
                    ys.append(m["median"] / scale)
                    lo.append((m["median"] - m["min"]) / scale)
                    hi.append((m["max"] - m["median"]) / scale)
            world = next((int(r.value("world_size")) for r in measured if r.combo.hostfile == host), None)
            name = next(r.combo.host_name for r in rows if r.combo.hostfile == host) + \
                (f" ({world} rank{'s' * (world != 1)})" if world else "")
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=name)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def render_table(rows: list[Row], baselines: list[str], repeat: int, width: int = 220, chosen: dict | None = None):
    """The results as a table fitted to ``width`` columns (medians; ``min-max`` beside step time and samples/s
    when repeated), with the reason of each failed combination below it. It cuts no value: the columns of least
    use go first where they do not fit (Note [Fitting the width] in telemetry/layout.py; rich's table cut every
    cell to ``…`` at 80 columns, the ratios included: a review); ``chosen``: the live view's memory of them."""
    from rich.console import Group
    from rich.text import Text

    from zerorun.telemetry.layout import Column, render_table as fitted

    def spread(r: "Row", name: str, fmt: Callable[[float], str]) -> str:
        m = r.metrics[name]
        return fmt(m["median"]) + (f" ({fmt(m['min'])}-{fmt(m['max'])})" if repeat > 1 else "")

    def column(header: str, value: Callable[["Row"], str], priority: int | None = None) -> Column:
        return Column(header, [value(r) if r.metrics else "" for r in rows], priority=priority)

    def runtime(r: "Row") -> Text:
        said = {"ok": "", "interrupted": " (interrupted)", "pending": " pending", "running": " running"}.get(
            r.status, " (failed)" if r.metrics else " failed")
        return Text(r.combo.label) + Text(said, style="red" if "failed" in said else "yellow")

    columns = [
        column("ranks", lambda r: str(int(r.value("world_size"))), 3),
        Column("runtime", [runtime(r) for r in rows], justify="left"),
        column("step ms", lambda r: spread(r, "step_time_s", lambda x: f"{x * 1e3:.0f}")),
        column("p90 ms", lambda r: f"{r.value('step_time_p90_s') * 1e3:.0f}", 1),
        column("samples/s", lambda r: spread(r, "samples_per_s", human_rate)),
        column("tokens/s", lambda r: human_rate(r.value("tokens_per_s")), 2),
        column("weak eff.", lambda r: f"{r.scaling_efficiency:.2f}", 1),
        column("peak RSS\n/rank", lambda r: human_bytes(r.value("peak_rss_bytes")), 4),
        column("states\n/rank", lambda r: human_bytes(r.value("model_state_bytes")), 2),
        column("sent/rank\n/step", lambda r: human_bytes(r.value("comm_bytes_per_step")), 3),
        column("to other\nnodes", lambda r: _maybe(r.value("comm_bytes_inter_node_per_step"), human_bytes), 1),
        column("1st step s", lambda r: f"{r.value('time_to_first_step_s'):.1f}", 0),
        *[column(f"vs {b}", lambda r, b=b: f"{r.time_vs[b]:.2f}x" if b in r.time_vs else "") for b in baselines]]
    hosts: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        hosts.setdefault(r.combo.host_name, []).append(i)
    table = fitted(columns, width, groups=list(hosts.items()), chosen=chosen,
                   host=Column("hostfile", [Text(r.combo.host_name) for r in rows], justify="left", priority=0))
    reasons = [Text(f"{r.combo.label} on {r.combo.hostfile or 'localhost'} failed: {r.reason}", style="red",
                    no_wrap=True, overflow="ellipsis") for r in rows if r.status == "failed"]
    return Group(Text("zerorun bench", style="bold"), table, *reasons)


def markdown_table(rows: list[Row], baselines: list[str]) -> str:
    """The results as a Markdown table (medians), for READMEs and reports."""
    head = ["hostfile", "ranks", "runtime", "median step (ms)", "p90 (ms)", "samples/s", "tokens/s", "weak eff.",
            "peak RSS/rank (MiB)", "model states/rank (MiB)", "sent/rank/step (MiB)", "to other nodes (MiB)",
            "1st step (s)",
            *[f"time vs {b}" for b in baselines]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        host = r.combo.host_name
        if not r.metrics:  # a combination not run (the bench interrupted) is no failure
            reason = (r.reason or "").split(" (logs: ")[0]
            said = {"failed": f"failed: {reason}", "interrupted": "interrupted"}.get(r.status, f"not run ({r.status})")
            lines.append(f"| {host} | | {r.combo.label} | {said} |" + " |" * (len(head) - 4))
            continue
        v = r.value
        cells = [host, str(int(v("world_size"))), r.combo.label, f"{v('step_time_s') * 1e3:.0f}",
                 f"{v('step_time_p90_s') * 1e3:.0f}", f"{v('samples_per_s'):.1f}", f"{v('tokens_per_s'):.0f}",
                 f"{r.scaling_efficiency:.2f}", f"{v('peak_rss_bytes') / 2**20:.0f}",
                 f"{v('model_state_bytes') / 2**20:.2f}", f"{v('comm_bytes_per_step') / 2**20:.2f}",
                 _maybe(v("comm_bytes_inter_node_per_step"), lambda b: f"{b / 2**20:.2f}"),
                 f"{v('time_to_first_step_s'):.1f}"]
        cells += [f"{r.time_vs[b]:.2f}x" if b in r.time_vs else "" for b in baselines]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
