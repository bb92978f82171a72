"""Broadcasts of many small tensors as a few flat ones: the engine's setup and its per-forward buffer sync.

Note [Coalesced broadcasts]: DDP makes every rank start from rank 0's parameters and buffers, and (with
``broadcast_buffers=True``, its default) re-broadcasts the module buffers (BatchNorm's running statistics)
from rank 0 before every training forward. One collective per tensor costs a launch and a latency each: a
BatchNorm layer has three buffers, a ResNet-50 161, and on NCCL each broadcast is a kernel on the
communication stream. So, as DDP's ``_sync_module_states`` and ``_sync_buffers`` do through
``dist._broadcast_coalesced``, the tensors are grouped by dtype and device into buckets of at most
``bucket_bytes`` (``torch._utils._take_tensors``: a tensor larger than that is a bucket of its own), each
bucket is flattened into one tensor, broadcast once, and copied back into its tensors on the receiving ranks.
The collective goes through the engine's ``Comm`` (the same group and device as every other collective,
its wait timed, nothing issued at world size 1) rather than torch's C++ helper, whose broadcasts no Python
code sees. Every rank issues the same buckets in the same order: the grouping depends only on the tensors'
dtypes, devices and sizes, which are the same on every rank.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _take_tensors, _unflatten_dense_tensors

#: DDP's ``broadcast_bucket_size`` (torch/nn/parallel/distributed.py): 250 MiB per coalesced broadcast.
BUCKET_BYTES = 250 * 2**20


def buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """``tensors`` grouped as they are broadcast (Note [Coalesced broadcasts]): per dtype and device, in
    their order, each group of at most ``bucket_bytes`` bytes (or one tensor larger than that)."""
    return [list(b) for b in _take_tensors(list(tensors), bucket_bytes)]


def broadcast_coalesced(comm, tensors: Sequence[torch.Tensor], src: int = 0,
                        bucket_bytes: int = BUCKET_BYTES) -> int:
    """Copy rank ``src``'s values of ``tensors`` (dense, any shapes and dtypes, on the group's device) to
    every rank of ``comm``'s group in place, one broadcast per bucket (Note [Coalesced broadcasts]). The
    tensors' autograd version counters are kept, as DDP's buffer sync keeps them. Every rank calls it with
    tensors of the same dtypes and shapes.

    Returns:
        The number of broadcasts issued (0 at world size 1 or without tensors).
    """
    if comm.world_size == 1 or not tensors:
        return 0
    groups = buckets(tensors, bucket_bytes)
    works, copies = [], []
    for group in groups:
        if len(group) == 1 and group[0].is_contiguous():  # broadcast in place, no staging copy
            works.append(comm.broadcast(group[0], src))
            continue
        flat = _flatten_dense_tensors(group)
        works.append(comm.broadcast(flat, src))
        copies.append((group, flat))
    comm.wait(works)
    if comm.rank != src:
        for group, flat in copies:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(group)):
                for t, value in zip(group, _unflatten_dense_tensors(flat, group)):
                    t.copy_(value)
    return len(groups)


def ddp_buffer_kwargs(broadcast_buffers: bool) -> dict[str, bool]:
    """The keyword that gives torch's ``DistributedDataParallel`` the engine's ``broadcast_buffers``
    behaviour: ``forward_sync_buffers`` where torch has it (buffers synced at setup either way, as the engine
    does), else the older ``broadcast_buffers``."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    key = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters \
        else "broadcast_buffers"
    return {key: broadcast_buffers}
