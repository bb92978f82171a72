"""Saving a sharded checkpoint, atomically (loading it: ``loading.py``; consolidating it to one file:
``consolidation.py``; finding and checking checkpoint folders without the model: ``files.py``).

A checkpoint is a folder ``<checkpoint.dir>/step-00000100/`` holding torch.distributed.checkpoint (DCP)
files (every rank writes only its own shards: Note [Checkpoint layout] in ``zero/state.py``), ``zerorun.json``
(step, scheduler, optimizer param-group options, fp16 loss scaler and skipped steps, data position, layout,
resolved recipe, the launcher's job id) and the marker
``COMPLETE``.

Note [Atomic checkpoints]: ranks write into ``.step-N.<job>.tmp`` (named by the job, so that a save never
removes another job's: Note [Checkpoint folder lock] in ``lock.py``); once DCP's save has returned
on every rank (its coordinator writes ``.metadata`` after gathering every rank's result), rank 0 writes
``zerorun.json``, renames the folder to ``step-N`` in one ``os.rename`` and only then writes ``COMPLETE``
(each file fsynced, then its folder). A run killed at any point leaves either a ``.step-N.<job>.tmp`` folder
or a ``step-N`` without the marker: neither is ever picked as the latest, and the previous checkpoint is
untouched. Old checkpoints are pruned only after the new one is complete.

Note [Exact resume]: with the same world size the resumed run reproduces the uninterrupted one bit for bit:
masters and optimizer states are restored exactly (wherever offload keeps them), the scheduler, the fp16
loss scaler (scale, good steps since its last change, skipped steps) and param-group options (lr) too, every
rank's RNG state (dropout) is restored after everything that consumes random numbers at start-up, and the
data stream restarts at the same epoch and micro-batch (the sampler's order depends only on seed and epoch;
the loader has its own generator, so creating it never draws from the global RNG). With another world
size, micro-batch size or stage, model and optimizer states are resharded exactly; the data stream resumes at
the samples consumed in the epoch rounded down to whole micro-batches on every rank (its order differs, being
split over other ranks) and ranks beyond the saved world size keep their fresh RNG state.

Loading never unpickles arbitrary objects: DCP's tensor files are read with ``torch.load(weights_only=True)``,
its ``.metadata`` with an unpickler that admits only DCP's metadata classes (:class:`SafeReader`), every
non-tensor entry is refused before any data is read, and the load planner never unpickles and checks that
every target was written (Note [Untrusted checkpoints] in ``safety.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable

import torch

from zerorun.checkpoint.files import FORMAT, MARKER, META, DataPosition, _sha256, list_complete, step_dir
from zerorun.checkpoint.safety import why_not_written
from zerorun.errors import ZerorunError


@contextmanager
def quiet_sharded_tensor():
    """DCP touches ShardedTensor attributes that warn of its deprecation (Note [Checkpoint layout] says why
    zerorun uses it); the warning is not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*ShardedTensor.*")
        yield


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, value: Any) -> None:
    """Write ``value`` to ``path`` whole or not at all (a temporary name, fsynced, renamed): a marker cut
    short by a full disk or a kill never exists under its name."""
    tmp = path + ".part"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def rng_tensors(rank: int) -> dict[str, torch.Tensor]:
    """This process's RNG states as checkpoint entries named by ``rank``: ``rng/R/cpu`` (and ``rng/R/cuda``)."""
    out = {f"rng/{rank}/cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out[f"rng/{rank}/cuda"] = torch.cuda.get_rng_state()
    return out


def _job_token(pid: int) -> str:
    """What names this job's save folders: the launcher's job id (every rank has it), else ``p`` and rank 0's
    pid (a program of its own calling :func:`save`)."""
    from zerorun.launch.marks import JOB_ENV

    job = os.environ.get(JOB_ENV, "")
    return job if job and job.replace("-", "").isalnum() else f"p{pid}"


def _tmp_dir(root: str, final: str, pid: int) -> str:
    """The folder a save of ``final`` is written into first: ``.step-N.<job>.tmp`` (Note [Atomic checkpoints])."""
    return os.path.join(root, f".{os.path.basename(final)}.{_job_token(pid)}.tmp")


def save(engine, root: str, step: int, *, scheduler=None, position: DataPosition | None = None,
         recipe: dict[str, Any] | None = None, keep: int = 0) -> tuple[str, float, int]:
    """Save a checkpoint of ``engine`` after ``step`` under ``root`` (into ``root/step-N``), atomically (Note
    [Atomic checkpoints]), and keep only the ``keep`` most recent complete ones. Collective: every rank of the
    engine calls it, with the same arguments; they are checked on every rank before anything is written.

    Args:
        step: the step just trained (a whole number >= 0).
        scheduler: the LR scheduler, or None (none is saved; :func:`~zerorun.checkpoint.loading.load` then
            takes none); its ``state_dict`` must be JSON-able, as LambdaLR's is.
        position: this rank's data position after ``step`` (equal on every rank); None: ``DataPosition()``.
        recipe: JSON-able data saved with the checkpoint (the CLI's resolved recipe); its
            ``train.micro_batch_size``, if any, lets a resume at another world size find its data position.
        keep: how many complete checkpoints to keep in ``root``, the newest; 0 (the default) keeps every one.

    Returns:
        ``(path, seconds, bytes)``: the checkpoint folder, wall time of the save (s) and, on rank 0, its size
        on disk (bytes, every rank's files; 0 on other ranks).

    Raises:
        ZerorunError: one line on every rank, with nothing left on disk: an argument that is not as above
            (naming it, ``checkpoint.save: <argument>: ...``), before anything is written; the folder cannot be
            made or written (naming it and why); rank 0 failed while finishing the save (any exception: it
            names it, the other ranks name rank 0).
    """
    t0 = time.perf_counter()
    scheduler_state, micro = agreed(engine, lambda: _arguments(step, scheduler, position, recipe, keep),
                                    "checkpoint.save", {"step": step if whole(step) else 0})
    position = position if position is not None else DataPosition()
    tensors, layout = _state(engine)  # before the folder is made: a failure leaves nothing behind
    final = step_dir(root, step)
    tmp, pid = _make_tmp(engine, root, final)
    _write_shards(engine, tmp, step, tensors)
    reason = None
    failed = torch.zeros(1, device=engine.buffers[0].device)
    if engine.rank == 0:
        def meta() -> dict[str, Any]:
            return _meta(engine, step, layout, scheduler_state, position, recipe, micro, tmp)
        try:  # whatever fails, nothing half-written is left to be taken (_publish removes it)
            reason = _publish(tmp, final, root, step, meta)
        except Exception as e:  # noqa: BLE001 - told to the other ranks below, one line on every rank
            text = str(e).strip()
            reason = f"{type(e).__name__}" + (f": {text.splitlines()[0]}" if text else "")
        if reason is not None:
            failed += 1
        else:
            _prune(root, keep, pid)
    engine.comm.all_reduce_now(failed)  # also the barrier: every rank learns of rank 0's failure
    if failed.item():
        raise ZerorunError(f"checkpoint.dir: cannot save step {step} into {tmp}: "
                           + (reason if engine.rank == 0 else "failed on rank 0"))
    size = sum(os.path.getsize(os.path.join(final, n)) for n in os.listdir(final)) if engine.rank == 0 else 0
    return final, time.perf_counter() - t0, size


def whole(value: Any) -> bool:
    """Whether ``value`` is an int (not a bool) >= 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unjsonable(value: Any, where: str) -> str | None:
    """The first part of ``value`` (``where`` and its key path) that ``json.dump`` cannot write, or None."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, (list, tuple)):
        return next(filter(None, (_unjsonable(v, f"{where}[{i}]") for i, v in enumerate(value))), None)
    if isinstance(value, dict):
        for k, v in value.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                return f"{where}: key {k!r} ({type(k).__name__})"
            found = _unjsonable(v, f"{where}[{k!r}]")
            if found:
                return found
        return None
    return f"{where}: {type(value).__name__}"


def _arguments(step, scheduler, position, recipe, keep) -> tuple[dict[str, Any] | None, int | None]:
    """:func:`save`'s arguments checked on this rank. Returns the scheduler's state (or None) and the
    recipe's ``train.micro_batch_size`` (or None).

    Raises:
        ZerorunError: ``checkpoint.save: <argument>: ...``, one line.
    """
    if not whole(step):
        raise ZerorunError(f"checkpoint.save: step: expected a whole number >= 0, got {step!r}")
    if not whole(keep):
        raise ZerorunError(f"checkpoint.save: keep: expected a whole number >= 0 (0 keeps every checkpoint), "
                           f"got {keep!r}")
    if position is not None and not (isinstance(position, DataPosition) and whole(position.epoch)
                                     and whole(position.batch)):
        raise ZerorunError(f"checkpoint.save: position: expected a DataPosition of whole numbers >= 0 or None, "
                           f"got {position!r}")
    micro = None
    if recipe is not None:
        bad = _unjsonable(recipe, "recipe") if isinstance(recipe, dict) else "recipe: not a dict"
        if bad:
            raise ZerorunError(f"checkpoint.save: {bad} is not JSON-able (expected JSON-able data or None)")
        train = recipe.get("train")
        micro = train.get("micro_batch_size") if isinstance(train, dict) else None
        if micro is not None and not (whole(micro) and micro > 0):
            raise ZerorunError(f"checkpoint.save: recipe['train']['micro_batch_size']: expected a whole number > 0, "
                               f"got {micro!r}")
    state = None
    if scheduler is not None:
        if not callable(getattr(scheduler, "state_dict", None)):
            raise ZerorunError(f"checkpoint.save: scheduler: expected an LR scheduler (with state_dict) or None, "
                               f"got {type(scheduler).__name__}")
        state = scheduler.state_dict()
        bad = _unjsonable(state, "scheduler.state_dict()")
        if bad:
            raise ZerorunError(f"checkpoint.save: {bad} is not JSON-able: zerorun.json cannot hold this scheduler")
    return state, micro


def agreed(engine, check: Callable[[], Any], who: str, same: dict[str, int] | None = None) -> Any:
    """``check()`` on every rank, agreed on before anything is written or read: a rank whose own check passes
    raises too when another rank's does not (instead of waiting for it in the collectives that follow), and
    the ints in ``same`` (``{"step": 3}``, the same keys on every rank) must be equal on every rank (compared by
    their residues modulo 65521 and their squares, summed: equal exactly when the sums' variance is zero; values
    that differ by a multiple of 65521 pass). Collective. Returns ``check()``.

    Raises:
        ZerorunError: this rank's own error (a ZerorunError's line; any other exception as ``who: Type: text``),
            or one naming the first rank whose check failed, or the ``same`` values that differ.
    """
    problem, found = None, None
    try:
        found = check()
    except ZerorunError as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001 - any failure of one rank's check, one line on every rank
        problem = f"{who}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    same = same or {}
    values = [v % 65521 for v in same.values()]
    flags = torch.zeros(engine.world_size + 2 * len(values), dtype=torch.float64, device=engine.buffers[0].device)
    flags[engine.rank] = 1.0 if problem else 0.0
    for i, v in enumerate(values):
        flags[engine.world_size + 2 * i], flags[engine.world_size + 2 * i + 1] = float(v), float(v * v)
    engine.comm.all_reduce_now(flags)
    if problem:
        raise ZerorunError(problem)
    sums = flags.tolist()
    bad = [r for r, f in enumerate(sums[:engine.world_size]) if f]
    if bad:
        raise ZerorunError(f"{who}: rank {bad[0]} was given an argument it refused (its error names it): every "
                           "rank must pass the same; nothing was done")
    n, rest = engine.world_size, sums[engine.world_size:]
    differ = [name for k, name in enumerate(same) if n * rest[2 * k + 1] != rest[2 * k] ** 2]
    if differ:
        raise ZerorunError(f"{who}: the ranks were given different values of {', '.join(differ)} (this rank: "
                           f"{', '.join(str(same[d]) for d in differ)}): every rank must pass the same; nothing "
                           "was done")
    return found


def _make_tmp(engine, root: str, final: str) -> tuple[str, int]:
    """Rank 0 makes the save's folder (after removing this job's leftovers, Note [Checkpoint folder lock]);
    every rank learns its name and whether it was made. Collective.

    Returns:
        ``(tmp, pid)``: the folder, and rank 0's pid (what names it when no job id does).
    """
    # [failed, rank 0's pid]: the pid names the save's folder when no job id does (exact in fp32: < 2**24)
    flags = torch.zeros(2, device=engine.buffers[0].device)  # where the collectives run
    reason = ""
    if engine.rank == 0:
        flags[1] = os.getpid()
        try:
            os.makedirs(root, exist_ok=True)
            for name in os.listdir(root):  # this job's leftovers only (Note [Checkpoint folder lock])
                if name.startswith(".") and name.endswith(f".{_job_token(os.getpid())}.tmp"):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            os.makedirs(_tmp_dir(root, final, os.getpid()))
        except OSError as e:
            flags[0] += 1
            reason = e.strerror
    engine.comm.all_reduce_now(flags)  # every rank learns of rank 0's failure instead of hanging
    not_made, pid = flags.tolist()  # a save syncs with the host anyway (it is no steady-state step)
    tmp = _tmp_dir(root, final, int(pid))
    if not_made:
        raise ZerorunError(f"checkpoint.dir: cannot create {tmp}" + (f": {reason}" if engine.rank == 0 else
                                                                     " (on rank 0)"))
    return tmp, int(pid)


def _state(engine) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's shards and RNG states to save, and the engine's layout (Note [Checkpoint layout])."""
    import torch.distributed as dist

    from zerorun.zero.state import engine_state

    tensors, layout = engine_state(engine)
    tensors.update(rng_tensors(dist.get_rank(engine.comm.group)))
    return tensors, layout


def _write_shards(engine, tmp: str, step: int, tensors: dict[str, Any]) -> None:
    """Every rank writes ``tensors`` (:func:`_state`) into ``tmp`` with DCP. Collective; on failure rank 0
    removes ``tmp`` and every rank raises ZerorunError."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from zerorun.zero.state_paging import WRITER_OPTIONS

    group = engine.comm.group
    pager = getattr(tensors, "pager", None)  # disk offload: Note [Paged checkpoints] in zero/state_paging.py
    try:
        with quiet_sharded_tensor():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True,
                                                                  **(WRITER_OPTIONS if pager else {})),
                     planner=pager.save_planner() if pager else None, process_group=group)
    except CheckpointException as e:  # raised on every rank alike (DCP gathers and broadcasts the failures)
        why = why_not_written(e, tmp)
        dist.barrier(group)  # every rank has looked at the folder before rank 0 removes it
        if engine.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ZerorunError(f"checkpoint.dir: cannot save step {step} into {tmp}: {why}") from None


