"""Cases run on every rank of a :class:`distributed.RankPool`: sharded checkpoints of the ZeRO engine.

Every step trains on one global batch of 12 sequences (seeded by the step), split evenly over the ranks, so
runs on 2 and 3 ranks compute the same gradients up to float summation order and their losses can be
compared step for step.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from parity_cases import _build
from zerorun import checkpoint
from zerorun.errors import ZerorunError
from zerorun.zero import ZeroConfig, default_param_groups, initialize
from zerorun.zero.precision import LossScaleConfig

GLOBAL_BATCH = 12


def _engine(stage: int, seed: int, model: str = "gpt", zero: dict | None = None, **model_kwargs):
    """The engine under test; ``zero``: more :class:`ZeroConfig` fields (precision, offload, ``loss_scale`` as
    a dict of :class:`LossScaleConfig` fields)."""
    model = _build(model, seed, **model_kwargs)
    zero = dict(zero or {})
    if "loss_scale" in zero:
        zero["loss_scale"] = LossScaleConfig(**zero["loss_scale"])
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 3e-3, "betas": (0.9, 0.95)},
                        param_groups=default_param_groups(model, 0.1),
                        config=ZeroConfig(stage=stage, bucket_mb=0.002, grad_clip=1.0,
                                          units=("Block",) if stage == 3 and type(model).__name__ == "GPT" else (),
                                          **zero))
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: min(1.0, (s + 1) / 3) * 0.97 ** s)
    return engine, scheduler


def _train(engine, scheduler, steps: range) -> list[float]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world_size
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        if type(engine.module).__name__ == "GPT":
            batch = torch.randint(0, 61, (GLOBAL_BATCH, 17), generator=g)[mine]
        else:
            batch = {"x": torch.randn(GLOBAL_BATCH, 7, generator=g)[mine],
                     "y": torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)[mine]}
        out = engine(batch)
        loss = out["loss"] if isinstance(out, dict) else out
        engine.backward(loss)
        engine.step()
        scheduler.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
    return losses


def _recipe() -> dict:
    return {"train": {"micro_batch_size": GLOBAL_BATCH // dist.get_world_size()}}


def snapshot(engine) -> dict:
    """Copies of this rank's fp32 master slices, optimizer states (per flat buffer), fp16 loss scaler state and
    skipped steps."""
    return {"masters": [m.clone() for m in engine.master_slices()],
            "optim": [{k: v.clone() for k, v in s.items()} for s in engine.optimizer_states()],
            "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
            "skipped": engine.skipped_steps}


def save_and_continue(root: str, stage: int, save_at: int, steps: int, zero: dict | None = None,
                      **model_kwargs) -> dict:
    """Train ``steps`` steps from seed 0, saving after step ``save_at``; return the losses after it, the
    checkpoint path, (rank 0) the full state dict at the save, and this rank's :func:`snapshot` at the save
    (``saved``) and at the end (``end``)."""
    engine, scheduler = _engine(stage, 0, zero=zero, **model_kwargs)
    torch.manual_seed(100 + dist.get_rank())
    _train(engine, scheduler, range(1, save_at + 1))
    path, seconds, nbytes = checkpoint.save(engine, root, save_at, scheduler=scheduler,
                                            position=checkpoint.DataPosition(3, 5), recipe=_recipe(), keep=2)
    full = engine.full_state_dict(rank0_only=False)
    saved = snapshot(engine)
    losses = _train(engine, scheduler, range(save_at + 1, steps + 1))
    end = snapshot(engine)
    engine.close()
    return {"path": path, "losses": losses, "bytes": nbytes, "seconds": seconds, "saved": saved, "end": end,
            "full": {k: v.clone() for k, v in full.items()} if dist.get_rank() == 0 else None}


def resume_and_continue(path: str, stage: int, steps: int, zero: dict | None = None, **model_kwargs) -> dict:
    """Build the engine from another seed, load ``path`` and train to ``steps``; return the losses, this
    rank's :func:`snapshot` right after the load (``loaded``) and at the end (``end``), and (rank 0) the
    model's state dict right after the load (``params``)."""
    engine, scheduler = _engine(stage, 1, zero=zero, **model_kwargs)
    torch.manual_seed(999)  # overwritten by the checkpoint's RNG state where the rank existed at the save
    step, position = checkpoint.load(path, engine, scheduler=scheduler,
                                     micro_batch_size=GLOBAL_BATCH // dist.get_world_size())
    loaded = snapshot(engine)
    full = engine.full_state_dict(rank0_only=False)
    params = {k: v.clone() for k, v in full.items()} if dist.get_rank() == 0 else None
    losses = _train(engine, scheduler, range(step + 1, steps + 1))
    end = snapshot(engine)
    engine.close()
    return {"step": step, "position": (position.epoch, position.batch), "losses": losses, "loaded": loaded,
            "end": end, "params": params, "lr": engine.optimizer.param_groups[0]["lr"]}


def load_error(path: str, **model_kwargs) -> str:
    """The one-line error of loading ``path`` into a GPT built with ``model_kwargs`` (stage 2)."""
    engine, scheduler = _engine(2, 0, **model_kwargs)
    try:
        checkpoint.load(path, engine, scheduler=scheduler, micro_batch_size=1)
    except ZerorunError as e:
        return str(e)
    return "no error"


def file_sizes(path: str) -> dict:
    return {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)}


