"""Sharded checkpoints on disk: atomic save, resume, consolidation to one file (finding and checking
checkpoint folders without the model: ``checkpoint_files.py``).

A checkpoint is a folder ``<checkpoint.dir>/step-00000100/`` holding torch.distributed.checkpoint (DCP)
files (every rank writes only its own shards: Note [Checkpoint layout] in ``zero/state.py``), ``zerorun.json``
(step, scheduler, optimizer param-group options, fp16 loss scaler and skipped steps, data position, layout,
resolved recipe) and the marker
``COMPLETE``.

Note [Atomic checkpoints]: ranks write into ``.step-N.<job>.tmp`` (named by the job, so that a save never
removes another job's: Note [Checkpoint folder lock] in ``checkpoint_lock.py``); once DCP's save has returned
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
size, micro-batch size or stage, model and optimizer states are resharded exactly; the data stream resumes
at the same number of samples consumed in the epoch (its order differs, being split over other ranks) and
ranks beyond the saved world size keep their fresh RNG state.

Loading never unpickles arbitrary objects: DCP's tensor files are read with ``torch.load(weights_only=True)``,
its ``.metadata`` with an unpickler that admits only DCP's metadata classes (:class:`SafeReader`), every
non-tensor entry is refused before any data is read, and the load planner never unpickles and checks that
every target was written (Note [Untrusted checkpoints] in ``dcp_safety.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from zerorun.dcp_safety import SafeLoadPlanner, SafeReader, _failures, _why, reason  # noqa: F401 (API)
from zerorun.checkpoint_files import (FORMAT, MARKER, META, _STEP_DIR, _sha256, check, check_layout,  # noqa: F401
                                      latest, list_complete, read_meta, resolve, step_dir)
from zerorun.errors import ZerorunError

@contextmanager
def _quiet_sharded_tensor():
    """DCP touches ShardedTensor attributes that warn of its deprecation (Note [Checkpoint layout] says why
    zerorun uses it); the warning is not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*ShardedTensor.*")
        yield


# ------------------------------------------------------------------------------------------------ saving
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


