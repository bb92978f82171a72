"""Rank-side cases for tests/test_host_syncs.py (run by tests/distributed.py's RankPool): zerorun's reads of
tensor values (host_syncs.HostSyncCounter) in a steady step, per phase."""

from __future__ import annotations

import torch
import torch.distributed as dist

from host_syncs import HostSyncCounter
from program_order_cases import SixBlocks
from zerorun.zero import ZeroConfig, initialize


def steady_reads(combos: list[tuple[int, str]], accum: int = 2, warmup: int = 2) -> dict:
    """For each ``(stage, precision)``: after ``warmup`` steps of :class:`SixBlocks` with ``accum`` micro-steps,
    the reads of one steady step as ``{phase: {site: count}}``, phases ``forward0``, ``backward0``, ...,
    ``step``."""
    rank = dist.get_rank()
    out = {}
    for stage, precision in combos:
        torch.manual_seed(0)
        engine = initialize(SixBlocks(), optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                            config=ZeroConfig(stage=stage, precision=precision, grad_accum_steps=accum,
                                              bucket_mb=0.002, units=("Block",) if stage == 3 else ()))
        g = torch.Generator().manual_seed(rank)
        for _ in range(warmup):
            for _ in range(accum):
                engine.backward(engine(torch.randn(8, 5, generator=g)))
            engine.step()
        phases = {}
        for m in range(accum):
            x = torch.randn(8, 5, generator=g)
            with HostSyncCounter() as fwd:
                loss = engine(x)
            with HostSyncCounter() as bwd:
                engine.backward(loss)
            phases[f"forward{m}"], phases[f"backward{m}"] = dict(fwd.sites), dict(bwd.sites)
        with HostSyncCounter() as step:
            engine.step()
        phases["step"] = dict(step.sites)
        out[f"{stage}/{precision}"] = phases
    return out


def group_timeouts() -> list[float]:
    """``torch_internals.group_timeout`` (seconds) of a gloo group made with a 7 s timeout and of the world."""
    import datetime

    from zerorun.zero.torch_internals import group_timeout

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=7))
    return [group_timeout(group).total_seconds(), group_timeout(None).total_seconds()]