def _meta(engine, step: int, layout, scheduler: dict[str, Any] | None, position: DataPosition,
          recipe: dict[str, Any] | None, micro: int | None, tmp: str) -> dict[str, Any]:
    """``zerorun.json``'s content (rank 0, once every rank's files are in ``tmp``: dcp.save has returned, its
    coordinator having gathered them all): ``scheduler`` is its state, ``micro`` the micro-batch size (None:
    unknown). ``job``: the launcher's job id that saves (whose tracker runs a resume continues, Note [Tracker
    resume] in telemetry/trackers.py; None in a program of its own). ``model_config``: the config the model was
    built from where it names one (``model.hf``'s ``CausalLM.zerorun_model_config``), which ``consolidate --hf``
    rebuilds it from, not the pretrained folder's ``config.json`` at export time (a review: edited or removed
    since, it exported another model or none)."""
    from zerorun.launch.marks import JOB_ENV
    from zerorun.recipe import masked

    return {
        "format": FORMAT, "step": step, "world_size": engine.world_size, "stage": engine.stage,
        "layout": layout, "scheduler": scheduler,
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "skipped_steps": engine.skipped_steps, "job": os.environ.get(JOB_ENV) or None,
        "data": {"epoch": position.epoch, "batch": position.batch, "world_size": engine.world_size,
                 "micro_batch_size": micro},
        # launch.env values masked (Note [Masked environment values] in recipe/text.py)
        "recipe": masked(recipe) if recipe is not None else None,
        "model_config": getattr(engine.module, "zerorun_model_config", lambda: None)(),
        "files": {name: {"bytes": os.path.getsize(os.path.join(tmp, name)),
                         "sha256": _sha256(os.path.join(tmp, name))} for name in sorted(os.listdir(tmp))}}


