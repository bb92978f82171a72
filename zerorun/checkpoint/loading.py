"""Loading a sharded checkpoint into an engine, at any world size and stage (Note [Checkpoint layout] in
``zero/state.py``; Note [Exact resume] in ``saving.py``). Nothing is unpickled (Note [Untrusted checkpoints] in
``safety.py``)."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from zerorun.checkpoint.files import META, DataPosition, check
from zerorun.checkpoint.safety import SafeLoadPlanner, SafeReader, reason
from zerorun.checkpoint.saving import agreed, quiet_sharded_tensor, rng_tensors, whole
from zerorun.errors import ZerorunError


def load(path: str, engine, *, scheduler=None, micro_batch_size: int | None = None) -> tuple[int, DataPosition]:
    """Restore ``engine`` (masters, optimizer states, frozen parameters, module buffers), ``scheduler``, the
    param groups' options and this rank's RNG states from the checkpoint at ``path`` (a ``step-N`` folder
    :func:`~zerorun.checkpoint.saving.save` wrote; any world size and stage: Note [Checkpoint layout] in
    zero/state.py). Collective: every rank calls it.

    Args:
        scheduler: the LR scheduler to restore: given exactly when the checkpoint was saved with one.
        micro_batch_size: this run's; None: the same as the checkpoint's (it matters only at another world size).

    Returns:
        ``(step, position)``: the step the checkpoint was saved after and this rank's data position for the
        current world size and ``micro_batch_size`` (Note [Exact resume] in saving.py).

    Raises:
        ZerorunError: not a checkpoint (the folder of ``step-N`` ones: naming the newest to pass), an incomplete or
            unreadable one, one of another model (the message names the file and the key), a ``scheduler``
            given for a checkpoint saved without one or the other way round, a ``micro_batch_size`` that is no
            whole number > 0 (these before anything is restored), identically on every rank.
    """
    import torch.distributed as dist

    from zerorun.zero.state import CheckpointMismatch, load_engine_state

    meta = agreed(engine, lambda: _checked(path, engine, scheduler, micro_batch_size), "checkpoint.load")
    rank = dist.get_rank(engine.comm.group)
    # ranks beyond the saved world size keep their own RNG state (Note [Exact resume])
    rng = {k: v.clone() for k, v in rng_tensors(rank).items()} if rank < meta["world_size"] else {}
    try:
        load_engine_state(engine, meta["layout"], functools.partial(_read, path, engine, rng))
    except CheckpointMismatch as e:  # e.g. disk offload and an optimizer state this optimizer does not keep
        raise ZerorunError(f"{os.path.join(path, META)}: another optimizer: {e}") from None
    if scheduler is not None:
        try:
            scheduler.load_state_dict(meta["scheduler"])
        except Exception as e:  # noqa: BLE001 - a state torch refuses (edited by hand; files._check_fields)
            raise ZerorunError(f"{os.path.join(path, META)}: scheduler: cannot be restored ({type(e).__name__}: "
                               f"{e}): edited by hand? refusing the checkpoint") from None
    engine.skipped_steps = int(meta.get("skipped_steps", 0))
    if engine.scaler is not None and meta.get("loss_scaler"):  # fp16 after fp16; else the recipe's initial scale
        engine.scaler.load_state_dict(meta["loss_scaler"])
    for key, value in rng.items():
        if key.endswith("/cpu"):
            torch.set_rng_state(value)
        else:
            torch.cuda.set_rng_state(value)
    return int(meta["step"]), _position(meta["data"], engine.world_size, micro_batch_size)


def _checked(path: str, engine, scheduler, micro_batch_size: int | None) -> dict[str, Any]:
    """:func:`load`'s arguments and the checkpoint's ``zerorun.json`` checked on this rank, before anything is
    restored. Returns that metadata. Raises ZerorunError (see :func:`load`)."""
    from zerorun.zero.state import compare_layout

    if micro_batch_size is not None and not (whole(micro_batch_size) and micro_batch_size > 0):
        raise ZerorunError(f"checkpoint.load: micro_batch_size: expected a whole number > 0 or None, got "
                           f"{micro_batch_size!r}")
    meta = check(path)
    if (scheduler is None) != (meta["scheduler"] is None):
        raise ZerorunError(f"{os.path.join(path, META)}: " + (
            "saved without a scheduler: load it with scheduler=None" if scheduler is not None else
            "holds a scheduler's state: pass the scheduler (scheduler=...) to restore it"))
    problem = compare_layout(engine, meta["layout"])
    if problem:
        what = "another optimizer" if problem.startswith("optimizer ") else "another model"
        raise ZerorunError(f"{os.path.join(path, META)}: {what}: {problem}")
    return meta


def _read(path: str, engine, rng: dict[str, torch.Tensor], targets: dict[str, Any]) -> None:
    """Read ``targets`` (and this rank's RNG states into ``rng``) from the checkpoint at ``path`` with DCP,
    safely. Collective: every rank learns of any rank's unwritten target and raises the same ZerorunError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    group = engine.comm.group
    targets.update(rng)
    planner = SafeLoadPlanner(getattr(targets, "pager", None))
    try:
        with quiet_sharded_tensor():
            dcp.load(targets, storage_reader=SafeReader(path), planner=planner, process_group=group)
    except CheckpointException as e:
        raise ZerorunError(f"{path}: cannot read the checkpoint: {reason(e)}") from None
    problem = planner.unwritten()  # every rank learns of any rank's unwritten target: the same error
    flag = torch.tensor([1.0 if problem else 0.0], device=engine.buffers[0].device)
    engine.comm.all_reduce_now(flag)  # a script may end here: Note [Last reference on the issuing thread]
    if flag.item():
        raise ZerorunError(f"{path}: the checkpoint does not hold all of "
                           + (problem if problem else "the targets of another rank") + ": not resumed")


def _position(data: dict[str, Any], world_size: int, micro_batch_size: int | None) -> DataPosition:
    """This rank's data position from the checkpoint's ``data`` record: the same samples consumed in the epoch
    with another world size or micro-batch size (Note [Exact resume] in saving.py); a micro-batch size not
    known (None) on either side is taken to be the other's."""
    position = DataPosition(data["epoch"], data["batch"])
    saved = data.get("micro_batch_size") or micro_batch_size or 1
    micro_batch_size = micro_batch_size or saved
    if (data["world_size"], saved) != (world_size, micro_batch_size):
        samples = data["batch"] * saved * data["world_size"]
        position.batch = samples // (micro_batch_size * world_size)
    return position
