"""The estimate as a rich table (``zerorun estimate``'s terminal output)."""

from __future__ import annotations

from zerorun.estimate.report import Estimate
from zerorun.estimate.sizes import format_bytes, format_count


def render(est: Estimate, console=None) -> None:
    """Print ``est`` as rich tables (bytes in binary units, time in seconds)."""
    from rich.console import Console
    from rich.markup import escape as e
    from rich.table import Table
    from rich.text import Text

    import sys

    from rich import box

    console = console or Console(width=None if sys.stdout.isatty() else 120)
    s, p = est.setup, est.params
    largest = p["largest_unit"]
    console.print(f"[bold]Model[/bold]: {p['total']:,} parameters ({format_count(p['total'])}): "
                  f"{p['trainable']:,} trainable, {p['frozen']:,} frozen"
                  + (f"; largest unit {e(str(largest['name']))} {largest['params']:,}" if largest else "")
                  + ("" if p["exact_layout"] else " (from --params)"))
    console.print(f"[bold]Setup[/bold]: {s['world_size']} ranks ({s['nodes']} nodes x {s['procs_per_node']}), "
                  f"{e(str(s['precision']))}" + (" (reduce fp32)" if s["reduce_dtype"] != s["precision"] else "")
                  + f", {e(str(s['optimizer']))} ({s['optimizer_states']} states), device {e(str(s['device']))} "
                  f"{format_bytes(s['device_memory'])} per rank, host {format_bytes(s['cpu_memory_per_node'])} "
                  f"per node, {s['bandwidth_bytes_per_s'] * 8 / 1e9:g} Gbit/s per rank")
    unit, size = ("GiB", 2**30) if max(r.device_total for r in est.rows) >= 2**30 else ("MiB", 2**20)
    t = Table(title=f"{unit} per rank (host, disk: per node; sent: per step), by ZeRO stage", box=box.SIMPLE_HEAD,
              padding=(0, 1))
    for col in ("stage", "params", "grads", "optim", "states", "working", "activ", "total", "fits", "host",
                "disk", "sent", "comm"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    v = lambda n: f"{n / size:.3g}" if n < 100 * size else f"{n / size:.0f}"  # noqa: E731
    for r in est.rows:
        fits = f"[green]yes[/green] {r.headroom / s['device_memory']:.0%}" if r.fits else \
            f"[red]no[/red] {r.headroom / s['device_memory']:.0%}"
        t.add_row(Text(r.label.replace(" + offload ", "+")), v(r.params), v(r.grads + r.grad_accum), v(r.optimizer), v(r.model_states),
                  v(r.working_set), v(r.activations) if est.activations else "-", v(r.device_total), fits,
                  v(r.cpu_per_node), v(r.disk_per_node), v(r.comm_bytes), f"{r.comm_s:.3g} s")
    console.print(t)
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
