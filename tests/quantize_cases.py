"""Rank-side cases for tests/test_quantize.py (ZeRO++'s qwZ, Note [Quantized weights] in zerorun/zero/quantize.py)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import hierarchy_cases
import parity_cases
from zerorun.zero import ZeroConfig, initialize


def _weights_seen(engine) -> list[torch.Tensor]:
    """Clones of every Linear weight as its forward reads it (gathered), recorded by forward pre-hooks."""
    seen = []
    for m in engine.module.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.detach().clone()))
    return seen


def against_exact(block: int, steps: int = 4, lr: float = 1e-3, ranks_per_node: int = 0,
                  hierarchy=None, units: tuple = (), keep: int | None = None, **model_kwargs) -> dict:
    """Stage 3 exact and with ``quantize_weights: int8`` side by side on copies of the tiny GPT (AdamW): per step
    the largest relative loss difference; how far the weights its forward read are from the exact engine's
    in the first forward (largest absolute difference over the largest magnitude / 127: blockwise int8 keeps it
    within 1/2), whether
    every rank read the same weights, whether the final state dicts differ only by training (lr 0: equal bits),
    and the bytes each sent per step. ``keep``: ``zero.keep_root_bytes`` (``None``: its default)."""
    with hierarchy_cases.on_nodes(ranks_per_node or dist.get_world_size()):
        model = parity_cases._build("gpt", 0, **model_kwargs)
        engines = [initialize(copy.deepcopy(model), optimizer="AdamW", optimizer_kwargs={"lr": lr},
                              config=ZeroConfig(stage=3, bucket_mb=0.002, quantize_weights=q, quantize_block=block,
                                                hierarchy=hierarchy if q else None, units=units,
                                                **({} if keep is None else {"keep_root_bytes": keep})))
                   for q in (None, "int8")]
        seen = [_weights_seen(e) for e in engines]
        losses, sent, rounding = [], [], 0.0
        for step in range(steps):
            before = [e.comm_stats()["bytes_sent"] for e in engines]
            batch = parity_cases._batch("gpt", step, 0, dist.get_rank(), dist.get_world_size(), "never")
            pair = []
            for e in engines:
                loss = parity_cases._loss(e(batch))
                e.backward(loss)
                e.step()
                pair.append(float(loss))
            losses.append(abs(pair[1] - pair[0]) / abs(pair[0]))
            sent.append([e.comm_stats()["bytes_sent"] - b for e, b in zip(engines, before)])
        first = len(seen[0]) // steps  # the first forward's: both engines from the same weights
        for exact, rounded in zip(seen[0][:first], seen[1][:first]):
            rounding = max(rounding, float((rounded - exact).abs().max() / (exact.abs().max() / 127)))
        mine = torch.cat([w.reshape(-1) for w in seen[1]])
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        states = [e.full_state_dict(rank0_only=False) for e in engines]
        return {"loss_diff": losses, "rounding": rounding, "same_on_every_rank": all(torch.equal(mine, o) for o in every),
                "changed": any(not torch.equal(a, b) for a, b in zip(*seen)), "sent": sent,
                "states_equal": all(torch.equal(states[0][k], states[1][k]) for k in states[0]),
                "gathers": len(seen[1]), "root_params": sum(b.numel for u in engines[1].units if u.is_root
                                                            for b in u.buffers)}


def gather_bytes(block: int) -> dict:
    """Per step, what stage 3 with ``quantize_weights`` sends against the exact engine: both gather every unit in
    forward and backward (``zero.keep_root_bytes`` 0: none kept from forward to backward, Note [Kept from forward
    to backward]); the difference must be the all-gathers' (N - 1) * (slice bytes - message bytes) per unit and
    gather (the reduce-scatters and the norm are the same)."""
    from zerorun.zero.quantize import message_bytes

    r = against_exact(block=block, steps=2, keep=0)
    engine = initialize(parity_cases._build("gpt", 0), optimizer="SGD", optimizer_kwargs={"lr": 0.0},
                        config=ZeroConfig(stage=3, bucket_mb=0.002))
    n = dist.get_world_size()
    saved = sum(b.shard_numel * b.dtype.itemsize - message_bytes([(b.shard_numel, b.dtype)], block)
                for u in engine.units if not u.persistent for b in u.buffers)
    return {"sent": r["sent"], "expected_saving": 2 * (n - 1) * saved}
