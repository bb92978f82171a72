"""The public telemetry call for users' own scripts (``zerorun launch script.py``): one line per logged step.

::

    import zerorun
    for step in range(1, steps + 1):
        loss = train_step(batch)
        zerorun.report(step, loss.item(), steps=steps, samples=batch_size)
"""

from __future__ import annotations

import os
import time
from typing import Any

from zerorun.telemetry.events import emit

_last: dict[str, float] = {}


def report(step: int, loss: float, *, steps: int | None = None, samples: int | None = None,
           tokens: int | None = None, **metrics: Any) -> None:
    """Emit a ``step`` event from this rank (``$RANK``) to the launcher (telemetry/events.py).

    Args:
        step: the step just finished (counting from 1).
        loss: its loss (a float; the caller chooses whether it is this rank's or the job's mean).
        steps: total steps, for progress.
        samples / tokens: samples and tokens one step processes on this rank; with them the event carries
            ``samples_per_s`` / ``tokens_per_s`` and the job-wide rates (times ``$WORLD_SIZE``).
        metrics: more JSON-ready fields, e.g. ``lr=3e-4, grad_norm=0.8``.

    The event also carries ``step_time_s`` (seconds per step since the previous report, or since the first
    call to this function), ``rss_bytes`` and ``peak_rss_bytes`` of this process.
    """
    now = time.perf_counter()
    prev_time, prev_step = _last.get("time", now), _last.get("step", step - 1)
    _last.update(time=now, step=step)
    fields: dict[str, Any] = {"step": step, "loss": float(loss)}
    if steps is not None:
        fields["steps"] = steps
    n = max(1, step - prev_step)
    if now > prev_time:
        step_s = (now - prev_time) / n
        world = int(os.environ.get("WORLD_SIZE", 1))
        fields["step_time_s"] = step_s
        for name, count in (("samples", samples), ("tokens", tokens)):
            if count is not None:
                fields[f"{name}_per_s"] = count / step_s
                fields[f"job_{name}_per_s"] = world * count / step_s
    import psutil

    from zerorun.telemetry.probes import peak_rss_bytes  # telemetry takes nothing from rank/ (DESIGN.md)

    fields["rss_bytes"] = psutil.Process().memory_info().rss
    fields["peak_rss_bytes"] = max(peak_rss_bytes(), fields["rss_bytes"])  # Note [Peak RSS] in telemetry/state.py
    emit("step", int(os.environ.get("RANK", 0)), **{**fields, **metrics})