def _publish(tmp: str, final: str, root: str, step: int, meta: Callable[[], dict[str, Any]]) -> str | None:
    """Rank 0: write ``meta()`` into ``tmp``, rename it to ``final`` (an earlier save of the step set aside, put
    back on failure) and mark it complete (Note [Atomic checkpoints]). Returns None, or why it failed (an
    OSError: a full disk, a file-size limit), with nothing half-written left.

    Raises:
        Exception: any other exception (of ``meta()``), after removing what was written as for an OSError.
    """
    old = tmp[:-len(".tmp")] + ".old.tmp"
    moved = renamed = False
    try:
        _write_json(os.path.join(tmp, META), meta())
        _fsync(tmp)
        if os.path.exists(final):  # a step saved before, e.g. by a run resumed from an earlier checkpoint
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            moved = True
        os.rename(tmp, final)
        renamed = True
        _fsync(root)
        _write_json(os.path.join(final, MARKER), {"step": step, "saved_at": time.time(),  # zerorun.json's too
                                                  "sha256": _sha256(os.path.join(final, META))})
        _fsync(final)
    except BaseException as e:  # noqa: BLE001 - whatever it is, nothing half-written is left
        shutil.rmtree(final if renamed else tmp, ignore_errors=True)
        if moved and not os.path.exists(final):
            os.rename(old, final)  # the earlier save of this step, complete, back in place
        if not isinstance(e, OSError):
            raise
        return f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
    return None


def _prune(root: str, keep: int, pid: int) -> None:
    """Rank 0, after a complete save: remove all but the ``keep`` newest complete checkpoints (``keep`` 0:
    none), and this job's set-aside earlier saves."""
    for _, _, path in (list_complete(root)[:-keep] if keep else []):
        shutil.rmtree(path, ignore_errors=True)
    try:
        names = os.listdir(root)
    except OSError:  # the save is complete: leftovers are removed by the next one
        return
    for name in names:
        if name.startswith(".") and name.endswith(f".{_job_token(pid)}.old.tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