def save_every_step(root: str, stage: int, steps: int, keep: int) -> list[str]:
    """Save after each of ``steps`` steps with ``keep``; return the folders left in ``root``."""
    engine, scheduler = _engine(stage, 0)
    for step in range(1, steps + 1):
        _train(engine, scheduler, range(step, step + 1))
        checkpoint.save(engine, root, step, scheduler=scheduler, position=checkpoint.DataPosition(),
                        recipe=_recipe(), keep=keep)
    return sorted(os.listdir(root))


def save_that_rank_0_cannot_finish(root: str) -> dict:
    """A save that rank 0 cannot finish for a reason no disk's (its ``zerorun.json`` content fails: an
    exception of rank 0 alone after DCP's save returned): what each rank raised and what ``root`` holds."""
    from zerorun.checkpoint import saving

    engine, scheduler = _engine(2, 0)
    _train(engine, scheduler, range(1, 2))

    def broken(*args, **kwargs):
        raise RuntimeError("meta broke\nsecond line")

    real, saving._meta = saving._meta, (broken if dist.get_rank() == 0 else saving._meta)
    try:
        checkpoint.save(engine, root, 1, scheduler=scheduler, position=checkpoint.DataPosition(), recipe=_recipe(),
                        keep=1)
        got = "saved"
    except Exception as e:  # noqa: BLE001 - reported to the test
        got = f"{type(e).__name__}: {e}"
    finally:
        saving._meta = real
    dist.barrier()
    return {"raised": got, "left": sorted(os.listdir(root))}


class _Raising:
    """A scheduler whose ``state_dict`` raises (on one rank: that rank raised before the others' agreement)."""

    def state_dict(self):
        raise RuntimeError("scheduler state unavailable")


class _Unjsonable:
    def state_dict(self) -> dict:
        return {"base_lrs": [0.1], "fn": object()}


def _attempt(out: dict, name: str, fn) -> None:
    try:
        out[name] = ("ok", fn())
    except Exception as e:  # noqa: BLE001 - reported to the test
        out[name] = f"{type(e).__name__}: {e}"


