"""Restarting a failed training job: ``launch.max_restarts`` (``--max-restarts N``) and ``launch.min_nodes``
(``--nnodes K:N``).

Note [Job restarts]: when a rank, a torchrun agent or a node fails, the supervisor stops the whole job as ever
(Note [Teardown] in launch/supervisor.py); with restarts left, :func:`run_with_restarts` then starts the whole
job again (a fresh torchrun agent on every node, through :func:`~zerorun.launch.run.run_job`), resumed from
the newest complete checkpoint this job saved (the ``checkpoint`` events of its run folder), else from the one
its first try resumed from, else from step 0. Never from the newest checkpoint in ``checkpoint.dir`` as such:
a fresh job shares that folder with earlier jobs of the recipe, whose checkpoints are not its own (a restart
would jump ahead to another run's weights, or find the job "done"). torchrun's own ``--max-restarts`` stays 0: its elastic
agent restarts the ranks of its node only, at the world size it rendezvoused with, and each rank would have
to find its own checkpoint; zerorun restarts the job, so that the launcher picks one checkpoint for every
rank and a job that lost a node can continue at a smaller world size, the sharded optimizer states and
parameters resharded on load (Note [Exact resume] in zerorun/checkpoint/saving.py), which torchrun's agent cannot do.

A user's script (``zerorun launch --max-restarts N``) is started again as it is, resuming from checkpoints of
its own as under torchrun. Only failures restart (exit code 1: a crash, a killed rank, a lost node); bad input
(exit code 2: the same again on every try) and an interruption (Ctrl-C, SIGTERM, exit code 130/143) end the
job. The same failure (the same cause, each try started from the same checkpoint: no progress saved between
them) :data:`SAME_FAILURE_LIMIT` times in a row ends it too, restarts left or not: it is the job's, not a
machine's. (The step a try reached is not the key: rank 0's last report races with the crash.) Each restart is a line on stdout and in the run's ``output.log`` and a
``restart`` event in its ``metrics.jsonl`` (one run folder for every try); the job's exit code is its last
try's.

Note [Lost nodes]: with ``launch.min_nodes: K``, a restart leaves out the hosts that were lost: a node that
ended for a reason of its own (its SSH connection lost, its watcher or torchrun agent killed: the supervisor's
``lost``) and the hosts that fail preflight on the restart (SSH down, launch/preflight.py), and continues on
the others if at least K remain. The global batch (ranks x ``train.micro_batch_size`` x
``train.grad_accum_steps``) is kept with more accumulation steps on fewer ranks where it divides; where it does
not, the nearest accumulation is taken and a line says how the global batch changes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable

from zerorun import runfolder
from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import Host
from zerorun.telemetry.events import PREFIX, format_event, from_json

#: the same failure from the same starting checkpoint this many times in a row ends the job, restarts left or not
SAME_FAILURE_LIMIT = 3


def parse_nnodes(text: str) -> tuple[int | None, int]:
    """torchrun's ``--nnodes``: ``N`` or ``MIN:MAX`` as ``(min_nodes or None, nodes)``.

    Raises:
        ZerorunError: not a count, or ``MIN`` above ``MAX``.
    """
    low, sep, high = text.partition(":")
    try:
        nodes, least = int(high if sep else low), int(low) if sep else None
    except ValueError:
        raise ZerorunError(f"--nnodes {text}: expected N or MIN:MAX, node counts (e.g. 2 or 1:2)") from None
    if nodes < 1 or (least is not None and not 1 <= least <= nodes):
        raise ZerorunError(f"--nnodes {text}: expected 1 <= MIN <= MAX (node counts)")
    return least, nodes


def restart_options(recipe, max_restarts: int | None, nnodes: str | None, num_nodes: int | None) -> int | None:
    """``--max-restarts`` and ``--nnodes [MIN:]N`` into ``recipe.launch``; returns the number of hosts to use
    (``--nnodes``'s N, else ``num_nodes``, ``--num-nodes``).

    Raises:
        ZerorunError: a bad ``--nnodes``, or one that contradicts ``--num-nodes``.
    """
    if max_restarts is not None:
        recipe.launch.max_restarts = max_restarts
    if nnodes is None:
        return num_nodes
    least, nodes = parse_nnodes(nnodes)
    if num_nodes is not None and num_nodes != nodes:
        raise ZerorunError(f"--nnodes {nnodes} and --num-nodes {num_nodes}: give one node count")
    if least is not None:
        recipe.launch.min_nodes = least
    return nodes


def check_min_nodes(recipe, hosts: list[Host]) -> None:
    """Raises ZerorunError: ``launch.min_nodes`` above the job's number of hosts."""
    least = recipe.launch.min_nodes
    if least is not None and least > len(hosts):
        raise ZerorunError(f"launch.min_nodes {least}: more than the job's {len(hosts)} host"
                           f"{'s' * (len(hosts) != 1)}")


def world_size(hosts: list[Host]) -> int:
    return sum(h.slots for h in hosts)


def keep_global_batch(train, old_world: int, new_world: int) -> str | None:
    """Set ``train.grad_accum_steps`` so that the global batch of ``old_world`` ranks is kept on ``new_world``
    ranks (Note [Lost nodes]); returns a line saying what changed, or None when nothing did."""
    old_accum = train.grad_accum_steps
    total = old_accum * old_world
    accum = total // new_world if total % new_world == 0 else max(1, round(total / new_world))
    train.grad_accum_steps = accum
    micro = train.micro_batch_size
    if accum * new_world == total:
        return None if accum == old_accum else (
            f"train.grad_accum_steps {old_accum} -> {accum} keeps the global batch at {total * micro} samples")
    return (f"the global batch of {total * micro} samples ({old_world} ranks x {old_accum} accumulation steps) "
            f"does not divide over {new_world} ranks: train.grad_accum_steps {old_accum} -> {accum}, global batch "
            f"{accum * new_world * micro} samples (the loss curve changes)")


def _step_reached(result) -> int:
    """The last step the failed try reached (rank 0's progress, else any rank's step events), 0 for none."""
    state = result.state
    if state is None:
        return 0
    if state.progress is not None:
        return state.progress[0]
    return max((r.step or 0 for r in state.ranks.values()), default=0)


def saved_by_job(run_dir: str) -> list[str]:
    """The checkpoints this job saved (any try), oldest first: the ``path`` of every ``checkpoint`` event in
    ``run_dir``'s metrics.jsonl (rank 0 sends it once the save is complete), read as ``load_run`` reads them
    (telemetry's ``from_json``: a torn line is skipped)."""
    try:
        with open(os.path.join(run_dir, runfolder.METRICS), encoding="utf-8", errors="replace") as f:
            events = [e for e in map(from_json, f) if e is not None]
    except OSError:
        return []
    return [e.data["path"] for e in events if e.kind == "checkpoint" and e.data.get("path")]


def resume_point(recipe, say: Callable[[str], None], run_dir: str | None = None,
                 initial: str | None = None) -> tuple[int, str | None] | None:
    """Point ``recipe`` at the checkpoint a restart resumes from (Note [Job restarts]): the newest complete one
    this job saved (:func:`saved_by_job`), else ``initial`` (the checkpoint the first try resumed from) if it
    is still complete, else step 0 -- never another job's checkpoint that happens to be in ``checkpoint.dir``.
    Returns ``(step, path)``, ``(0, None)`` for step 0, or None when that checkpoint is the last step's (the
    job is done)."""
    ckpt = recipe.checkpoint
    ckpt.resume = None
    if not ckpt.dir or recipe.runtime != "zero":
        return 0, None
    from zerorun.checkpoint import files as checkpoint_files

    for path in (saved_by_job(run_dir)[::-1] if run_dir else []) + ([initial] if initial else []):
        try:
            step = int(checkpoint_files.check(path)["step"])
        except ZerorunError:
            continue  # gone, incomplete or damaged: an older one
        if step >= recipe.train.steps:
            say(f"zerorun: {path} was saved after step {step}, the last: the job is done")
            return None
        ckpt.resume = path
        return step, path
    return 0, None


def _log(run_dir: str, text: str) -> None:
    """Append the launcher's ``text`` to ``run_dir/output.log`` (as ``[launcher] ...`` lines)."""
    try:
        with open(os.path.join(run_dir, runfolder.OUTPUT), "a", encoding="utf-8") as f:
            f.write("".join(f"[launcher] {line}\n" for line in text.splitlines()))
    except OSError:
        pass  # the line is on stdout; the folder's problem shows in the next try's header


def record(run_dir: str, **data) -> None:
    """Append a ``restart`` event (the launcher's, as rank 0's) to ``run_dir/metrics.jsonl``."""
    line = format_event("restart", 0, **data)[len(PREFIX):]
    with open(os.path.join(run_dir, runfolder.METRICS), "a", encoding="utf-8") as f:
        f.write(line + "\n")


def leave_out(hosts: list[Host], lost: dict[str, str], min_nodes: int, recipe,
              say: Callable[[str], None]) -> list[Host] | None:
    """``hosts`` without the ``lost`` ones (name -> why), the global batch kept (Note [Lost nodes]); None (and a
    line) when fewer than ``min_nodes`` hosts remain."""
    left = [h for h in hosts if h.name not in lost]
    why = "; ".join(f"{name} ({reason})" for name, reason in lost.items())
    if len(left) < min_nodes:
        say(f"zerorun: lost {why}: {len(left)} host{'s' * (len(left) != 1)} left, fewer than launch.min_nodes "
            f"{min_nodes}: not restarting")
        return None
    line = f"zerorun: leaving out {why}: continuing on {len(left)} of {len(hosts)} hosts"
    change = keep_global_batch(recipe.train, world_size(hosts), world_size(left)) if recipe is not None else None
    say(line + (f"; {change}" if change else ""))
    return left


def run_training(job, hosts: list[Host], *, max_restarts: int | None = None, min_nodes: int | None = None,
                 run_dir: str | None = None, model_check: bool = True, **kwargs):
    """:func:`~zerorun.launch.run.run_job` of ``job`` (``kwargs`` are run_job's) with restarts
    (:func:`run_with_restarts`): a Recipe's ``launch.max_restarts`` and ``launch.min_nodes``, or for a user's
    script (``zerorun launch``) ``max_restarts`` and ``min_nodes`` as given. Every try writes into the first
    try's run folder and keeps its job id and start time; the model check runs beside the first try only."""
    from zerorun.launch.run import run_job
    from zerorun.launch.script import Script

    recipe = None if isinstance(job, Script) else job
    if recipe is not None:
        max_restarts, min_nodes = recipe.launch.max_restarts, recipe.launch.min_nodes
    started = None  # the first try's start: job.json and `zerorun show` count the job from there

    def attempt(now: list[Host], n: int):
        nonlocal run_dir, started
        result = run_job(job, now, run_dir=run_dir, model_check=model_check and n == 0, started=started,
                         **kwargs)
        run_dir = result.run_dir
        if started is None and result.state is not None:
            started = result.state.started
        return result

    return run_with_restarts(recipe, hosts, attempt, max_restarts=max_restarts or 0, min_nodes=min_nodes)


def run_with_restarts(recipe, hosts: list[Host], run: Callable, *, max_restarts: int,
                      min_nodes: int | None = None, say: Callable[[str], None] | None = None):
    """Run the job, restarting it on failure up to ``max_restarts`` times (Note [Job restarts]).

    Args:
        recipe: the resolved Recipe (its ``checkpoint.resume`` and ``train.grad_accum_steps`` are set for each
            restart), or None for a user's script (restarted as it is: it resumes itself).
        run: ``run(hosts, attempt)`` runs try ``attempt`` (0 first) on ``hosts`` and returns its ``Outcome``
            (launch/run.py: the restart is recorded in its ``run_dir``); it raises ZerorunError before anything
            starts (preflight: a ``PreflightFailed`` on a restart leaves those hosts out with ``min_nodes``).
        min_nodes: Note [Lost nodes]; None: every host must be there.
    Returns:
        The last try's ``Outcome`` (launch/outcome.py).
    Raises:
        ZerorunError: the first try's preflight.
    """
    from zerorun.launch.preflight import PreflightFailed

    shown = say or (lambda line: print(line, flush=True))
    attempt, failures, lost, result = 0, [], {}, None
    initial = recipe.checkpoint.resume if recipe is not None else None  # the first try's starting point

    def say(line: str) -> None:  # on stdout (or ``say``) and in the run's output.log
        shown(line)
        if result is not None:
            _log(result.run_dir, line)

    while True:
        if lost:
            hosts, lost = leave_out(hosts, lost, min_nodes, recipe, say), {}
            if hosts is None:
                return result
        try:
            result = run(hosts, attempt)
        except PreflightFailed as e:
            if result is None:
                raise  # the first try: the hosts as given must answer
            if min_nodes is None:  # the job's failure stays its result; the restart's cause is said
                say(f"zerorun: restart {attempt} cannot start:\n{e}")
                return result
            lost = e.problems
            continue
        if result.ok or result.status != "failed" or result.exit_code != 1:
            return result
        step = _step_reached(result)
        cause = result.message.removesuffix(f" (logs: {result.run_dir})")
        failures.append((cause, recipe.checkpoint.resume if recipe is not None else None))  # from where it began
        if _give_up(attempt, max_restarts, failures, say):
            return result
        if result.lost and result.host and min_nodes is not None:
            lost = {result.host: "its node was lost"}
        attempt += 1
        point = resume_point(recipe, say, result.run_dir, initial) if recipe is not None else (0, "")
        if point is None:  # the last step's checkpoint was saved before the failure: the job is done
            return dataclasses.replace(result, status="ok", exit_code=0, rank=None, host=None, message="", lost=False)
        _announce(result.run_dir, say, attempt, max_restarts, cause, step, point)


def _give_up(attempt: int, max_restarts: int, failures: list[tuple], say: Callable[[str], None]) -> bool:
    """True (and says why) when no restart is left, or the same failure came :data:`SAME_FAILURE_LIMIT` times
    in a row from the same starting point (``failures``: (cause, where the try began) per failed try)."""
    if attempt >= max_restarts:
        if max_restarts:
            say(f"zerorun: no restarts left (launch.max_restarts {max_restarts})")
        return True
    if len(failures) >= SAME_FAILURE_LIMIT and len(set(failures[-SAME_FAILURE_LIMIT:])) == 1:
        began = failures[-1][1] or "step 0"
        say(f"zerorun: the same failure {SAME_FAILURE_LIMIT} times in a row, each try started from {began} "
            "(no newer checkpoint saved between them): not restarting")
        return True
    return False


def _announce(run_dir, say, attempt, max_restarts, cause, step, point) -> None:
    resume_step, path = point  # path "": a user's script, which resumes from checkpoints of its own
    where = f"resuming from checkpoint {path} (after step {resume_step})" if path else \
        "resuming from step 0 (no checkpoint yet)" if path is None else "the script started again, as it is"
    say(f"zerorun: restart {attempt} of {max_restarts} after {cause} (last step reported: {step}); {where}")
    try:
        record(run_dir, attempt=attempt, max_restarts=max_restarts, cause=cause, failed_step=step,
               resume_step=resume_step if path != "" else None, checkpoint=path or None)  # a script's: unknown
    except OSError as e:
        sys.stderr.write(f"zerorun: warning: cannot record the restart in {run_dir}: {e.strerror}\n")
