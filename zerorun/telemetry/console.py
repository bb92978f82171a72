"""Plain line-by-line progress for the launcher (the live dashboard builds on the same events), and the run
directory recorder: every event to ``metrics.jsonl``, every line to ``output.log``."""

from __future__ import annotations

import json
import os
from typing import TextIO

from zerorun.telemetry.events import Event


def human_bytes(n: float) -> str:
    """``n`` bytes as KiB/MiB/GiB (powers of 1024), e.g. ``612.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_rate(n: float) -> str:
    """A rate with k/M suffixes: ``24.3k``."""
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.1f}"


class RunRecorder:
    """Writes ``metrics.jsonl`` (one event per line, as emitted) and ``output.log`` in ``run_dir``."""

    def __init__(self, run_dir: str) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
        self.log = open(os.path.join(run_dir, "output.log"), "a", encoding="utf-8")

    def event(self, event: Event) -> None:
        self.metrics.write(json.dumps(event.to_json(), separators=(",", ":")) + "\n")
        self.metrics.flush()

    def line(self, node_rank: int, line: str) -> None:
        self.log.write(f"[node {node_rank}] {line}\n")
        self.log.flush()

    def close(self) -> None:
        self.metrics.close()
        self.log.close()


class PlainView:
    """Readable one-line progress on ``out``: rank 0's step events, evaluations, and every rank's log lines."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.best_val: float | None = None
        self.first_val: float | None = None
        self.last_val: float | None = None

    def event(self, e: Event) -> None:
        d = e.data
        if e.kind == "step" and e.rank == 0:  # fields a user script's zerorun.report() left out are skipped
            parts = [f"step {d['step']:>{len(str(d['steps']))}}/{d['steps']}" if "steps" in d else f"step {d['step']}"]
            for key, show in (("loss", lambda v: f"loss {v:.4f}"), ("lr", lambda v: f"lr {v:.2e}"),
                              ("grad_norm", lambda v: f"grad {v:.3f}"),
                              ("step_time_s", lambda v: f"{v * 1e3:.0f} ms/step"),
                              ("job_samples_per_s", lambda v: f"{human_rate(v)} samples/s"),
                              ("job_tokens_per_s", lambda v: f"{human_rate(v)} tok/s"),
                              ("rss_bytes", lambda v: f"rss {human_bytes(v)}")):
                if isinstance(d.get(key), (int, float)):
                    parts.append(show(d[key]))
            self.print("  ".join(parts))
        elif e.kind == "eval":
            v = d["val_loss"]
            self.first_val = v if self.first_val is None else self.first_val
            self.last_val = v
            self.best_val = v if self.best_val is None else min(self.best_val, v)
            self.print(f"eval step {d['step']}: validation loss {v:.4f}")
        elif e.kind == "model_ready" and e.rank == 0:
            self.print(f"model: {d['params']:,} parameters, ZeRO stage {d['stage']}")
            if d.get("units"):
                units = d["units"]
                shown = ", ".join(units[:6]) + (f", ... ({len(units)} in all)" if len(units) > 6 else "")
                self.print(f"stage 3 units: {shown}")
        elif e.kind == "checkpoint" and e.rank == 0:
            self.print(f"checkpoint step {d['step']}: {d['path']} ({human_bytes(d['bytes'])}, {d['seconds']:.1f} s)")
        elif e.kind == "log" and e.rank == 0:
            self.print(d.get("message", ""))
        elif e.kind == "start" and e.rank == 0:
            self.print(f"{d['world_size']} ranks started (torch {d['torch']}, {d['device']})")
        elif e.kind == "error" and not d.get("user_error"):  # user errors: the launcher's one line says it
            self.print(f"[rank {e.rank}] error: {d.get('type')}: {d.get('message')}")
            if d.get("traceback"):
                for line in d["traceback"].splitlines()[-6:]:
                    self.print(f"[rank {e.rank}]   {line}")

    def line(self, node_rank: int, line: str) -> None:
        if line.startswith("[rank "):
            self.print(line)

    def print(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()