def library_arguments(root: str) -> dict:
    """Saves with the library's optional and bad arguments into ``root``: what each raised and, after the bad
    ones, what ``root`` holds."""
    engine, scheduler = _engine(1, 0)
    _train(engine, scheduler, range(1, 2))
    out: dict = {}
    bad = {"step=-1": dict(step=-1), "step=2.0": dict(step=2.0), "keep=-1": dict(step=1, keep=-1),
           "recipe": dict(step=1, recipe={"train": {"micro_batch_size": 2, "collate": [1, object()]}}),
           "scheduler": dict(step=1, scheduler=_Unjsonable()),
           "position": dict(step=1, position=(3, 5)),
           "rank 1's step": dict(step=1 - 2 * dist.get_rank()),
           "steps differ": dict(step=1 + dist.get_rank()),  # each valid: rank 1's shards went to another folder
           "rank 1's scheduler raises": dict(step=1, scheduler=_Raising() if dist.get_rank() else None)}
    for name, kwargs in bad.items():
        _attempt(out, name, lambda: checkpoint.save(engine, root, **kwargs))
    out["left"] = sorted(os.listdir(root)) if os.path.isdir(root) else []
    _attempt(out, "bare", lambda: checkpoint.save(engine, root, 1)[0])
    _attempt(out, "scheduled", lambda: checkpoint.save(engine, root, 2, scheduler=scheduler)[0])
    bare, scheduled = checkpoint.step_dir(root, 1), checkpoint.step_dir(root, 2)
    for name, path, sched in (("load bare", bare, None), ("load bare with a scheduler", bare, scheduler),
                              ("load scheduled", scheduled, scheduler),
                              ("load scheduled without one", scheduled, None)):
        _attempt(out, name, lambda: (lambda s, p: (s, (p.epoch, p.batch)))(
            *checkpoint.load(path, engine, scheduler=sched)))
    _attempt(out, "load micro_batch_size=0", lambda: checkpoint.load(bare, engine, micro_batch_size=0))
    _attempt(out, "load: rank 0's scheduler", lambda: checkpoint.load(  # rank 1 waited for rank 0 (a hang)
        bare, engine, scheduler=scheduler if dist.get_rank() == 0 else None))
    engine.close()
    return out


def run_docs_snippet(page: str, heading: str, cwd: str) -> dict:
    """Run the first Python block after ``heading`` in the Markdown ``page`` as the script it shows, in ``cwd``
    (its ``dist.init_process_group`` does nothing: the pool's group is up, as torchrun's would be); return
    what it ended with."""
    with open(page, encoding="utf-8") as f:
        text = f.read()
    block = text[text.index(heading):].split("```python\n", 1)[1].split("```", 1)[0]
    old_cwd, init = os.getcwd(), dist.init_process_group
    dist.init_process_group = lambda *args, **kwargs: None
    os.chdir(cwd)
    names: dict = {"__name__": "__main__"}
    try:
        exec(compile(block, page, "exec"), names)  # noqa: S102 - the documentation's own example
    finally:
        os.chdir(old_cwd)
        dist.init_process_group = init
    return {"step": names["step"], "position": names["position"], "path": names["path"],
            "last_epoch": names["scheduler"].last_epoch}


def buffers_after_load(root: str, stage: int, load_stage: int) -> dict:
    """A BatchNorm model trained one step on rank-different data (its running statistics then differ by rank, as
    under DDP), saved, and loaded into a fresh engine at ``load_stage``: whether this rank's loaded buffers are
    rank 0's at the save, bit for bit (what a DDP checkpoint holds)."""
    import torch.nn as nn

    def build(seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6), nn.BatchNorm1d(6))
        return model, initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                                 config=ZeroConfig(stage=stage if seed == 0 else load_stage))

    model, engine = build(0)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x).square().mean())
    engine.step()
    box = [{k: v.clone() for k, v in model.state_dict(keep_vars=True).items() if "running" in k}]
    dist.broadcast_object_list(box, src=0)  # rank 0's buffers
    path, _, _ = checkpoint.save(engine, root, 1)
    engine.close()
    model, engine = build(1)
    checkpoint.load(path, engine)
    got = {k: v for k, v in model.state_dict(keep_vars=True).items() if "running" in k}
    engine.close()
    return {"rank0": all(torch.equal(got[k], v) for k, v in box[0].items()), "keys": sorted(got)}
