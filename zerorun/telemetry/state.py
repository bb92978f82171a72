"""The launcher's picture of a job, folded from telemetry events: what the live dashboard, the plain progress
lines and ``zerorun show`` all display.

No rich here and nothing that can raise on a strange event: a well-formed event whose fields have unexpected
types (a newer worker, a hand-written line) only leaves the affected values unknown (``None``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from zerorun.telemetry.commtotals import CommTotals
from zerorun.telemetry.events import Event, integer, number
from zerorun.telemetry.logtail import LogTail

STRAGGLER_RATIO = 1.10  # busy time per step this much above the other ranks' median marks the straggler
MEMORY_ALERT = 0.90  # fraction of host (or device) memory in use above which a rank is marked
TREND = 64  # losses and step times kept per rank for the dashboard's trends


@dataclass
class RankState:
    """The latest values one rank reported (``None``: not reported yet) and its run totals.

    Units: ``*_s`` seconds, ``*_bytes`` bytes, rates per second; ``comm_wait`` is the fraction of training
    time spent waiting in collectives over the last logged interval.
    """

    rank: int
    host: str | None = None
    status: str = "starting"
    step: int = 0
    loss: float | None = None
    step_time_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    comm_wait: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    cpu_percent: float | None = None  # this rank's process (100: one core), host_*: the whole host (100: all)
    host_cpu_percent: float | None = None
    gpu_util_percent: float | None = None
    trends: dict[str, list[float]] = field(default_factory=dict)  # loss, step_time_s: the last TREND, oldest first
    phase: str | None = None  # Note [Rank phases] in telemetry/phases.py; phase_time: when it began (Unix s)
    phase_time: float | None = None
    rss_bytes: int | None = None
    peak_rss_bytes: int | None = None
    host_mem_bytes: int | None = None
    host_mem_used_bytes: int | None = None
    model_state_bytes: dict[str, int] = field(default_factory=dict)
    cuda: dict[str, int] = field(default_factory=dict)
    # run totals over every logged interval, for the summary's means (samples, tokens: None until reported)
    train_s: float = 0.0
    train_steps: int = 0
    samples: float | None = None
    tokens: float | None = None
    comm_wait_s: float = 0.0
    comm: CommTotals = field(default_factory=CommTotals)  # bytes sent, per step in the summary
    telemetry_s: float = 0.0
    telemetry_events: int = 0
    first_step_time: float | None = None

    @property
    def busy_s(self) -> float | None:
        """Seconds per step this rank computed rather than waited for its peers: the straggler's is longest."""
        if self.step_time_s is None:
            return None
        return self.step_time_s * (1.0 - (self.comm_wait or 0.0))

    @property
    def host_mem_frac(self) -> float | None:
        """Fraction of the host's memory in use (by every process on it)."""
        if not self.host_mem_bytes or self.host_mem_used_bytes is None:
            return None
        return self.host_mem_used_bytes / self.host_mem_bytes

    @property
    def memory_frac(self) -> float | None:
        """The highest of: host memory in use, this rank's RSS, this rank's CUDA reserved memory, each as a
        fraction of its host's (device's) total."""
        fracs = [self.host_mem_frac]
        if self.host_mem_bytes and self.rss_bytes is not None:
            fracs.append(self.rss_bytes / self.host_mem_bytes)
        if self.cuda.get("cuda_total_bytes") and "cuda_reserved_bytes" in self.cuda:
            fracs.append(self.cuda["cuda_reserved_bytes"] / self.cuda["cuda_total_bytes"])
        known = [f for f in fracs if f is not None]
        return max(known) if known else None

    @property
    def model_state_total(self) -> int | None:
        return sum(self.model_state_bytes.values()) if self.model_state_bytes else None


