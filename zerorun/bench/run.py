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

import os
import shlex
import sys
import time
import uuid
from typing import Any, Callable

from zerorun.allocator import GLIBC_ENV
from zerorun.bench.args import check_overrides
from zerorun.bench.output import _atomic_write, markdown_table, render_table, write_csv, write_json, write_png
from zerorun.bench.rows import Combination, Row, measure, read_events, summarize
from zerorun.errors import ZerorunError
from zerorun.telemetry.console import PlainView

#: the bench folder's files (``<log.dir>/<name>/bench-<timestamp>/``) and its folder of job run folders.
BENCH_JSON, BENCH_CSV, BENCH_MD, BENCH_PNG, JOBS = "bench.json", "bench.csv", "bench.md", "bench.png", "jobs"

#: Every job, the baselines' included, is launched as ``zerorun train`` launches it, so its ranks get zerorun's
#: allocator (Note [Rank allocator] in zerorun/allocator.py): part of the comparison.
ENV_NOTE = ("Every row, DDP and FSDP2 included, ran with zerorun's rank allocator (ZERORUN_ALLOCATOR=auto: "
            "tcmalloc preloaded where the node has it, else mimalloc from its pip wheel, else glibc with "
            + " ".join(f"{k}={v}" for k, v in GLIBC_ENV.items())
            + "; each rank's start event names the one it had). Plain torchrun leaves glibc's defaults: "
            "benchmarks/zero_stages.py --envs default,alloc,tcmalloc,mimalloc measures all four.")


