"""``zerorun bench``'s rows: one :class:`Combination` (hostfile x runtime/stage) per row, and the metrics of its
jobs (Note [Bench metrics]) read from each run folder's ``metrics.jsonl`` and summarized over repeats."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from zerorun import runfolder
from zerorun.bench.args import ZERO_VARIANTS

#: Per-run metrics (Note [Bench metrics]) and their CSV/JSON names, in table order.
METRICS = ("world_size", "step_time_s", "step_time_p90_s", "samples_per_s", "tokens_per_s", "peak_rss_bytes",
           "model_state_bytes", "comm_bytes_per_step", "comm_bytes_inter_node_per_step", "time_to_first_step_s")


@dataclass(frozen=True)
class Combination:
    """One row of the bench: ``hostfile`` (None: localhost with ``launch.procs_per_node`` ranks) and either
    zerorun's runtime at ZeRO ``stage`` or a baseline ``runtime`` (``ddp``/``fsdp2``, ``stage`` None). With
    ``nodes`` (``zerorun bench --nodes`` in a SLURM allocation), the job runs on the allocation's first
    ``nodes`` nodes through the slurm launcher and ``hostfile`` only names them (``2 nodes``)."""

    hostfile: str | None
    runtime: str
    stage: int | None = None
    nodes: int | None = None
    variant: str | None = None  # stage 3: a ZeRO++ variant of --zero-variants (ZERO_VARIANTS in args.py)
    name: str | None = field(default=None, compare=False)  # the hostfile as tables say it (run.combinations)

    @property
    def host_name(self) -> str:
        """The hostfile's file name in tables and progress lines (its path where two hostfiles share the name)."""
        return self.name or (os.path.basename(self.hostfile) if self.hostfile else "localhost")

    @property
    def label(self) -> str:
        """``stage 2``, ``stage 3 hpz``, ``ddp`` or ``fsdp2``."""
        if self.runtime != "zero":
            return self.runtime
        return f"stage {self.stage}" + (f" {self.variant}" if self.variant else "")

    def overrides(self, steps: int) -> list[str]:
        """Recipe overrides for this combination's job of ``steps`` optimizer steps: the runtime and stage,
        a step event every step, no evaluation, no checkpoints. ``zero.units`` is cleared where the recipe does not allow
        it (zerorun stages 0-2 and DDP; FSDP2 shards the recipe's units, as stage 3 does), and
        ``zero.persistence_threshold`` everywhere but zerorun's stage 3."""
        out = [f"train.steps={steps}", "log.every=1", "train.eval_every=0", f"runtime={self.runtime}",
               "checkpoint.every=0", "checkpoint.dir=null"]
        if self.runtime == "zero":
            out.append(f"zero.stage={self.stage}")
            out += ZERO_VARIANTS[self.variant] if self.variant else []
        if self.runtime == "ddp" or (self.runtime == "zero" and self.stage != 3):
            out.append("zero.units=[]")
        if not (self.runtime == "zero" and self.stage == 3):
            out.append("zero.persistence_threshold=0")
        return out


@dataclass
class Row:
    """The result of one combination: ``status`` pending | running | ok | failed | interrupted (Ctrl-C or SIGTERM
    while it ran), the failure ``reason``, the per-run metrics
    ``runs`` (one dict of :data:`METRICS` per successful repeat), the job run directories, and after
    :func:`summarize` the aggregated ``metrics`` (name -> ``{"median", "min", "max"}``) and relative numbers."""

    combo: Combination
    status: str = "pending"
    reason: str | None = None
    runs: list[dict[str, float]] = field(default_factory=list)
    run_dirs: list[str] = field(default_factory=list)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    scaling_efficiency: float | None = None
    time_vs: dict[str, float] = field(default_factory=dict)

    def value(self, name: str) -> float | None:
        """The median over repeats of metric ``name``, or None."""
        m = self.metrics.get(name)
        return None if m is None else m["median"]

    def to_json(self) -> dict[str, Any]:
        c = self.combo
        return {"hostfile": c.hostfile, "nodes": c.nodes, "runtime": c.runtime, "stage": c.stage,
                "variant": c.variant, "label": c.label,
                "status": self.status, "reason": self.reason, "metrics": self.metrics,
                "scaling_efficiency": self.scaling_efficiency,
                **{f"time_vs_{b}": v for b, v in self.time_vs.items()}, "runs": self.runs, "run_dirs": self.run_dirs}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by the nearest-rank method (the smallest value with at least
    ``q`` of the values at or below it)."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 1)) - 1))
    return ordered[k]


