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
    """Flat stage 3 and stage 3 with ``hierarchy`` trained side by side on copies of the tiny GPT (SGD: Adam would
    amplify the gradients' other summation order, Note [Summation-order floor] in test_zero_parity.py): the largest
    relative difference of a loss and of the final parameters, each engine's bytes sent and bytes to other nodes
    per step, and the secondary shards' bytes before the last step against the gathered bytes of the units. Every
    unit is gathered in backward too (``zero.keep_root_bytes`` 0: the tiny GPT's root would stay gathered from
    forward to backward, Note [Kept from forward to backward]; tests/test_estimate.py counts that case)."""
    with on_nodes(ranks_per_node):
        model = parity_cases._build("gpt", 0)
        engines = [initialize(copy.deepcopy(model), optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                              config=ZeroConfig(stage=3, bucket_mb=0.002, grad_accum_steps=accum, hierarchy=h,
                                                activation_checkpointing=activation_checkpointing,
                                                keep_root_bytes=0))
                   for h in (None, hierarchy)]
        loss_diff, sent = 0.0, [[], []]
        for step in range(steps):
            before = [e.comm_stats() for e in engines]
            for micro in range(accum):
                batch = parity_cases._batch("gpt", step, micro, dist.get_rank(), dist.get_world_size(), "never")
                losses = []
                for e in engines:
                    loss = parity_cases._loss(e(batch))
                    e.backward(loss)
                    losses.append(loss.detach())
                loss_diff = max(loss_diff, parity_cases.rel(losses[1], losses[0]))
            secondary = engines[1].secondary.nbytes
            for e in engines:
                e.step()
            for i, e in enumerate(engines):
                now = e.comm_stats()
                sent[i].append((now["bytes_sent"] - before[i]["bytes_sent"],
                                now["bytes_inter_node"] - before[i]["bytes_inter_node"]))
        params = [e.full_state_dict(rank0_only=False) for e in engines]
        params_diff = max(parity_cases.rel(params[1][k], params[0][k]) for k in params[0])
        gathered = sum(u.gathered_bytes for u in engines[1].units if not u.persistent)
        return {"loss_diff": loss_diff, "params_diff": params_diff, "flat": sent[0], "hpz": sent[1],
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


def two_level_reduce_scatter(in_place: bool) -> dict:
    """Note [Two-level reduce-scatter] against the flat reduce-scatter, 4 ranks as 2 nodes of 2: integer-valued
    float32 gradients (exact sums in any order) of 3 buckets, the output a separate tensor or this rank's slice
    of the input; and the bytes each form sends between nodes."""
    from zerorun.zero.comm import Comm
    from zerorun.zero.hierarchy import TwoLevelReduceScatter

    with on_nodes(2):
        flat, two = Comm(), Comm()
        two.grad_path = TwoLevelReduceScatter(two, 2)
        n, r, wrong = dist.get_world_size(), dist.get_rank(), 0
        g = torch.Generator().manual_seed(r)
        for k in (1, 7, 1000):
            grads = [torch.randint(-1000, 1000, (n * k,), generator=g).float() for _ in range(2)]
            every = [torch.empty_like(grads[1]) for _ in range(n)]
            dist.all_gather(every, grads[1])  # before an in-place output overwrites this rank's slice
            expected = torch.stack(every).sum(0)[r * k:(r + 1) * k]
            outs = [x[r * k:(r + 1) * k] if in_place else torch.empty(k) for x in grads]
            flat.wait([flat.reduce_scatter(outs[0], grads[0]), two.reduce_scatter(outs[1], grads[1])])
            wrong += int(not torch.equal(outs[1], expected))
        inter = [flat.bytes_sent_inter_node, sum(c.bytes_sent_inter_node for c in [two] + two.grad_path.comms)]
        return {"wrong": wrong, "inter_node": inter}


def traffic(ranks_per_node: int, hierarchy, accum: int, config: int, steps: int = 2,
            quantize_block: int | None = None, stage: int = 3, quantize_grads: str | None = None,
            grad_block: int = 256) -> dict:
    """``estimate_cases.CONFIGS[config]``'s model at ``stage`` with ``hierarchy`` and ``accum`` micro-steps on
    this rank's node: bytes sent and bytes to other nodes in each step (zero/comm.py's count) and the secondary
    shards' bytes just before each ``step()`` (``SecondaryShards.nbytes``; 0 without ``hierarchy``); with
    ``quantize_block``, qwZ's int8 all-gathers; with ``quantize_grads``, qgZ's all-to-alls (``grad_block``)."""
    import estimate_cases

    model, model_kwargs, units, opt, opt_kwargs, bucket_mb, _, persistence, keep = estimate_cases.CONFIGS[config]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with on_nodes(ranks_per_node):
        engine = initialize(estimate_cases.build(model, model_kwargs), optimizer=opt, optimizer_kwargs=dict(opt_kwargs),
                            config=ZeroConfig(stage=stage, bucket_mb=bucket_mb, units=units, grad_accum_steps=accum,
                                              persistence_threshold=persistence, hierarchy=hierarchy,
                                              quantize_weights="int8" if quantize_block else None,
                                              quantize_block=quantize_block or grad_block,
                                              quantize_grads=quantize_grads,
                                              **({} if keep is None else {"keep_root_bytes": keep})))
        out = {"sent": [], "inter_node": [], "secondary": []}
        for step in range(steps):
            before = engine.comm_stats()
            for micro in range(accum):
                batch = parity_cases._batch(model, step, micro, rank, world_size, "never")
                engine.backward(parity_cases._loss(engine(batch)))
            secondary = getattr(engine, "secondary", None)
            out["secondary"].append(secondary.nbytes if secondary is not None else 0)
            engine.step()
            now = engine.comm_stats()
            out["sent"].append(now["bytes_sent"] - before["bytes_sent"])
            out["inter_node"].append(now["bytes_inter_node"] - before["bytes_inter_node"])
        engine.close()
    return out


def checkpoint_case(case: str, ranks_per_node: int, **kwargs) -> dict:
    """tests/checkpoint_cases.py's ``case`` with this rank on its node (the results' tensors as lists: picklable)."""
    import checkpoint_cases

    with on_nodes(ranks_per_node):
        out = getattr(checkpoint_cases, case)(**kwargs)
    key = "saved" if "saved" in out else "loaded"
    return {"path": out.get("path"), "losses": out["losses"],
            "masters": [m.tolist() for m in out[key]["masters"]],
            "optim": [{k: v.tolist() for k, v in s.items()} for s in out[key]["optim"]]}
