"""Telemetry events: one JSON object per line on a rank's stdout, behind the fixed prefix ``@zerorun ``.

Workers call :func:`emit`; the launcher calls :func:`parse_line` on every line it reads from a node, local
or remote, so both paths are the same. Schema (version :data:`SCHEMA_VERSION`): every event has ``v``
(schema version), ``event`` (kind, one of :data:`KINDS`), ``rank``, ``time`` (Unix seconds) and kind-specific
fields. Units are in the names: ``_s`` seconds, ``_bytes`` bytes, ``_per_s`` per second.

- ``start``: ``host``, ``pid``, ``torch`` (version), ``device``, ``world_size``, ``local_rank``,
  ``host_mem_bytes``, ``host_mem_used_bytes``, and on CUDA the ``cuda_*_bytes`` fields below.
- ``model_ready``: ``params`` (all parameters), ``trainable`` (Ψ managed by the engine), ``stage``,
  ``model_state_bytes`` (``{"params", "grads", "optimizer"}`` bytes this rank holds), ``units`` (stage 3).
- ``step`` (every ``log.every`` steps, and the first and last): ``step``, ``steps`` (total), ``loss`` (the
  job-wide mean over the micro-steps since the previous step event: Note [Values read at log steps] in
  ``steplog.py``), ``lr``, ``grad_norm`` (global, before clipping, of this step), ``step_time_s`` (this
  rank's mean over the ``interval_steps`` since the previous step event), ``samples_per_s``,
  ``tokens_per_s`` (this rank, from it), ``job_samples_per_s``, ``job_tokens_per_s`` (world size x this
  rank's), ``tflops``, ``job_tflops`` (achieved model TFLOP/s, see ``probes.flops_per_token``),
  ``rss_bytes``, ``peak_rss_bytes``, ``model_state_bytes``,
  ``host_mem_bytes``, ``host_mem_used_bytes``; ``comm_bytes`` (bytes sent), ``comm_bytes_inter_node`` (bytes,
  of them to ranks on other nodes, counted as if each rank sent each piece straight to the ranks that need it:
  ZeRO++'s direct accounting, Note [Nodes of a group] in ``zero/topology.py``; 0 on one node) and
  ``comm_wait_s`` (waited in collectives) in total over the ``interval_steps`` steps since the previous step
  event, which took ``interval_s`` of training time; ``telemetry_s``: seconds spent on telemetry since the
  previous step event (measuring, the loss all-reduce, writing); written one step late (Note [Deferred
  loss]); on CUDA ``cuda_allocated_bytes``, ``cuda_reserved_bytes``, ``cuda_peak_bytes``,
  ``cuda_total_bytes``; ``loss_scale`` (fp16, else null), ``skipped`` (this step was skipped on an fp16
  overflow), ``skipped_steps``; ``comm_bytes_inter_node`` and ``comm_wait_s`` are null for the DDP/FSDP2
  baselines (not observed); ``cpu_percent`` (this rank's process, 100 = one core busy) and
  ``host_cpu_percent`` (the whole host, all cores: 100 = every core busy) since the previous step event; on
  CUDA with nvidia-ml-py ``gpu_util_percent`` (``torch.cuda.utilization``).
- ``progress`` (rank 0, after every step that ends at least ``steplog.PROGRESS_EVERY_S`` after the previous
  progress event, and the last step): ``step``, ``steps`` (total); ``time`` is when the step ended. A few
  dozen bytes, so the launcher's step count, progress bar and ETA move with every step it redraws, not only
  every ``log.every`` steps. Not written to metrics.jsonl (the step events hold everything it says).
- ``eval`` (rank 0): ``step``, ``val_loss``, ``samples``.
- ``checkpoint``: ``step``, ``path``, ``seconds``, ``bytes``.
- ``finish``: ``steps``, ``elapsed_s``, ``time_to_first_step_s``, ``peak_rss_bytes`` (and ``cuda_*``).
- ``stopped`` (every rank, on SIGTERM with ``checkpoint.dir``, zerorun/rank/stopsignal.py): ``step``, ``steps``,
  ``signal``, ``path`` (the checkpoint saved, also in a ``checkpoint`` event from rank 0), ``signalled_rank``
  (the lowest rank that got the signal).
- ``log`` (rank 0): ``message``, a line for people (e.g. where training resumed from); ``resumed_step`` with
  the line of a resume (the checkpoint's step).
- ``phase`` (every rank, before it trains): ``phase``, what the rank starts doing now, one of
  ``telemetry.phases.PHASES`` (importing torch, joining the process group, building the model, ...): the
  launcher says what the slowest rank is doing while it waits for the first step (Note [Rank phases]).
- ``restart`` (the launcher's, as rank 0's; only in metrics.jsonl, between two tries of the job: Note [Job
  restarts] in launch/restart.py): ``attempt`` (1 for the first restart), ``max_restarts``, ``cause`` (the
  failure's one line), ``failed_step`` (the last step the failed try reached), ``resume_step`` and
  ``checkpoint`` (the checkpoint the next try resumes from; 0 and null: step 0).
- ``error``: ``type``, ``message``, ``user_error``, and for crashes ``traceback`` (its last lines),
  ``where`` (file:line in function), ``peer_failure``.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

PREFIX = "@zerorun "
SCHEMA_VERSION = 1
KINDS = frozenset({"start", "model_ready", "step", "progress", "eval", "checkpoint", "finish", "error", "log",
                   "stopped", "phase", "restart"})

_lock = threading.Lock()


@dataclass
class Event:
    """A parsed telemetry event: ``kind``, ``rank`` and the remaining fields in ``data``."""

    kind: str
    rank: int
    time: float
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The event as one JSON-ready dict (the form written to metrics.jsonl)."""
        return {"v": SCHEMA_VERSION, "event": self.kind, "rank": self.rank, "time": self.time, **self.data}