def _rng_tensors(rank: int) -> dict[str, torch.Tensor]:
    out = {f"rng/{rank}/cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out[f"rng/{rank}/cuda"] = torch.cuda.get_rng_state()
    return out


def _job_token(pid: int) -> str:
    """What names this job's save folders: the launcher's job id (every rank has it), else ``p`` and rank 0's
    pid (a program of its own calling :func:`save`)."""
    from zerorun.launch.plan import JOB_ENV

    job = os.environ.get(JOB_ENV, "")
    return job if job and job.replace("-", "").isalnum() else f"p{pid}"


def _tmp_dir(root: str, final: str, pid: int) -> str:
    """The folder a save of ``final`` is written into first: ``.step-N.<job>.tmp`` (Note [Atomic checkpoints])."""
    return os.path.join(root, f".{os.path.basename(final)}.{_job_token(pid)}.tmp")


@dataclass
class DataPosition:
    """Where a rank is in the training data: ``epoch`` and micro-batches of it consumed (``batch``)."""

    epoch: int = 0
    batch: int = 0


def save(engine, root: str, step: int, *, scheduler, position: DataPosition, recipe: dict[str, Any],
         keep: int) -> tuple[str, float, int]:
    """Save a checkpoint of ``engine`` after ``step`` under ``root``, atomically (Note [Atomic checkpoints]),
    and keep only the ``keep`` most recent complete ones. Collective: every rank of the engine calls it.

    Args:
        scheduler: the LR scheduler (its ``state_dict`` must be JSON-able, as LambdaLR's is).
        position: this rank's data position after ``step`` (equal on every rank).
        recipe: the resolved recipe as JSON-able data.

    Returns:
        ``(path, seconds, bytes)``: the checkpoint folder, wall time of the save (s) and, on rank 0, its size
        on disk (bytes, every rank's files; 0 on other ranks).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from zerorun.recipe import masked
    from zerorun.zero.state import engine_state
    from zerorun.zero.state_paging import WRITER_OPTIONS

    t0 = time.perf_counter()
    group = engine.comm.group
    final = step_dir(root, step)
    # [failed, rank 0's pid]: the pid names the save's folder when no job id does (exact in fp32: < 2**24)
    flags = torch.zeros(2, device=engine.buffers[0].device)  # where the collectives run
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
    dist.all_reduce(flags, group=group)  # every rank learns of rank 0's failure instead of hanging
    not_made, pid = flags.tolist()  # a save syncs with the host anyway (it is no steady-state step)
    tmp = _tmp_dir(root, final, int(pid))
    if not_made:
        raise ZerorunError(f"checkpoint.dir: cannot create {tmp}" + (f": {reason}" if engine.rank == 0 else
                                                                     " (on rank 0)"))
    tensors, layout = engine_state(engine)
    tensors.update(_rng_tensors(dist.get_rank(group)))
    pager = getattr(tensors, "pager", None)  # disk offload: Note [Paged checkpoints] in zero/state_paging.py
    try:
        with _quiet_sharded_tensor():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True,
                                                                  **(WRITER_OPTIONS if pager else {})),
                     planner=pager.save_planner() if pager else None, process_group=group)
    except CheckpointException as e:  # raised on every rank alike (DCP gathers and broadcasts the failures)
        why = _why(e, tmp)
        dist.barrier(group)  # every rank has looked at the folder before rank 0 removes it
        if engine.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ZerorunError(f"checkpoint.dir: cannot save step {step} into {tmp}: {why}") from None
    reason = ""
    failed = torch.zeros(1, device=engine.buffers[0].device)
    if engine.rank == 0:
        moved = renamed = False
        old = tmp[:-len(".tmp")] + ".old.tmp"
        try:
            _write_json(os.path.join(tmp, META), {
                "format": FORMAT, "step": step, "world_size": engine.world_size, "stage": engine.stage,
                "layout": layout, "scheduler": scheduler.state_dict(),
                "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
                "skipped_steps": engine.skipped_steps,
                "data": {"epoch": position.epoch, "batch": position.batch, "world_size": engine.world_size,
                         "micro_batch_size": recipe["train"]["micro_batch_size"]},
                "recipe": masked(recipe),  # launch.env values masked (Note [Masked environment values])
                # every rank's files are complete once dcp.save returned (its coordinator gathered them all)
                "files": {name: {"bytes": os.path.getsize(os.path.join(tmp, name)),
                                 "sha256": _sha256(os.path.join(tmp, name))} for name in sorted(os.listdir(tmp))}})
            _fsync(tmp)
            if os.path.exists(final):  # a step saved before, e.g. by a run resumed from an earlier checkpoint
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                moved = True
            os.rename(tmp, final)
            renamed = True
            _fsync(root)
            _write_json(os.path.join(final, MARKER), {"step": step, "saved_at": time.time()})
            _fsync(final)
        except OSError as e:  # a full disk or a file-size limit: nothing half-written is left to be taken
            failed += 1
            reason = f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
            shutil.rmtree(final if renamed else tmp, ignore_errors=True)
            if moved and not os.path.exists(final):
                os.rename(old, final)  # the earlier save of this step, complete, back in place
        else:
            for _, _, path in list_complete(root)[:-keep]:
                shutil.rmtree(path, ignore_errors=True)
            for name in os.listdir(root):
                if name.startswith(".") and name.endswith(f".{_job_token(int(pid))}.old.tmp"):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    dist.all_reduce(failed, group=group)  # also the barrier: every rank learns of rank 0's failure
    if failed.item():
        raise ZerorunError(f"checkpoint.dir: cannot save step {step} into {tmp}: "
                           + (reason if engine.rank == 0 else "failed on rank 0"))
    size = sum(os.path.getsize(os.path.join(final, n)) for n in os.listdir(final)) if engine.rank == 0 else 0
    return final, time.perf_counter() - t0, size


# ----------------------------------------------------------------------------------------------- resuming
def load(path: str, engine, *, scheduler, micro_batch_size: int) -> tuple[int, DataPosition]:
    """Restore ``engine`` (masters, optimizer states, frozen parameters, module buffers), ``scheduler``, the
    param groups' options and this rank's RNG states from the checkpoint at ``path`` (any world size and
    stage: Note [Checkpoint layout]). Collective.

    Returns:
        ``(step, position)``: the step the checkpoint was saved after and this rank's data position for the
        current world size and ``micro_batch_size`` (Note [Exact resume]).

    Raises:
        ZerorunError: incomplete or unreadable checkpoint, or one of another model (the message names the
            file and the key), identically on every rank.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from zerorun.zero.state import CheckpointMismatch, compare_layout, load_engine_state

    meta = check(path)
    problem = compare_layout(engine, meta["layout"])
    if problem:
        raise ZerorunError(f"{os.path.join(path, META)}: another model: {problem}")
    group = engine.comm.group
    rank = dist.get_rank(group)

    # ranks beyond the saved world size keep their own RNG state (Note [Exact resume])
    rng = {k: v.clone() for k, v in _rng_tensors(rank).items()} if rank < meta["world_size"] else {}

    def run(targets: dict[str, Any]) -> None:
        targets.update(rng)
        planner = SafeLoadPlanner(getattr(targets, "pager", None))
        try:
            with _quiet_sharded_tensor():
                dcp.load(targets, storage_reader=SafeReader(path), planner=planner, process_group=group)
        except CheckpointException as e:
            raise ZerorunError(f"{path}: cannot read the checkpoint: {reason(e)}") from None
        problem = planner.unwritten()  # every rank learns of any rank's unwritten target: the same error
        flag = torch.tensor([1.0 if problem else 0.0], device=engine.buffers[0].device)
        dist.all_reduce(flag, group=group)
        if flag.item():
            raise ZerorunError(f"{path}: the checkpoint does not hold all of "
                               + (problem if problem else "the targets of another rank") + ": not resumed")

    try:
        load_engine_state(engine, meta["layout"], run)
    except CheckpointMismatch as e:  # e.g. disk offload and an optimizer state this optimizer does not keep
        raise ZerorunError(f"{os.path.join(path, META)}: another optimizer: {e}") from None
    scheduler.load_state_dict(meta["scheduler"])
    engine.skipped_steps = int(meta.get("skipped_steps", 0))
    if engine.scaler is not None and meta.get("loss_scaler"):  # fp16 after fp16; else the recipe's initial scale
        engine.scaler.load_state_dict(meta["loss_scaler"])
    for key, value in rng.items():
        if key.endswith("/cpu"):
            torch.set_rng_state(value)
        else:
            torch.cuda.set_rng_state(value)
    data = meta["data"]
    position = DataPosition(data["epoch"], data["batch"])
    if (data["world_size"], data["micro_batch_size"]) != (engine.world_size, micro_batch_size):
        samples = data["batch"] * data["micro_batch_size"] * data["world_size"]
        position.batch = samples // (micro_batch_size * engine.world_size)
    return int(meta["step"]), position


class _SkipSampler(torch.utils.data.Sampler):
    """``sampler``'s indices without the first ``skip``."""

    def __init__(self, sampler, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


def batch_stream(dataset, sampler, micro_batch_size: int, position: DataPosition) -> Iterator[Any]:
    """Endless micro-batches of ``micro_batch_size`` samples from ``dataset`` in ``sampler``'s order (a
    ``DistributedSampler``: ``set_epoch`` is called at each epoch), starting at ``position``, which is kept
    up to date as batches are yielded (Note [Exact resume])."""
    from torch.utils.data import DataLoader

    generator = torch.Generator()  # the loader's own: making its iterator draws no global random number
    skip = position.batch
    while True:
        sampler.set_epoch(position.epoch)
        loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=_SkipSampler(sampler, skip * micro_batch_size),
                            drop_last=True, generator=generator)
        for batch in loader:
            position.batch += 1
            yield batch
        position.epoch += 1
        position.batch = skip = 0


# ------------------------------------------------------------------------------------------- consolidate
def consolidate(path: str, out: str) -> tuple[int, int]:
    """Write the model of the checkpoint at ``path`` (or the latest one in a folder of checkpoints) as one
    ordinary state dict, without a process group: parameters as fp32 with their shapes, module buffers as
    saved, every ``state_dict`` key of the unsharded model (tied parameters under each name). ``out`` ends in
    ``.safetensors`` (safetensors) or ``.pt`` (``torch.save``); it is written under a temporary name, given
    the umask's permissions (``0666 & ~umask``) and renamed. Holds one copy of the model in memory.

    Returns:
        ``(tensors written, bytes of out)``.

    Raises:
        ZerorunError: bad output suffix, incomplete/truncated/unreadable checkpoint (naming file and key).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from zerorun.files import apply_umask
    from zerorun.zero.state import dtype_of

    if not out.endswith((".safetensors", ".pt")):
        raise ZerorunError(f"--out {out}: the file name must end in .safetensors or .pt")
    path = resolve(path)
    meta = check(path)
    layout = meta["layout"]
    targets: dict[str, torch.Tensor] = {}
    shapes = {}
    for p in layout["params"]:
        targets[f"model/{p['name']}"] = torch.empty(int(torch.Size(p["shape"]).numel()), dtype=torch.float32)
        shapes[p["name"]] = p["shape"]
    for key, b in layout["buffers"].items():
        targets[f"model/{key}"] = torch.empty(b["shape"], dtype=dtype_of(b["dtype"]))
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            planner = SafeLoadPlanner()
            # a tensor of zero elements has nothing to read (no rank holds a part of it, so none saved it)
            dcp.load({k: t for k, t in targets.items() if t.numel()}, storage_reader=SafeReader(path),
                     planner=planner, no_dist=True)
    except (CheckpointException, RuntimeError, ValueError) as e:
        raise ZerorunError(f"{path}: cannot read the checkpoint: {reason(e)}") from None
    problem = planner.unwritten()
    if problem:
        raise ZerorunError(f"{path}: the checkpoint does not hold all of {problem}")
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for key, name in layout["state_dict"]:
        t = targets[f"model/{name}"]
        if name in shapes:
            t = t.view(shapes[name])
        if name in used and out.endswith(".safetensors"):  # safetensors stores no shared tensors
            t = t.clone()
        used.add(name)
        state[key] = t
    directory = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(directory, "." + os.path.basename(out) + ".tmp")
    try:
        os.makedirs(directory, exist_ok=True)
        if out.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file(state, tmp, metadata={"format": "pt", "zerorun_step": str(meta["step"])})
        else:
            torch.save(state, tmp)
        apply_umask(tmp)  # safetensors writes 0600 (zerorun/files.py)
        os.replace(tmp, out)
    except OSError as e:
        raise ZerorunError(f"--out {out}: cannot write: {e.strerror}") from None
    return len(state), os.path.getsize(out)
