"""``zerorun bench``: one recipe across hostfiles and ZeRO stages, beside torch's DDP and FSDP2.

Every combination (hostfile x stage, plus a baseline runtime per hostfile when asked) is one ordinary job,
launched in turn through the launch path of ``zerorun train`` (``zerorun.launch.run_job``) with quiet output;
its numbers come from the run directory's ``metrics.jsonl``, i.e. from the ranks' own telemetry.
Each job trains ``warmup + steps`` optimizer steps with a step event every step and no evaluation; the first
``warmup`` steps are left out.

Per combination (Note [Bench metrics]): world size; median and p90 step time; job samples/s and tokens/s;
weak-scaling efficiency against the smallest world size of the same runtime and stage; peak RSS per rank;
model-state bytes per rank; bytes sent per rank per step; time to first step; and for zerorun rows, the step
time relative to each baseline row of the same hostfile. With ``--repeat K`` each combination runs K times
and every number is the median of the K runs, with their min and max.

Results go to ``<log.dir>/<name>/bench-<timestamp>/``: ``bench.json`` (rewritten after every combination, so
an interrupted bench keeps what it measured), ``bench.csv`` and ``bench.png`` (needs matplotlib: the
``plot`` extra), ``bench.md`` (the table in Markdown, with the command), and one run directory per job
under ``jobs/``.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from zerorun.bench_args import (BASELINES, CONTROLLED, check_overrides, parse_baselines,  # noqa: F401
                                parse_nodes, parse_stages)
from zerorun.bench_output import METRICS, _atomic_write, markdown_table, render_table, write_csv, write_json, write_png
from zerorun.errors import ZerorunError
from zerorun.launch.plan import GLIBC_ENV
from zerorun.telemetry.console import PlainView


#: Every job, the baselines' included, is launched as ``zerorun train`` launches it, so its ranks get zerorun's
#: allocator (Note [Rank allocator] in zerorun/zero/allocator.py): part of the comparison.
ENV_NOTE = ("Every row, DDP and FSDP2 included, ran with zerorun's rank allocator (ZERORUN_ALLOCATOR=auto: "
            "tcmalloc preloaded where the node has it, else mimalloc from its pip wheel, else glibc with "
            + " ".join(f"{k}={v}" for k, v in GLIBC_ENV.items())
            + "; each rank's start event names the one it had). Plain torchrun leaves glibc's defaults: "
            "benchmarks/zero_stages.py --envs default,alloc,tcmalloc,mimalloc measures all four.")


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

    @property
    def label(self) -> str:
        """``stage 2``, ``ddp`` or ``fsdp2``."""
        return f"stage {self.stage}" if self.runtime == "zero" else self.runtime

    def overrides(self, steps: int) -> list[str]:
        """Recipe overrides for this combination's job of ``steps`` optimizer steps: the runtime and stage,
        a step event every step, no evaluation, no checkpoints. ``zero.units`` is cleared where the recipe does not allow
        it (zerorun stages 0-2 and DDP; FSDP2 shards the recipe's units, as stage 3 does), and
        ``zero.persistence_threshold`` everywhere but zerorun's stage 3."""
        out = [f"train.steps={steps}", "log.every=1", "train.eval_every=0", f"runtime={self.runtime}",
               "checkpoint.every=0", "checkpoint.dir=null"]
        if self.runtime == "zero":
            out.append(f"zero.stage={self.stage}")
        if self.runtime == "ddp" or (self.runtime == "zero" and self.stage != 3):
            out.append("zero.units=[]")
        if not (self.runtime == "zero" and self.stage == 3):
            out.append("zero.persistence_threshold=0")
        return out


@dataclass
class Row:
    """The result of one combination: ``status`` ok | failed, the failure ``reason``, the per-run metrics
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
        return {"hostfile": c.hostfile, "nodes": c.nodes, "runtime": c.runtime, "stage": c.stage, "label": c.label,
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
    formulas, ZeRO paper §7); ``time_to_first_step_s``, the slowest rank's seconds from its start to the end
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
            "comm_bytes_per_step": statistics.median(max(e["comm_bytes"] for e in ranks) for ranks in steps.values()),
            "time_to_first_step_s": first_step}


def read_events(run_dir: str) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` (one JSON object per line; a torn last line is skipped)."""
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
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
    / N0), N0 the smallest world size among the successful rows of the same runtime and stage (1.0 there).
    ``time_vs[b]`` = median step time of the row / median step time of baseline ``b`` on the same hostfile
    (below 1: faster than the baseline).
    """
    for row in rows:
        row.metrics = {name: {"median": statistics.median(r[name] for r in row.runs),
                              "min": min(r[name] for r in row.runs), "max": max(r[name] for r in row.runs)}
                       for name in METRICS} if row.runs else {}
    measured = [r for r in rows if r.metrics]
    for row in measured:
        same = [r for r in measured if r.combo.label == row.combo.label]
        smallest = min(same, key=lambda r: r.value("world_size"))
        per_rank = row.value("samples_per_s") / row.value("world_size")
        row.scaling_efficiency = per_rank / (smallest.value("samples_per_s") / smallest.value("world_size"))
        row.time_vs = {}
        if row.combo.runtime == "zero":
            for base in measured:
                if base.combo.runtime != "zero" and base.combo.hostfile == row.combo.hostfile:
                    row.time_vs[base.combo.runtime] = row.value("step_time_s") / base.value("step_time_s")


# ---------------------------------------------------------------------------------------------------- run
class QuietView(PlainView):
    """The job view for bench: keeps the job's state like :class:`PlainView` but prints nothing, not even the
    summary table at the end (the bench table says it)."""

    def print(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def combinations(hostfiles: list[str | None], stages: list[int], baselines: list[str],
                 nodes: list[int] = ()) -> list[Combination]:
    """Per hostfile, then per node count of ``nodes`` (in the order given): the baselines, then zerorun at each
    stage."""
    places = [(h, None) for h in hostfiles] + [(f"{n} node{'s' * (n != 1)}", n) for n in nodes]
    return [c for h, n in places
            for c in [*(Combination(h, b, nodes=n) for b in baselines),
                      *(Combination(h, "zero", s, nodes=n) for s in stages)]]


def check_allocation(nodes: list[int], hostfiles: list[str]) -> None:
    """``--nodes`` needs a SLURM allocation with that many nodes, and no hostfile beside it.

    Raises:
        ZerorunError: ``--nodes`` with ``-H``, outside an allocation, or above its node count.
    """
    if not nodes:
        return
    if hostfiles:
        raise ZerorunError("--nodes and -H: bench either the allocation's nodes (--nodes, inside SLURM) or "
                           "hostfiles (-H), not both")
    if not os.environ.get("SLURM_JOB_ID"):
        raise ZerorunError("--nodes: counts nodes of a SLURM allocation, and SLURM_JOB_ID is not set (run it "
                           "inside salloc or an sbatch script; elsewhere give hostfiles with -H)")
    from zerorun.launch.slurm import allocation_hosts, refuse_inside_step

    refuse_inside_step()  # `srun zerorun bench --nodes`: its jobs' srun steps would wait for ever
    try:
        allocation_hosts(1, max(nodes))
    except ZerorunError as e:
        raise ZerorunError(str(e).replace("--num-nodes", "--nodes", 1)) from None


def progress_line(row: Row, done: int, total: int) -> str:
    """One line for a finished combination (printed when stdout is not a terminal): ``zerorun: bench 2/8:
    stage 2 on localhost-2: ok, 2 ranks, 211 ms/step (median), 38.0 samples/s, peak RSS 440.0 MiB/rank`` or
    ``...: failed: REASON``."""
    from zerorun.telemetry.console import human_bytes

    head = f"zerorun: bench {done}/{total}: {row.combo.label} on {os.path.basename(row.combo.hostfile or 'localhost')}"
    if row.status != "ok" or not row.metrics:
        return f"{head}: failed: {row.reason}"
    v = row.value
    return (f"{head}: ok, {int(v('world_size'))} ranks, {v('step_time_s') * 1e3:.0f} ms/step (median), "
            f"{v('samples_per_s'):.1f} samples/s, peak RSS {human_bytes(v('peak_rss_bytes'))}/rank")


def run_bench(recipe_path: str, overrides: list[str], hostfiles: list[str], stages: list[int],
              baselines: list[str], steps: int, warmup: int, repeat: int, out=None,
              nodes: list[int] = ()) -> tuple[int, int, str]:
    """Run every combination ``repeat`` times, show the live table, write bench.json/csv/md/png.

    Returns:
        ``(failed combinations, all combinations, bench directory)``.

    Raises:
        ZerorunError: bad recipe, overrides or hostfile (checked before anything runs).
        JobFailed: interrupted (Ctrl-C or SIGTERM; exit code 130 or 143), after writing what was measured.
    """
    from rich.console import Console, Group
    from rich.live import Live
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from zerorun import launch, modelcheck
    from zerorun.hostfile import read_hostfile
    from zerorun.recipe import load_recipe

    for h in hostfiles:  # bad input fails here, before any job
        read_hostfile(h)
    check_allocation(list(nodes), hostfiles)
    check_overrides(overrides)
    hosts: list[str | None] = list(hostfiles) or ([] if nodes else [None])
    rows = [Row(c) for c in combinations(hosts, stages, baselines, list(nodes))]
    # A recipe that no combination accepts is bad input; one that some combinations refuse (zero.units below
    # stage 3, say) fails those combinations only, when their turn comes.
    base, base_overrides, first_error = None, [], None
    for row in rows:
        try:
            base_overrides = [*overrides, *row.combo.overrides(warmup + steps)]
            base = load_recipe(recipe_path, base_overrides, check_optimizer=False)
            break
        except ZerorunError as e:
            first_error = first_error or e
    if base is None:
        raise first_error
    # the optimizer (which needs torch) is the same for every combination: checked once, in a child process
    # (zerorun/modelcheck.py); a model that a stage refuses is reported by that job's ranks
    problem = modelcheck.start(base, recipe_path, base_overrides, model=False, beside=False).wait()
    if problem:
        raise ZerorunError(problem)
    bench_dir = os.path.join(base.log.dir, base.name,
                             f"bench-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")
    try:
        os.makedirs(bench_dir)
    except OSError as e:
        raise ZerorunError(f"log.dir: cannot create the bench directory {bench_dir}: {e.strerror}") from None
    jobs_dir = os.path.join(bench_dir, "jobs")
    info = {"command": shlex.join(["zerorun", *sys.argv[1:]]),
            "recipe": os.path.abspath(recipe_path), "overrides": overrides, "steps": steps, "warmup": warmup,
            "repeat": repeat, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rank_env": ENV_NOTE}
    console = Console(file=out or sys.stdout)
    if not console.is_terminal:  # a log file or a pipe: room for every column
        console = Console(file=out or sys.stdout, width=220)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)
    task = progress.add_task("bench", total=len(rows) * repeat)
    json_path = os.path.join(bench_dir, "bench.json")
    interrupted = None
    with Live(Group(render_table(rows, baselines, repeat), progress), console=console,
              refresh_per_second=2, transient=not console.is_terminal) as live:
        for row in rows:
            row.status = "running"
            for k in range(repeat):
                progress.update(task, description=escape(f"{row.combo.label} on "
                                f"{os.path.basename(row.combo.hostfile or 'localhost')} ({k + 1}/{repeat})"))
                live.update(Group(render_table(rows, baselines, repeat), progress))
                try:
                    job_overrides = [*overrides, f"log.dir={jobs_dir}", *row.combo.overrides(warmup + steps)]
                    recipe = load_recipe(recipe_path, job_overrides, check_optimizer=False)
                    launcher = launch.Launcher.SLURM if row.combo.nodes else launch.Launcher.SSH
                    hosts = launch.select(None if row.combo.nodes else row.combo.hostfile,
                                          recipe.launch.procs_per_node, num_nodes=row.combo.nodes,
                                          launcher=launcher, job_env=recipe.launch.env)
                    # no model check beside each job: its ranks report a model the stage refuses, and the
                    # check's CPU time would count in the job's time to first step
                    result = launch.run_job(recipe, hosts, view=lambda state: QuietView(sys.stdout, state),
                                            model_check=False, launcher=launcher)
                    if not result.ok:
                        raise result.error()
                    row.run_dirs.append(result.run_dir)
                    row.runs.append(measure(read_events(result.run_dir), warmup))
                except (ZerorunError, ValueError, OSError) as e:
                    row.reason = row.reason or str(e)
                    if getattr(e, "exit_code", None) in (130, 143):  # Ctrl-C or SIGTERM: stop
                        interrupted = e
                progress.advance(task)
                if interrupted:
                    break
            row.status = "failed" if row.reason else "ok"
            summarize(rows)
            write_json(json_path, rows, info)
            if not console.is_terminal:  # no live table off a terminal: a line per finished combination
                console.print(Text(progress_line(row, rows.index(row) + 1, len(rows))), soft_wrap=True)
            live.update(Group(render_table(rows, baselines, repeat), progress))
            if interrupted:
                break
    if not console.is_terminal:  # the live view is transient off a terminal: print the final table once
        console.print(render_table(rows, baselines, repeat))
    write_csv(os.path.join(bench_dir, "bench.csv"), rows, baselines)
    _atomic_write(os.path.join(bench_dir, "bench.md"),
                  lambda f: f.write(f"`{info['command']}`\n\n{markdown_table(rows, baselines)}\n\n{ENV_NOTE}\n"))
    try:
        write_png(os.path.join(bench_dir, "bench.png"), rows)
    except ZerorunError as e:
        console.print(Text(f"zerorun: note: {e}"))  # not markup: "pip install 'zerorun[plot]'" must survive
    failed = [r for r in rows if r.status != "ok"]
    console.print(Text(f"zerorun: bench: {len(rows) - len(failed)} of {len(rows)} combinations succeeded; "
                       f"results in {bench_dir}"))
    if interrupted:
        raise interrupted
    return len(failed), len(rows), bench_dir