def format_event(kind: str, rank: int, **data: Any) -> str:
    """The telemetry line (without newline) for an event of ``kind`` from ``rank``."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    payload = {"v": SCHEMA_VERSION, "event": kind, "rank": rank, "time": round(time.time(), 3), **data}
    return PREFIX + json.dumps(payload, separators=(",", ":"), default=str)


def emit(kind: str, rank: int, stream: TextIO | None = None, **data: Any) -> None:
    """Write one event line to ``stream`` (default: the real stdout) in a single write, then flush, so lines
    of different ranks sharing one pipe never interleave."""
    line = format_event(kind, rank, **data) + "\n"
    out = stream or sys.__stdout__
    with _lock:
        out.write(line)
        out.flush()


def parse_line(line: str) -> Event | None:
    """The :class:`Event` on ``line``, or ``None`` when the line is not a well-formed event (ordinary output,
    a truncated or malformed JSON object, an unknown schema version or kind): such lines are logs."""
    start = line.find(PREFIX)
    if start < 0:
        return None
    return from_json(line[start + len(PREFIX):])


def from_json(text: str) -> Event | None:
    """The :class:`Event` in one JSON object ``text`` (a line of metrics.jsonl, or an event line after its
    prefix), or ``None`` when it is not a well-formed event of this schema version."""
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(payload, dict) or payload.get("v") != SCHEMA_VERSION:
        return None
    kind, rank, when = payload.pop("event", None), payload.pop("rank", None), payload.pop("time", 0.0)
    payload.pop("v")
    if kind not in KINDS or not isinstance(rank, int) or not isinstance(when, (int, float)):
        return None
    return Event(kind, rank, float(when), payload)


def number(data: dict, key: str) -> float | None:
    """``data[key]`` as a float, or ``None`` when it is missing or not a number (booleans are not numbers)."""
    v = data.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def integer(data: dict, key: str) -> int | None:
    """``data[key]`` as an int (truncated), or ``None`` like :func:`number` and for an infinity or NaN (a
    hand-edited ``1e400``)."""
    v = number(data, key)
    return int(v) if v is not None and math.isfinite(v) else None
