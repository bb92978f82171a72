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


def render_table(rows: list[Row], baselines: list[str], repeat: int):
    """The results as a rich Table (medians; ``min-max`` beside step time and samples/s when repeated), with
    the reason of each failed combination below it."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    table = Table(title="zerorun bench", show_lines=False)
    for name in ("hostfile", "ranks", "runtime", "step ms", "p90 ms", "samples/s", "tokens/s", "weak eff.",
                 "peak RSS/rank", "states/rank", "sent/rank/step", "to other nodes", "1st step s", *[f"vs {b}" for b in baselines]):
        table.add_column(name, justify="left" if name in ("hostfile", "runtime") else "right")

    def spread(r: "Row", name: str, fmt: Callable[[float], str]) -> str:
        m = r.metrics[name]
        return fmt(m["median"]) + (f" ({fmt(m['min'])}-{fmt(m['max'])})" if repeat > 1 else "")

    for r in rows:
        host = r.combo.host_name
        if not r.metrics:
            status = {"pending": "[dim]pending[/]", "running": "[yellow]running[/]",
                      "interrupted": "[yellow]interrupted[/]"}.get(r.status, "[red]failed[/]")
            table.add_row(Text(host), "", Text(r.combo.label), status)
            continue
        v = r.value
        cells = [Text(host), str(int(v("world_size"))),
                 escape(r.combo.label) + {"ok": "", "interrupted": " [yellow](interrupted)[/]"}.get(
                     r.status, " [red](failed)[/]"),
                 spread(r, "step_time_s", lambda x: f"{x * 1e3:.0f}"), f"{v('step_time_p90_s') * 1e3:.0f}",
                 spread(r, "samples_per_s", human_rate), human_rate(v("tokens_per_s")),
                 f"{r.scaling_efficiency:.2f}", human_bytes(v("peak_rss_bytes")), human_bytes(v("model_state_bytes")),
                 human_bytes(v("comm_bytes_per_step")), _maybe(v("comm_bytes_inter_node_per_step"), human_bytes),
                 f"{v('time_to_first_step_s'):.1f}"]
        cells += [f"{r.time_vs[b]:.2f}x" if b in r.time_vs else "" for b in baselines]
        table.add_row(*cells)
    reasons = [Text(f"{r.combo.label} on {r.combo.hostfile or 'localhost'} failed: {r.reason}", style="red",
                    no_wrap=True, overflow="ellipsis") for r in rows if r.status == "failed"]
    return Group(table, *reasons)


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
