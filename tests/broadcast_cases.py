"""Cases run on every rank of a :class:`distributed.RankPool`: the broadcasts the engine issues (Note
[Coalesced broadcasts] in zerorun/zero/broadcast.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from zerorun.zero import ZeroConfig, initialize


def buffer_broadcasts(stage: int, broadcast_buffers: bool = True) -> dict:
    """Broadcasts issued by the engine's setup and by one training forward of a model with three BatchNorm
    layers (nine buffers: fp32 running stats, int64 counts) and ten parameters (Note [Coalesced broadcasts]
    in zero/broadcast.py), each as ``(dtype, numel, src)``."""
    from zerorun.zero.comm import Comm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.BatchNorm1d(6), nn.Linear(6, 3), nn.BatchNorm1d(3))
    calls: list[tuple] = []
    original = Comm.broadcast

    def recording(self, tensor, src=0):
        calls.append((str(tensor.dtype), tensor.numel(), src))
        return original(self, tensor, src)

    Comm.broadcast = recording
    try:
        engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                            config=ZeroConfig(stage=stage, bucket_mb=0.001, broadcast_buffers=broadcast_buffers))
        setup, calls[:] = list(calls), []
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
        engine.backward(engine(x).sum())  # each rank's own batch: the running stats now differ
        engine.step()
        calls.clear()
        engine(x)
        forward = list(calls)
    finally:
        Comm.broadcast = original
    return {"setup": setup, "forward": forward}
