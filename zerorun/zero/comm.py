"""The runtime's collectives on one process group, with bytes sent and time waited counted per rank.

Bytes follow the ring algorithms (ZeRO paper §7, Patarasuk & Yuan 2009): for a tensor of ``n`` bytes over
``N`` ranks, reduce-scatter and all-gather each send ``(N - 1) / N * n`` bytes per rank, all-reduce twice that.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist


# torch >= 2.13 names them *_single and deprecates the *_tensor spellings.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    """A finished work handle, for world size 1 where no collective is issued."""

    def wait(self) -> bool:
        return True


class Comm:
    """Asynchronous collectives on ``group`` that count ``bytes_sent`` (bytes) and ``wait_s`` (seconds).

    Every method returns a work handle; pass handles to :meth:`wait` so the wait is timed.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes_sent = 0
        self.wait_s = 0.0

    def _count(self, nbytes: float) -> None:
        self.bytes_sent += int(round(nbytes))

    def all_reduce(self, tensor: torch.Tensor):
        """Sum ``tensor`` (any shape) over all ranks, in place."""
        if self.world_size == 1:
            return _Done()
        self._count(2 * (self.world_size - 1) / self.world_size * tensor.nbytes)
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor):
        """Sum ``input`` (1-D, ``N * k`` elements) over ranks; rank r receives elements ``[r*k, (r+1)*k)`` in
        ``output`` (1-D, ``k`` elements). ``output`` may be that slice of ``input`` (in place)."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _Done()
        self._count((self.world_size - 1) * output.nbytes)
        return _reduce_scatter(output, input, group=self.group, async_op=True)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor):
        """Concatenate every rank's ``input`` (1-D, ``k`` elements) into ``output`` (1-D, ``N * k``) in rank
        order. ``input`` may be rank r's slice of ``output`` (in place)."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _Done()
        self._count((self.world_size - 1) * input.nbytes)
        return _all_gather(output, input, group=self.group, async_op=True)

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Copy rank ``src``'s ``tensor`` to every rank, in place (not counted as step traffic)."""
        if self.world_size == 1:
            return _Done()
        return dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src,
                              group=self.group, async_op=True)

    def wait(self, works: Sequence) -> None:
        """Wait for every handle in ``works``; the time spent is added to ``wait_s``."""
        t0 = time.perf_counter()
        for work in works:
            work.wait()
        self.wait_s += time.perf_counter() - t0
