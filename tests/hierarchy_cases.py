"""Rank-side cases for tests/test_hierarchy.py (ZeRO++'s hpZ, Note [Secondary shards] in zerorun/zero/hierarchy.py):
ranks placed on nodes of ``ranks_per_node`` consecutive ranks through torchrun's ``GROUP_RANK``, as a launch plan
of that many ranks per host places them (Note [Nodes of a group] in zerorun/zero/topology.py)."""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist

import parity_cases
from zerorun.zero import ZeroConfig, initialize


@contextlib.contextmanager
def on_nodes(ranks_per_node: int):
    """This rank on node ``rank // ranks_per_node`` (torchrun's ``GROUP_RANK``) inside the block."""
    old = os.environ.get("GROUP_RANK")
    os.environ["GROUP_RANK"] = str(dist.get_rank() // ranks_per_node)
    try:
        yield
    finally:
        if old is None:
            del os.environ["GROUP_RANK"]
        else:
            os.environ["GROUP_RANK"] = old


def parity(ranks_per_node: int, **kwargs) -> dict:
    """tests/parity_cases.py's DDP comparison with this rank on its node."""
    with on_nodes(ranks_per_node):
        return parity_cases.parity(**kwargs)


def against_flat(ranks_per_node: int, hierarchy, accum: int = 1, steps: int = 3,
                 activation_checkpointing: bool = False) -> dict:
    """Flat stage 3 and stage 3 with ``hierarchy`` trained side by side on copies of the tiny GPT: whether every
    loss and final parameter is the same bits, each engine's bytes sent and bytes to other nodes per step, and
    the secondary shards' bytes before the last step against the gathered bytes of the units."""
    with on_nodes(ranks_per_node):
        model = parity_cases._build("gpt", 0)
        engines = [initialize(copy.deepcopy(model), optimizer="AdamW", optimizer_kwargs={"lr": 1e-3},
                              config=ZeroConfig(stage=3, bucket_mb=0.002, grad_accum_steps=accum, hierarchy=h,
                                                activation_checkpointing=activation_checkpointing))
                   for h in (None, hierarchy)]
        same_losses, sent = True, [[], []]
        for step in range(steps):
            before = [e.comm_stats() for e in engines]
            for micro in range(accum):
                batch = parity_cases._batch("gpt", step, micro, dist.get_rank(), dist.get_world_size(), "never")
                losses = []
                for e in engines:
                    loss = parity_cases._loss(e(batch))
                    e.backward(loss)
                    losses.append(loss.detach())
                same_losses &= torch.equal(losses[0], losses[1])
            secondary = engines[1].secondary.nbytes
            for e in engines:
                e.step()
            for i, e in enumerate(engines):
                now = e.comm_stats()
                sent[i].append((now["bytes_sent"] - before[i]["bytes_sent"],
                                now["bytes_inter_node"] - before[i]["bytes_inter_node"]))
        params = [e.full_state_dict(rank0_only=False) for e in engines]
        same_params = all(torch.equal(params[0][k], params[1][k]) for k in params[0])
        gathered = sum(u.gathered_bytes for u in engines[1].units if not u.persistent)
        return {"same_losses": same_losses, "same_params": same_params, "flat": sent[0], "hpz": sent[1],
                "secondary_bytes": secondary, "gathered_bytes": gathered, "size": engines[1].secondary.size,
                "after_step": engines[1].secondary.nbytes, "remote": engines[0].comm.topology.remote}


def refused(ranks_per_node: int, **config) -> str:
    """The error an engine with ``config`` raises on this rank's node layout, or '' where none."""
    with on_nodes(ranks_per_node):
        try:
            initialize(parity_cases._build("gpt", 0), optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                       config=ZeroConfig(**config))
        except ValueError as e:
            return str(e)
    return ""


def traffic(ranks_per_node: int, hierarchy, accum: int, config: int, steps: int = 2) -> dict:
    """``estimate_cases.CONFIGS[config]``'s model at stage 3 with ``hierarchy`` and ``accum`` micro-steps on this
    rank's node: bytes sent and bytes to other nodes in each step (zero/comm.py's count) and the secondary
    shards' bytes just before each ``step()`` (``SecondaryShards.nbytes``; 0 without ``hierarchy``)."""
    import estimate_cases

    model, model_kwargs, units, opt, opt_kwargs, bucket_mb, _, persistence = estimate_cases.CONFIGS[config]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with on_nodes(ranks_per_node):
        engine = initialize(estimate_cases.build(model, model_kwargs), optimizer=opt, optimizer_kwargs=dict(opt_kwargs),
                            config=ZeroConfig(stage=3, bucket_mb=bucket_mb, units=units, grad_accum_steps=accum,
                                              persistence_threshold=persistence, hierarchy=hierarchy))
        out = {"sent": [], "inter_node": [], "secondary": []}
        for step in range(steps):
            before = engine.comm_stats()
            for micro in range(accum):
                batch = parity_cases._batch(model, step, micro, rank, world_size, "never")
                engine.backward(parity_cases._loss(engine(batch)))
            out["secondary"].append(engine.secondary.nbytes if engine.secondary is not None else 0)
            engine.step()
            now = engine.comm_stats()
            out["sent"].append(now["bytes_sent"] - before["bytes_sent"])
            out["inter_node"].append(now["bytes_inter_node"] - before["bytes_inter_node"])
        engine.close()
    return out
