"""What the ranks agree on at the end of a step's last backward, in one host sum (Note [Agreements on the host] in
``comm.py``), and the first step's launch order (Note [Launch order] in ``reducer.py``). Owned by the reducer."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from zerorun.zero.comm import Comm, alike
from zerorun.zero.user_model import zero_grad_on_some_ranks


def agree_at_step_end(comm: Comm, used: Sequence[bool], late: Sequence[bool], dropped: int,
                      rider: Any) -> tuple[list[bool], list[bool]]:
    """One host agreement of: per parameter whether it got a gradient (``used``: Note [Unused parameters] in
    masters.py), per bucket whether one came after its launch (``late``: Note [Per-parameter readiness] in
    reducer.py), whether ``engine.zero_grad`` dropped this step's gradients (``dropped``, 0 or 1: Note [A backward
    that raised] in user_model.py; as ``[d, d*d]``: the same on every rank exactly when ``N * sum(d*d) ==
    sum(d)**2``), and ``rider.values()`` (``None``: none; stage 3: Note [Same units on every rank]), whose sums go
    to ``rider.take``.

    Returns:
        Per parameter, whether it got a gradient on some rank; per bucket, whether one got a late gradient on some
        rank.

    Raises:
        RuntimeError: on every rank, where ``engine.zero_grad`` dropped gradients on some ranks only; the rider's.
    """
    ride = rider.values() if rider is not None else []
    flags = comm.agree([int(u) for u in used] + [int(x) for x in late] + [dropped, dropped * dropped] + ride)
    n, m = len(used), len(used) + len(late)
    if not alike(comm.world_size, flags[m], flags[m + 1]):
        raise zero_grad_on_some_ranks()
    if rider is not None:
        rider.take(flags[m + 2:])
    return [f > 0 for f in flags[:n]], [f > 0 for f in flags[n:m]]


def launch_order(comm: Comm, buffers: list, seq: list) -> list:
    """``seq`` (buckets of ``buffers`` in the order they became ready, unused ones first) as rank 0 has it, on
    every rank, by one broadcast (Note [Launch order] in reducer.py)."""
    index_of = {id(b): i for i, b in enumerate(buffers)}
    index = torch.tensor([index_of[id(b)] for b in seq], dtype=torch.int64, device=comm.device)
    comm.wait([comm.broadcast(index, 0)])
    return [buffers[i] for i in index.tolist()]