class QuietView(PlainView):
    """The job view for bench: keeps the job's state like :class:`PlainView` but prints nothing, not even the
    summary table at the end (the bench table says it)."""

    def print(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def combinations(hostfiles: list[str | None], stages: list[int], baselines: list[str],
                 nodes: list[int] = (), variants: list[str] = ()) -> list[Combination]:
    """Per hostfile, then per node count of ``nodes`` (in the order given): the baselines, then zerorun at each
    stage, stage 3 once per ZeRO++ variant of ``variants`` where given."""
    places = [(h, None) for h in hostfiles] + [(f"{n} node{'s' * (n != 1)}", n) for n in nodes]
    base = [os.path.basename(h) for h in hostfiles if h]
    named = {h: h if h and base.count(os.path.basename(h)) > 1 else None for h, _ in places}  # same file names
    return [c for h, n in places
            for c in [*(Combination(h, b, nodes=n, name=named[h]) for b in baselines),
                      *(Combination(h, "zero", s, nodes=n, variant=v, name=named[h]) for s in stages
                        for v in (variants if s == 3 and variants else [None]))]]


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

    head = f"zerorun: bench {done}/{total}: {row.combo.label} on {row.combo.host_name}"
    if row.status != "ok" or not row.metrics:
        return f"{head}: failed: {row.reason}"
    v = row.value
    world = int(v("world_size"))
    return (f"{head}: ok, {world} rank{'s' * (world != 1)}, {v('step_time_s') * 1e3:.0f} ms/step (median), "
            f"{v('samples_per_s'):.1f} samples/s, peak RSS {human_bytes(v('peak_rss_bytes'))}/rank")


def _checked_recipe(recipe_path: str, overrides: list[str], hostfiles: list[str], nodes: list[int],
                    rows: list[Row], steps: int):
    """The recipe of the first combination of ``rows`` that accepts it (``steps`` optimizer steps a job), once
    the hostfiles, ``--nodes``, the overrides, the optimizer and the model (in a child process, on the meta device:
    zerorun/rank/modelcheck.py) are checked: a broken model module is one line before any job, not one failed job
    per combination. A recipe that no combination accepts is bad input; one that some combinations refuse (zero.units
    below stage 3, say) fails those combinations only, when their turn comes; a model that a stage refuses is
    reported by that job's ranks.

    Raises:
        ZerorunError: bad recipe, overrides, hostfile, ``--nodes`` or optimizer.
    """
    from zerorun.rank import modelcheck
    from zerorun.recipe.hostfile import read_hostfile
    from zerorun.recipe import load_recipe

    for h in hostfiles:  # bad input fails here, before any job
        read_hostfile(h)
    check_allocation(nodes, hostfiles)
    check_overrides(overrides)
    base, base_overrides, first_error = None, [], None
    for row in rows:
        try:
            base_overrides = [*overrides, *row.combo.overrides(steps)]
            base = load_recipe(recipe_path, base_overrides, check_optimizer=False)
            break
        except ZerorunError as e:
            first_error = first_error or e
    if base is None:
        raise first_error
    problem = modelcheck.start(base, recipe_path, base_overrides, beside=False).wait()  # the model's module too
    if problem:
        raise ZerorunError(problem)
    return base


def _make_bench_dir(base) -> str:
    """Make ``<log.dir>/<name>/bench-<timestamp>-xxxx`` for the recipe ``base`` and return its path.

    Raises:
        ZerorunError: the folder cannot be made (named with ``log.dir``).
    """
    bench_dir = os.path.join(base.log.dir, base.name,
                             f"bench-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")
    try:
        os.makedirs(bench_dir)
    except OSError as e:
        raise ZerorunError(f"log.dir: cannot create the bench directory {bench_dir}: {e.strerror}") from None
    return bench_dir


def _measure_job(row: Row, recipe_path: str, overrides: list[str], jobs_dir: str, steps: int, warmup: int,
                 ssh=None) -> None:
    """Run one job of ``row``'s combination (``warmup + steps`` optimizer steps, its run folder in ``jobs_dir``)
    and append its metrics and run folder to ``row``; ``ssh``: the SSH options of its remote hosts.

    Raises:
        ZerorunError, ValueError, OSError: the job failed (a :class:`~zerorun.errors.JobFailed` with exit code
            130 or 143 when it was interrupted), or its telemetry holds no step after the warm-up.
    """
    from zerorun import launch
    from zerorun.recipe import load_recipe

    job_overrides = [*overrides, f"log.dir={jobs_dir}", *row.combo.overrides(warmup + steps)]
    recipe = load_recipe(recipe_path, job_overrides, check_optimizer=False)
    launcher = launch.Launcher.SLURM if row.combo.nodes else launch.Launcher.SSH
    hosts = launch.select(None if row.combo.nodes else row.combo.hostfile, recipe.launch.procs_per_node,
                          num_nodes=row.combo.nodes, launcher=launcher, job_env=recipe.launch.env)
    # no model check beside each job: its ranks report a model the stage refuses, and the check's CPU time
    # would count in the job's time to first step
    result = launch.run_job(recipe, hosts, view=lambda state: QuietView(sys.stdout, state), model_check=False,
                            launcher=launcher, ssh=ssh)
    if not result.ok:
        raise result.error()
    row.run_dirs.append(result.run_dir)
    row.runs.append(measure(read_events(result.run_dir), warmup))


class _Screen:
    """What ``zerorun bench`` shows while it runs: the live rich table of every row above a progress bar of
    every job (``len(rows) * repeat``) on a terminal; off one (a log file, a pipe: 220 columns), a plain line
    per finished combination and the final table once."""

    def __init__(self, out, rows: list[Row], baselines: list[str], repeat: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(file=out or sys.stdout)
        if not self.console.is_terminal:  # a log file or a pipe: room for every column
            self.console = Console(file=out or sys.stdout, width=220)
        self.rows, self.baselines, self.repeat = rows, baselines, repeat
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console)
        self.task = self.progress.add_task("bench", total=len(rows) * repeat)
        self.live = None
        self.chosen: dict = {}  # the columns kept at each width (Note [Columns chosen once per width])

    def view(self):
        from rich.console import Group

        return Group(render_table(self.rows, self.baselines, self.repeat, self.console.width, self.chosen),
                     self.progress)

    def live_view(self):
        """The rich ``Live`` of :meth:`view` (entered by the caller; transient off a terminal)."""
        from rich.live import Live

        self.live = Live(self.view(), console=self.console, refresh_per_second=2,
                         transient=not self.console.is_terminal)
        return self.live

    def refresh(self) -> None:
        self.live.update(self.view())

    def starting(self, row: Row, k: int) -> None:
        from rich.markup import escape

        self.progress.update(self.task, description=escape(f"{row.combo.label} on "
                             f"{row.combo.host_name} ({k + 1}/{self.repeat})"))
        self.refresh()

    def finished(self, row: Row) -> None:
        from rich.text import Text

        if not self.console.is_terminal:  # no live table off a terminal: a line per finished combination
            self.console.print(Text(progress_line(row, self.rows.index(row) + 1, len(self.rows))), soft_wrap=True)
        self.refresh()


def _run_row(row: Row, screen: _Screen, repeat: int, run_job: Callable[[Row], None]) -> BaseException | None:
    """Run ``row``'s combination ``repeat`` times through ``run_job``; a failed job's reason is the row's
    (the first one). Returns the error of a job that was interrupted (Ctrl-C or SIGTERM: exit code 130 or
    143), after which no job of the row runs, else None."""
    row.status = "running"
    interrupted = None
    for k in range(repeat):
        screen.starting(row, k)
        try:
            run_job(row)
        except (ZerorunError, ValueError, OSError) as e:
            row.reason = row.reason or str(e)
            if getattr(e, "exit_code", None) in (130, 143):  # Ctrl-C or SIGTERM: stop
                interrupted = e
        screen.progress.advance(screen.task)
        if interrupted:
            break
    row.status = "interrupted" if interrupted else "failed" if row.reason else "ok"  # a stop is no failure
    return interrupted


def _write_results(screen: _Screen, bench_dir: str, info: dict[str, Any]) -> int:
    """Print the final table (off a terminal) and write bench.csv, bench.md and bench.png (a note instead of
    the png where matplotlib is missing) and the closing line. Returns the number of failed combinations."""
    from rich.text import Text

    rows, baselines, console = screen.rows, screen.baselines, screen.console
    if not console.is_terminal:  # the live view is transient off a terminal: print the final table once
        console.print(render_table(rows, baselines, screen.repeat, console.width))
    write_csv(os.path.join(bench_dir, BENCH_CSV), rows, baselines)
    _atomic_write(os.path.join(bench_dir, BENCH_MD),
                  lambda f: f.write(f"`{info['command']}`\n\n{markdown_table(rows, baselines)}\n\n{ENV_NOTE}\n"))
    try:
        write_png(os.path.join(bench_dir, BENCH_PNG), rows)
    except ZerorunError as e:
        console.print(Text(f"zerorun: note: {e}"))  # not markup: "pip install 'zerorun[plot]'" must survive
    failed = [r for r in rows if r.status != "ok"]
    console.print(Text(f"zerorun: bench: {len(rows) - len(failed)} of {len(rows)} combinations succeeded; "
                       f"results in {bench_dir}"), soft_wrap=True)  # a path the terminal wraps, unbroken
    return len(failed)


def run_bench(recipe_path: str, overrides: list[str], hostfiles: list[str], stages: list[int],
              baselines: list[str], steps: int, warmup: int, repeat: int, out=None,
              nodes: list[int] = (), variants: list[str] = (), ssh=None) -> tuple[int, int, str]:
    """Run every combination ``repeat`` times, show the live table, write bench.json/csv/md/png. ``variants``:
    stage 3's ZeRO++ variants (``--zero-variants``), each a row; ``ssh``: the remote hosts' SSH options
    (``--ssh-config``).

    Returns:
        ``(failed combinations, all combinations, bench directory)``.

    Raises:
        ZerorunError: bad recipe, overrides or hostfile (checked before anything runs).
        JobFailed: interrupted (Ctrl-C or SIGTERM; exit code 130 or 143), after writing what was measured.
    """
    hosts: list[str | None] = list(hostfiles) or ([] if nodes else [None])
    rows = [Row(c) for c in combinations(hosts, stages, baselines, list(nodes), list(variants))]
    base = _checked_recipe(recipe_path, overrides, hostfiles, list(nodes), rows, warmup + steps)
    bench_dir = _make_bench_dir(base)
    jobs_dir = os.path.join(bench_dir, JOBS)
    info = {"command": shlex.join(["zerorun", *sys.argv[1:]]),
            "recipe": os.path.abspath(recipe_path), "overrides": overrides, "steps": steps, "warmup": warmup,
            "repeat": repeat, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rank_env": ENV_NOTE}
    screen = _Screen(out, rows, baselines, repeat)
    interrupted = None
    with screen.live_view():
        for row in rows:
            interrupted = _run_row(row, screen, repeat,
                                   lambda r: _measure_job(r, recipe_path, overrides, jobs_dir, steps, warmup, ssh))
            summarize(rows)
            write_json(os.path.join(bench_dir, BENCH_JSON), rows, info)
            screen.finished(row)
            if interrupted:
                break
    failed = _write_results(screen, bench_dir, info)
    if interrupted:
        raise interrupted
    return failed, len(rows), bench_dir
