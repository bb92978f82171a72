"""Cases run on every rank of a :class:`distributed.RankPool` (tests/test_checkpoint_safety.py): checkpoint
saves that fail for lack of room, and what a save writes of ``launch.env``."""

from __future__ import annotations

import errno
import os
import resource

import torch.distributed as dist

from checkpoint_cases import _engine, _recipe, _train
from zerorun import checkpoint
from zerorun.checkpoint import saving
from zerorun.errors import ZerorunError


def save_with_env(root: str, env: dict) -> str:
    """Save after one step with ``launch.env`` = ``env`` in the recipe; return the checkpoint folder."""
    engine, scheduler = _engine(1, 0)
    _train(engine, scheduler, range(1, 2))
    path, _, _ = checkpoint.save(engine, root, 1, scheduler=scheduler, position=checkpoint.DataPosition(),
                                 recipe={**_recipe(), "launch": {"env": env}}, keep=2)
    engine.close()
    return path


def failing_saves(root: str, fsize_limit: int) -> dict:
    """Save step 1 normally; then step 2 under RLIMIT_FSIZE ``fsize_limit`` bytes on every rank (DCP's data
    files cannot be written: EFBIG); then step 1 again with the COMPLETE marker failing with ENOSPC on rank 0
    (after the folder was renamed into place). Returns each error (or None) and the folders left after each."""
    engine, scheduler = _engine(1, 0)
    _train(engine, scheduler, range(1, 2))

    def save(step: int):
        try:
            checkpoint.save(engine, root, step, scheduler=scheduler, position=checkpoint.DataPosition(),
                            recipe=_recipe(), keep=3)
            return None
        except ZerorunError as e:
            return str(e)

    out = {"first": save(1)}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, hard))
    try:
        out["fsize"] = save(2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    dist.barrier()
    out["after_fsize"] = sorted(os.listdir(root))
    out["latest_after_fsize"] = checkpoint.latest(root)

    write = saving._write_json

    def full_disk(path, value):
        if dist.get_rank() == 0 and os.path.basename(path) == checkpoint.MARKER:
            with open(path, "w") as f:
                f.write('{"step": 1, "sa')  # what a full disk leaves: a marker cut short
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write(path, value)

    saving._write_json = full_disk
    try:
        out["enospc"] = save(1)
    finally:
        saving._write_json = write
    dist.barrier()
    out["after_enospc"] = sorted(os.listdir(root))
    out["latest_after_enospc"] = checkpoint.latest(root)
    out["check_after_enospc"] = checkpoint.check(out["latest_after_enospc"])["step"]
    engine.close()
    return out


def save_beside_another_job(root: str, others: list[str]) -> list[str]:
    """Make the folders ``others`` (another job's saves in progress) under ``root``, save step 1 twice (the
    second replaces the first: its ``.old.tmp`` is removed); return what ``root`` holds then."""
    if dist.get_rank() == 0:
        for name in others:
            os.makedirs(os.path.join(root, name))
    dist.barrier()
    engine, scheduler = _engine(1, 0)
    _train(engine, scheduler, range(1, 2))
    for _ in range(2):
        checkpoint.save(engine, root, 1, scheduler=scheduler, position=checkpoint.DataPosition(), recipe=_recipe(),
                        keep=2)
    engine.close()
    return sorted(os.listdir(root))
