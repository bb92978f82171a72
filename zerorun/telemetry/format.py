"""Plain-text formatting shared by every view of a job (the live dashboard, the plain progress lines, the
summary, ``zerorun show``): numbers with units, lifecycle events as sentences, and packing phrases into lines.

No rich here and no job state: a leaf module that views import (telemetry/state.py does not need it).
"""

from __future__ import annotations

from typing import Iterable

from zerorun.telemetry.events import Event, integer, number


def human_bytes(n: float) -> str:
    """``n`` bytes as KiB/MiB/GiB (powers of 1024), e.g. ``612.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def count(n: int | str, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``count(1, "rank")`` is ``1 rank``, ``count(4, "node")``
    ``4 nodes``; ``n`` may be a placeholder (``"?"``, plural)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def human_rate(n: float) -> str:
    """A rate with k/M/G suffixes: ``24.3k``, ``1.58G``."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}G"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.1f}"


def human_duration(seconds: float | None) -> str:
    """``seconds`` as ``42 s``, ``3:07`` (m:ss) or ``1:02:03`` (h:mm:ss); ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{s} s"
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


def human_flops(tflops: float) -> str:
    """A TFLOP/s figure in the unit that keeps it readable: ``41.2 TFLOP/s``, ``815 GFLOP/s``, ``3.1 MFLOP/s``."""
    for scale, unit in ((1.0, "TFLOP/s"), (1e-3, "GFLOP/s"), (1e-6, "MFLOP/s")):
        if tflops >= scale:
            return f"{tflops / scale:.3g} {unit}" if tflops / scale < 1000 else f"{tflops / scale:.0f} {unit}"
    return f"{tflops * 1e6:.3g} MFLOP/s"


def seconds(s: float | None) -> str:
    """A short duration: ``150 ms`` below a second, else ``1.25 s``; ``-`` when unknown."""
    if s is None:
        return "-"
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def pct(frac: float | None) -> str:
    """A fraction as a whole percentage (``0.4`` -> ``40%``); ``-`` when unknown."""
    return "-" if frac is None else f"{100 * frac:.0f}%"


def short_bytes(n: float | None) -> str:
    """Bytes in binary units with three significant digits (``409 MiB``, ``8.04 MiB``); ``-`` when unknown."""
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 999.5 or unit == "TiB":
            break
    return f"{n:.0f} {unit}" if abs(n) >= 99.95 else f"{n:.1f} {unit}" if abs(n) >= 9.995 else f"{n:.2f} {unit}"


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], n: int, spread: float = 0.0) -> str:
    """The last ``n`` of ``values`` as a line of block characters, lowest ``▁`` to highest ``█``, scaled
    between their minimum and their maximum, or the minimum times ``1 + spread`` when that is more (so that
    step times within ``spread`` of each other stay low, not spikes); all alike: a flat line of ``▄``; ``""``
    with no values."""
    values = [v for v in values[-n:] if v == v] if n > 0 else []  # NaN: left out
    if not values:
        return ""
    low, high = min(values), max(values)
    if high - low <= 1e-12 * max(1.0, abs(high)):
        return SPARKS[3] * len(values)
    high = max(high, low + spread * abs(low))
    return "".join(SPARKS[min(7, int((v - low) / (high - low) * 8))] for v in values)


def rank_list(ranks: Iterable[int]) -> str:
    """Ranks as ``0-7, 9, 12-15``: runs of consecutive ranks shortened to their ends."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def pack(phrases: Iterable[str], width: int, sep: str = "   ") -> list[str]:
    """``phrases`` joined by ``sep`` into lines of at most ``width`` characters, never splitting a phrase (a
    phrase longer than ``width`` gets a line of its own). Used so that narrow terminals wrap between facts,
    never inside a number and its unit."""
    lines: list[str] = []
    for p in phrases:
        if lines and len(lines[-1]) + len(sep) + len(p) <= width:
            lines[-1] += sep + p
        else:
            lines.append(p)
    return lines


def describe(e: Event) -> list[str]:
    """Human-readable lines for a lifecycle event (start, model_ready, eval, checkpoint, log, finish, error); none
    for step and progress events. Shared by the plain view and the dashboard (its log panel and the scrollback).
    A rank stopped by Ctrl-C (``KeyboardInterrupt``) is one line, not a traceback."""
    d, who = e.data, f"[rank {e.rank}]"
    if e.kind == "start":
        about = ", ".join([f"pid {d.get('pid', '?')}", f"torch {d.get('torch', '?')}"]
                          + ([str(d["device"])] if d.get("device") else []))
        return [f"{who} started on {d.get('host', '?')} ({about})"]
    if e.kind == "model_ready":  # stage 3's units: rank 0's lines before it (zero/unit_plan.py, describe_units)
        params = integer(d, "params")
        return [f"{who} model ready: {params:,} parameters, ZeRO stage {d.get('stage', '?')}" if params is not None
                else f"{who} model ready"]
    if e.kind == "eval":
        v = number(d, "val_loss")
        return [f"eval step {d.get('step', '?')}: validation loss " + (f"{v:.4f}" if v is not None else "?")]
    if e.kind == "checkpoint":
        size, secs = number(d, "bytes"), number(d, "seconds")
        extra = ", ".join(x for x in (human_bytes(size) if size is not None else "",
                                      f"{secs:.1f} s" if secs is not None else "") if x)
        return [f"{who} checkpoint step {d.get('step', '?')}: {d.get('path', '?')}" + (f" ({extra})" if extra else "")]
    if e.kind == "log":
        return [f"{who} {d.get('message', '')}"]
    if e.kind == "finish":
        return [f"{who} finished"]
    if e.kind == "stopped":  # Note [Checkpoint on SIGTERM] in zerorun/rank/stopsignal.py
        return [f"{who} stopped by {d.get('signal', 'a signal')} after step {d.get('step', '?')}"
                + (f"; checkpoint {d['path']}" if d.get("path") else "")]
    if e.kind == "error":
        if d.get("type") == "KeyboardInterrupt":
            return [f"{who} interrupted (Ctrl-C)"]
        if d.get("peer_failure"):  # Note [Blame] in zerorun/launch/blame.py: a consequence, one line
            first = (str(d.get("message", "")).splitlines() or [""])[0].split(". ")[0]  # its first sentence
            return [f"{who} stopped: another rank failed ({d.get('type', 'Error')}: {first[:160]})"]
        lines = [f"{who} error: {d.get('type', 'Error')}: {d.get('message', '')}"]
        if isinstance(d.get("traceback"), str) and not d.get("user_error"):
            lines += [f"{who}   {line}" for line in d["traceback"].splitlines()[-6:]]
        return lines
    return []


def log_lines(entries: Iterable[str | Event]) -> list[str]:
    """The text lines of a job's log tail (``JobState.log``): lines as they are, events through
    :func:`describe`."""
    out: list[str] = []
    for entry in entries:
        out.extend([entry] if isinstance(entry, str) else describe(entry))
    return out
