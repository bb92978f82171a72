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
from zerorun.checkpoint.saving import quiet_sharded_tensor, rng_tensors
from zerorun.errors import ZerorunError


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

    from zerorun.zero.state import CheckpointMismatch, compare_layout, load_engine_state

    meta = check(path)
    problem = compare_layout(engine, meta["layout"])
    if problem:
        what = "another optimizer" if problem.startswith("optimizer ") else "another model"
        raise ZerorunError(f"{os.path.join(path, META)}: {what}: {problem}")
    rank = dist.get_rank(engine.comm.group)
    # ranks beyond the saved world size keep their own RNG state (Note [Exact resume])
    rng = {k: v.clone() for k, v in rng_tensors(rank).items()} if rank < meta["world_size"] else {}
    try:
        load_engine_state(engine, meta["layout"], functools.partial(_read, path, engine, rng))
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
    return int(meta["step"]), _position(meta["data"], engine.world_size, micro_batch_size)


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


def _position(data: dict[str, Any], world_size: int, micro_batch_size: int) -> DataPosition:
    """This rank's data position from the checkpoint's ``data`` record: the same samples consumed in the epoch
    with another world size or micro-batch size (Note [Exact resume])."""
    position = DataPosition(data["epoch"], data["batch"])
    if (data["world_size"], data["micro_batch_size"]) != (world_size, micro_batch_size):
        samples = data["batch"] * data["micro_batch_size"] * data["world_size"]
        position.batch = samples // (micro_batch_size * world_size)
    return position