class JobState:
    """Everything known about a job: the launcher's plan (``name``, ``stage``, ``precision``, ``world_size``,
    ``hosts`` as ``"host x slots"`` strings, ``steps``), one :class:`RankState` per rank, evaluations,
    checkpoints, and the last ``log_lines`` entries of all ranks' log (a :class:`LogTail`: lines and lifecycle
    events; ``format.log_lines`` gives their text). ``started`` is the job's start (Unix s).

    Note [Job progress]: the job's step and ETA come from the newest step any event reported: rank 0's
    ``progress`` events (about every step, telemetry/events.py) and every rank's ``step`` events (every
    ``log.every`` steps); ``progress`` is the pair (step, Unix s when it ended), ``first_progress`` the first
    such pair. The ETA is the pace between those two pairs times the steps left, minus the time since the
    newest one, so it counts down between events and never up."""

    def __init__(self, *, name: str = "?", stage: int | None = None, precision: str | None = None,
                 world_size: int | None = None, hosts: list[str] | None = None, steps: int | None = None,
                 rank_hosts: dict[int, str] | None = None, started: float | None = None,
                 log_lines: int = 8) -> None:
        self.name, self.stage, self.precision = name, stage, precision
        self.world_size, self.hosts, self.steps = world_size, list(hosts or []), steps
        self.rank_hosts = dict(rank_hosts or {})
        self.started = started if started is not None else time.time()
        self.ended: float | None = None
        self.ranks: dict[int, RankState] = {}
        self.rank_exit_codes: dict[int, int] = {}  # rank_exited's, kept in job.json for zerorun show
        self.evals: list[tuple[int, float]] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.resumed_step: int | None = None  # the checkpoint's step this job resumed from (--resume)
        self.restarts = 0  # tries after a failure (Note [Job restarts] in launch/restart.py)
        self.skipped_steps = 0  # optimizer steps skipped on an fp16 overflow (Note [Loss scaling] in zero/precision.py)
        self.log = LogTail(log_lines)
        self.progress: tuple[int, float] | None = None
        self.first_progress: tuple[int, float] | None = None
        self.last_loss: float | None = None
        self.received = 0  # events folded in
        for r in range(world_size or 0):
            self.rank(r)

    def rank(self, r: int) -> RankState:
        if r not in self.ranks:
            self.ranks[r] = RankState(r, host=self.rank_hosts.get(r))
        return self.ranks[r]

    # ------------------------------------------------------------------------------------------------ folding
    def update(self, e: Event) -> None:
        """Fold one event into the state."""
        self.received += 1
        r, d = self.rank(e.rank), e.data
        if e.kind == "start":
            r.host = r.host or (d["host"] if isinstance(d.get("host"), str) else None)
            r.status = "started"
            self._memory(r, d)
        elif e.kind == "model_ready":
            r.status = "ready"
            if isinstance(d.get("model_state_bytes"), dict):
                r.model_state_bytes = {k: v for k, v in d["model_state_bytes"].items() if isinstance(v, int)}
        elif e.kind == "step":
            self._step(r, e)
        elif e.kind == "progress":
            self._progress(integer(d, "step"), e.time)
            if integer(d, "steps"):
                self.steps = self.steps or integer(d, "steps")
        elif e.kind == "eval":
            v, step = number(d, "val_loss"), integer(d, "step")
            if v is not None and step is not None:  # a --resume into this run folder replaces later evaluations
                self.evals = [(s, x) for s, x in self.evals if s < step] + [(step, v)]
        elif e.kind == "restart":
            self.restarts += 1
            if integer(d, "resume_step") is not None:  # None: a script's, unknown
                self._restart(integer(d, "resume_step"), e.time)
        elif e.kind == "log" and integer(d, "resumed_step") is not None and self.progress is None:  # the job's
            self.resumed_step = integer(d, "resumed_step")  # start, not a restart's or a SLURM requeue's
        elif e.kind == "checkpoint":
            self.checkpoints.append({"rank": e.rank, **d})
        elif e.kind == "finish":
            r.status = "done"
            self._memory(r, d)  # the peak never goes down (Note [Peak RSS])
        elif e.kind == "error":
            r.status = "error" if not d.get("peer_failure") else "stopped"
        elif e.kind == "stopped":  # SIGTERM, checkpoint saved (zerorun/rank/stopsignal.py)
            r.status = "stopped"
        elif e.kind == "phase" and isinstance(d.get("phase"), str):  # Note [Rank phases]
            r.phase, r.phase_time = d["phase"], e.time
        if e.kind not in ("step", "progress", "phase"):
            self.log.add_event(e)

    def add_line(self, node_rank: int, line: str) -> list[str]:
        """A line a node printed that is not an event: a rank's own output (already ``[rank R] ...``) or the
        node's launcher (prefixed ``[node N]``). Returns the lines this adds to the log tail now (Note
        [Interrupted job] in telemetry/logtail.py)."""
        return self.log.add_line(node_rank, line)

    def stopping(self) -> None:
        """The launcher stops the job itself (a failure, or a problem found beside it): the nodes' stop noise is
        not shown as an interruption (:meth:`LogTail.stopping`)."""
        self.log.stopping()

    def _restart(self, resume: int, when: float) -> None:
        """A restart (Note [Job restarts] in launch/restart.py): the failed try's evaluations past its checkpoint
        go, and the job's step and pace start again from the checkpoint ``resume``, where the new try starts (at
        ``when``, Unix s)."""
        self.evals = [(s, x) for s, x in self.evals if s <= resume]
        self.progress, self.first_progress = (resume, when), None
        for r in self.ranks.values():
            r.step = min(r.step, resume)

    def _progress(self, step: int | None, when: float) -> None:
        if step is None:
            return
        if self.first_progress is None:
            self.first_progress = (step, when)
        if self.progress is None or step > self.progress[0]:
            self.progress = (step, when)

    def _memory(self, r: RankState, d: dict) -> None:
        """Note [Peak RSS]: a rank's peak is ``ru_maxrss``, which Linux updates lazily (from the high-water
        mark kept at page-table teardown), so an event can carry an RSS above its peak (``344 MiB / 343 MiB``):
        the peak shown is the largest of every peak and RSS the rank reported."""
        peak = r.peak_rss_bytes
        for key in ("rss_bytes", "peak_rss_bytes", "host_mem_bytes", "host_mem_used_bytes"):
            if integer(d, key) is not None:
                setattr(r, key, integer(d, key))
        known = [v for v in (peak, r.peak_rss_bytes, integer(d, "rss_bytes")) if v is not None]
        r.peak_rss_bytes = max(known) if known else None
        for key in ("cuda_allocated_bytes", "cuda_reserved_bytes", "cuda_peak_bytes", "cuda_total_bytes"):
            if integer(d, key) is not None:
                r.cuda[key] = integer(d, key)

    def _step(self, r: RankState, e: Event) -> None:
        d = e.data
        step = integer(d, "step")
        if step is None:
            return
        r.status, r.step = "training", step
        if r.first_step_time is None:
            r.first_step_time = e.time
        self._progress(step, e.time)
        if integer(d, "steps"):
            self.steps = self.steps or integer(d, "steps")
        for key in ("loss", "step_time_s", "samples_per_s", "tokens_per_s", "tflops", "lr", "grad_norm",
                    "cpu_percent", "host_cpu_percent", "gpu_util_percent"):
            setattr(r, key, number(d, key))
        for key in ("loss", "step_time_s"):  # the first step's time (allocations, warm-up) is no trend
            if getattr(r, key) is not None and (key == "loss" or step > 1):
                r.trends[key] = [*r.trends.get(key, [])[1 - TREND:], getattr(r, key)]
        if r.loss is not None and r.rank == min(self.ranks):
            self.last_loss = r.loss
            self.skipped_steps = integer(d, "skipped_steps") or 0  # fp16 overflows, every rank alike
        self._memory(r, d)
        if isinstance(d.get("model_state_bytes"), dict):
            r.model_state_bytes = {k: v for k, v in d["model_state_bytes"].items() if isinstance(v, int)}
        n = integer(d, "interval_steps") or 1
        span = number(d, "interval_s") or (r.step_time_s or 0.0) * n
        wait = number(d, "comm_wait_s")
        r.comm_wait = min(1.0, wait / span) if wait is not None and span > 0 else None
        if span > 0 and r.step_time_s:
            r.train_s += span
            r.train_steps += n
            if r.samples_per_s is not None:  # a script's report() without samples= or tokens=: unknown, not 0
                r.samples = (r.samples or 0.0) + r.samples_per_s * r.step_time_s * n
            if r.tokens_per_s is not None:
                r.tokens = (r.tokens or 0.0) + r.tokens_per_s * r.step_time_s * n
            r.comm_wait_s += wait or 0.0
            r.comm.add(d, n)
        if number(d, "telemetry_s") is not None and step > 1:
            r.telemetry_s += number(d, "telemetry_s")
            r.telemetry_events += 1

    def rank_exited(self, rank: int, code: int) -> None:
        """``rank``'s process ended on its own with exit status ``code`` (negative: killed by that signal), as
        torchrun reported it before any teardown: a rank that did not finish shows ``killed`` or ``exit N``. A
        rank that reported why it ended keeps its status: ``done``, ``error``, and ``stopped`` (its collective
        failed because a peer went away, Note [Blame], or it saved and stopped on SIGTERM), whichever node it
        ran on and whenever its exit code arrived (Note [Rank exits] in launch/torchrun.py)."""
        self.rank_exit_codes[rank] = code
        r = self.ranks.get(rank)
        if r is None or r.status in ("done", "error", "stopped"):
            return
        r.status = "killed" if code < 0 else f"exit {code}"

    def end(self, when: float | None = None) -> None:
        """The job is over (at ``when``, Unix s): ranks that neither finished nor failed were stopped."""
        self.ended = when if when is not None else time.time()
        self.log.flush()
        for r in self.ranks.values():
            if r.status not in ("done", "error", "killed") and not r.status.startswith("exit "):
                r.status = "stopped"

    # ------------------------------------------------------------------------------------------------ reading
    @property
    def step(self) -> int:
        """The job's step: the lowest step every rank has reported, or rank 0's newer ``progress`` (ranks
        step together: no rank passes a step's collectives before every rank has reached them)."""
        lowest = min((r.step for r in self.ranks.values()), default=0)
        return max(lowest, self.progress[0]) if self.progress else lowest

    def job_rate(self, key: str) -> float | None:
        """Job-wide ``samples_per_s``, ``tokens_per_s`` or ``tflops``: the sum of every rank's latest value."""
        values = [getattr(r, key) for r in self.ranks.values() if r.status in ("training", "done")]
        values = [v for v in values if v is not None]
        return sum(values) if values else None

    def elapsed_s(self, now: float | None = None) -> float:
        return (self.ended or now or time.time()) - self.started

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds left at the wall-clock pace (evaluations and checkpoints included) between the first and
        the newest reported step, less the time since the newest (Note [Job progress]); ``None`` before two
        steps are known."""
        if self.first_progress is None or self.progress is None or not self.steps:
            return None
        (s0, t0), (s1, t1) = self.first_progress, self.progress
        if s1 <= s0:
            return None
        now = self.ended or now or time.time()
        return max(0.0, (t1 - t0) / (s1 - s0) * (self.steps - s1) - max(0.0, now - t1))

    def straggler(self) -> int | None:
        """The rank whose busy time per step (:attr:`RankState.busy_s`) exceeds the median of the other
        training ranks' by more than :data:`STRAGGLER_RATIO`; ``None`` when no rank stands out. Its peers wait
        for it in every collective, so its step time alone would not show it."""
        busy = {r.rank: r.busy_s for r in self.ranks.values() if r.status == "training" and r.busy_s}
        if len(busy) < 2:
            return None
        slowest = max(busy, key=busy.get)
        others = statistics.median(v for k, v in busy.items() if k != slowest)
        return slowest if busy[slowest] > STRAGGLER_RATIO * others else None

    def memory_alerts(self) -> set[int]:
        """Ranks whose :attr:`RankState.memory_frac` is above :data:`MEMORY_ALERT`."""
        return {r.rank for r in self.ranks.values() if (r.memory_frac or 0.0) > MEMORY_ALERT}

    def time_to_first_step_s(self) -> float | None:
        firsts = [r.first_step_time for r in self.ranks.values() if r.first_step_time]
        return max(firsts) - self.started if firsts else None

    @property
    def final_val(self) -> float | None:
        return self.evals[-1][1] if self.evals else None

    @property
    def best_val(self) -> float | None:
        return min(v for _, v in self.evals) if self.evals else None
