"""The estimate as a rich table (``zerorun estimate``'s terminal output)."""

from __future__ import annotations

import sys

from zerorun.estimate.report import Estimate
from zerorun.estimate.sizes import format_bytes, format_count
from zerorun.telemetry.format import count


def render(est: Estimate, console=None) -> None:
    """Print ``est`` as rich tables (bytes in binary units, time in seconds) on ``console``, or on standard
    output at the terminal's width, or in 120 columns (``$COLUMNS`` when set) into a file or pipe. The first
    line says whose memory the stages are fitted into (Note [Whose memory] in estimate/hosts.py)."""
    from rich.console import Console
    from rich.markup import escape as e
    from rich.text import Text

    from zerorun.telemetry.layout import output_width

    console = console or Console(width=output_width(sys.stdout, 120))
    s, p = est.setup, est.params
    largest = p["largest_unit"]
    console.print(f"[bold]Memory[/bold] from {e(str(s['memory_source']))}: device {e(str(s['device']))} "
                  f"{format_bytes(s['device_memory'])} per rank, host {format_bytes(s['cpu_memory_per_node'])} "
                  "per node")
    console.print(f"[bold]Model[/bold]: {p['total']:,} parameters ({format_count(p['total'])}): "
                  f"{p['trainable']:,} trainable, {p['frozen']:,} frozen"
                  + (f"; largest unit {e(str(largest['name']))} {largest['params']:,}" if largest else "")
                  + ("" if p["exact_layout"] else " (from --params)"))
    even = s["world_size"] == s["nodes"] * s["procs_per_node"]  # a hostfile's slots may differ by node
    layout = f" x {s['procs_per_node']}" if even else f", up to {s['procs_per_node']} per node"
    console.print(f"[bold]Setup[/bold]: {count(s['world_size'], 'rank')} ({count(s['nodes'], 'node')}{layout}), "
                  f"{e(str(s['precision']))}" + (" (reduce fp32)" if s["reduce_dtype"] != s["precision"] else "")
                  + f", {e(str(s['optimizer']))} ({s['optimizer_states']} states), "
                  f"{s['bandwidth_bytes_per_s'] * 8 / 1e9:g} Gbit/s per rank")
    unit, size = ("GiB", 2**30) if max(r.device_total for r in est.rows) >= 2**30 else ("MiB", 2**20)
    from zerorun.telemetry.layout import Column, render_table

    v = lambda n: f"{n / size:.3g}" if n < 100 * size else f"{n / size:.0f}"  # noqa: E731
    rows = est.rows
    fits = [Text.from_markup(f"[green]yes[/green] {r.headroom / s['device_memory']:.0%}" if r.fits else
                             f"[red]no[/red] {r.headroom / s['device_memory']:.0%}") for r in rows]
    # Note [Fitting the width] in telemetry/layout.py: no number is ever cut; the lowest priority goes first
    columns = [Column("stage", [Text(r.label.replace(" + offload ", "+")) for r in rows], "left"),
               Column("params", [v(r.params) for r in rows], priority=5),
               Column("grads", [v(r.grads + r.grad_accum) for r in rows], priority=6),
               Column("optim", [v(r.optimizer) for r in rows], priority=7),
               Column("states", [v(r.model_states) for r in rows], priority=9),
               Column("working", [v(r.working_set) for r in rows], priority=3),
               Column("activ", [v(r.activations) if est.activations else "-" for r in rows], priority=4),
               Column("total", [v(r.device_total) for r in rows]),
               Column("fits", fits),
               Column("host", [v(r.cpu_per_node) for r in rows], priority=8),
               Column("disk", [v(r.disk_per_node) for r in rows], priority=2),
               Column("sent", [v(r.comm_bytes) for r in rows], priority=1),
               Column("comm", [f"{r.comm_s:.3g} s" for r in rows], priority=0)]
    inter = s["nodes"] > 1 or any(r.comm_bytes_inter_node for r in rows)  # Note [Nodes of a group]
    if inter:
        columns.insert(-1, Column("inter", [v(r.comm_bytes_inter_node) for r in rows], priority=1))
    if any(r.secondary for r in rows):  # zero.hierarchy (Note [Secondary shards])
        columns.insert(5, Column("2nd", [v(r.secondary) for r in rows], priority=5))
    console.print(Text(f"{unit} per rank (host, disk: per node; sent{', inter: to other nodes,' if inter else ':'} "
                       "per step), by ZeRO stage", style="italic"))
    console.print(render_table(columns, console.width))
    a = est.activations
    if a:
        console.print(f"[bold]Activations[/bold] per micro-batch ({s['micro_batch']} x {s['seq_len']} tokens; "
                      f"Korthikanti et al. 2022 §4): {format_bytes(a['total'])} without checkpointing "
                      f"({format_bytes(a['per_layer'])} per layer, {format_bytes(a['attention_scores'])} of it "
                      f"attention scores), {format_bytes(a['checkpointed'])} with activation checkpointing; "
                      + (f"the model declares fused attention, which keeps no scores: "
                         f"{format_bytes(a['total_fused'])} and {format_bytes(a['checkpointed_fused'])}"
                         if a["fused_attention"] else "the model does not declare fused attention"))
    for note in est.notes:
        console.print(Text(f"note: {note}"))
    console.print(f"[bold]Recommendation[/bold]: {e(est.recommendation)}")