def measure(events: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Note [Bench metrics]: the metrics of one job from its telemetry events (``metrics.jsonl`` records).

    Per optimizer step after ``warmup``: the job's step time is the slowest rank's ``step_time_s`` (seconds);
    the step's samples and tokens are summed over ranks (each rank's rate times its step time). Reported:
    ``step_time_s`` (median) and ``step_time_p90_s`` (nearest-rank p90) over steps; ``samples_per_s`` and
    ``tokens_per_s`` of the whole job at the median step time; ``peak_rss_bytes``, the largest peak RSS of any
    rank (bytes; ``ru_maxrss``, or the current RSS where that is larger); ``model_state_bytes``, the largest params + grads + optimizer-state bytes any rank holds;
    ``comm_bytes_per_step``, the median over steps of the largest bytes any rank sent in the step (ring
    formulas, ZeRO paper §7); ``comm_bytes_inter_node_per_step``, the same of the bytes sent to ranks on other
    nodes (``comm_bytes_inter_node``: Note [Nodes of a group] in zero/topology.py; None where a step event has
    none: the DDP/FSDP2 baselines); ``time_to_first_step_s``, the slowest rank's seconds from its start to the end
    of its first step; ``world_size``.

    Raises:
        ValueError: no step event after the warm-up (the job ran too few steps).
    """
    steps: dict[int, list[dict]] = {}
    peak_rss, states, first_step, world = 0, 0, 0.0, 0
    for e in events:
        kind = e.get("event")
        if kind == "start":
            world = max(world, int(e.get("world_size", 0)))
        elif kind == "step":
            # ru_maxrss is sampled by the kernel and can trail the current RSS: the larger of the two
            peak_rss = max(peak_rss, int(e.get("peak_rss_bytes", 0)), int(e.get("rss_bytes", 0)))
            states = max(states, sum(e.get("model_state_bytes", {}).values()))
            if e["step"] > warmup:
                steps.setdefault(e["step"], []).append(e)
        elif kind == "finish":
            peak_rss = max(peak_rss, int(e.get("peak_rss_bytes", 0)))
            first_step = max(first_step, float(e.get("time_to_first_step_s") or 0.0))
    if not steps:
        raise ValueError(f"no step after the {warmup} warm-up steps in the telemetry")
    times = [max(e["step_time_s"] for e in ranks) for ranks in steps.values()]
    samples = statistics.median(sum(e["samples_per_s"] * e["step_time_s"] for e in ranks) for ranks in steps.values())
    tokens = statistics.median(sum(e["tokens_per_s"] * e["step_time_s"] for e in ranks) for ranks in steps.values())
    median = statistics.median(times)
    return {"world_size": world or len(next(iter(steps.values()))), "step_time_s": median,
            "step_time_p90_s": percentile(times, 0.9), "samples_per_s": samples / median,
            "tokens_per_s": tokens / median, "peak_rss_bytes": peak_rss, "model_state_bytes": states,
            "comm_bytes_per_step": _per_step(steps, "comm_bytes"),
            "comm_bytes_inter_node_per_step": _per_step(steps, "comm_bytes_inter_node"),
            "time_to_first_step_s": first_step}


def _per_step(steps: dict[int, list[dict]], key: str) -> float | None:
    """The median over ``steps`` (their events, every rank's) of the largest ``key`` any rank reported in the
    step; None where an event lacks it (not observed)."""
    if any(e.get(key) is None for ranks in steps.values() for e in ranks):
        return None
    return statistics.median(max(e[key] for e in ranks) for ranks in steps.values())


def _spread(values: list[float | None]) -> dict[str, float] | None:
    """``{"median", "min", "max"}`` of one metric over a row's runs; None where a run did not observe it."""
    if any(v is None for v in values):
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def read_events(run_dir: str) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` (one JSON object per line; a torn last line is skipped)."""
    out = []
    with open(os.path.join(run_dir, runfolder.METRICS), encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def summarize(rows: list[Row]) -> None:
    """Fill each row's ``metrics`` (median, min and max over its runs), its weak-scaling efficiency and its
    step time relative to the baselines of the same hostfile.

    Weak scaling (per-rank micro-batch fixed): efficiency = (samples/s at N ranks / N) / (samples/s at N0 ranks
    / N0), N0 the smallest world size among the successful rows of the same runtime and stage (1.0 there, on every
    hostfile of N0 ranks; the larger ones against the first such hostfile given).
    ``time_vs[b]`` = median step time of the row / median step time of baseline ``b`` on the same hostfile
    (below 1: faster than the baseline).
    """
    for row in rows:
        row.metrics = {name: _spread([r.get(name) for r in row.runs]) for name in METRICS} if row.runs else {}
    measured = [r for r in rows if r.metrics]
    for row in measured:
        same = [r for r in measured if r.combo.label == row.combo.label]
        smallest = min(same, key=lambda r: r.value("world_size"))  # the first hostfile given of that size
        smallest = row if row.value("world_size") == smallest.value("world_size") else smallest
        per_rank = row.value("samples_per_s") / row.value("world_size")
        row.scaling_efficiency = per_rank / (smallest.value("samples_per_s") / smallest.value("world_size"))
        row.time_vs = {}
        if row.combo.runtime == "zero":
            for base in measured:
                if base.combo.runtime != "zero" and base.combo.hostfile == row.combo.hostfile:
                    row.time_vs[base.combo.runtime] = row.value("step_time_s") / base.value("step_time_s")
