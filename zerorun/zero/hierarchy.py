"""ZeRO++'s hierarchical partitioning (hpZ): a secondary shard of each unit's parameters inside a node.

Note [Secondary shards]: at stage 3 every unit is all-gathered twice per micro-step, in forward and again in
backward, over all ``N`` ranks: with ``M`` nodes of ``L`` ranks, most of it crosses the network (ZeRO++, Wang et
al., arXiv:2306.10209, §3.2). With ``zero.hierarchy`` set, when a unit is freed after a forward with gradients
enabled, each rank keeps a copy of the ``1/L`` of its flat buffers that is its part within its secondary group
(the ``L`` ranks of its node, or ``hierarchy`` consecutive ranks): element range ``[l * n / L, (l + 1) * n / L)``
of a buffer of ``n`` elements for the rank ``l``-th in the group. Until the parameters change, every later
all-gather of the unit (its backward, an activation checkpoint's recompute, the forwards of later micro-steps)
gathers these copies over the secondary group only: nothing crosses a node. The gathered values are the same
bits as the flat all-gather's, so training is unchanged (lossless). The primary shard (``1/N``, what the
optimizer steps) is untouched; the copies are dropped whenever the parameters change (after every optimizer
step, a checkpoint's load, ``gathered_parameters(modifier_rank=...)``) and rebuilt by the next forward.
Memory: ``1/L`` of the gathered parameters of every unit that ran forward, held from its forward to the step,
where the primary shard holds ``1/N`` (counted by ``zerorun estimate``). Not for units whose all-gather is padded
to their peers' (experts of different sizes, Note [Peer units] in unit_plan.py): those always gather flat.

Note [Two-level reduce-scatter]: with ``zero.hierarchy`` the gradients' reduce-scatter runs in two levels, the
form HSDP and ZeRO++'s hierarchical gradient reduction use (ZeRO++ §3.3): first within the secondary group (the
``G`` ranks of a node), then across the ``M = N / G`` groups among the ranks of the same place in each (rank
``l`` of every node). A bucket of ``n`` bytes then sends ``(M - 1) / M * n / G`` bytes per rank between nodes,
where the flat reduce-scatter sends ``(N - G) / N * n``: ``G`` times fewer. The ``N`` chunks of the bucket are
first reordered as ``[G, M]`` (chunk ``m * G + l`` to place ``l * M + m``, one copy of the bucket) so that the
inner level leaves each rank the ``M`` chunks of its place ``l`` and the outer level gives node ``m`` its chunk
``m * G + l``: this rank's own shard, as the flat reduce-scatter gives it. The outer level needs the inner's
sums: it is issued when the handle is waited for (a point in program order on every rank; on a GPU the wait
is a stream wait, no host sync), so it overlaps no computation. The sums are those of another order than the
flat collective's (within a node first): equal to fp32 rounding (tests/test_hierarchy.py, against DDP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zerorun.zero.comm import Comm
from zerorun.zero.placement import gradient_group
from zerorun.zero.quantize import BITS
from zerorun.zero.quantized_grads import QuantizedReduceScatter
from zerorun.zero.topology import subgroup

if TYPE_CHECKING:
    from zerorun.zero.units import Unit


class SecondaryShards:
    """The secondary shards of a stage-3 engine's units (Note [Secondary shards]), and the Comm of the secondary
    group they are all-gathered over.

    Attributes:
        comm: collectives over this rank's secondary group, the gradients' inner level's (its bytes count in the
            engine's ``comm_bytes``).
        size: ``L``, the ranks of the group; ``index``: this rank's place in it.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.size, self.index = self.comm.world_size, self.comm.rank
        self._slices: dict = {}  # FlatBuffer -> this rank's 1/L of its gathered data

    def holds(self, unit: "Unit") -> bool:
        """Whether every flat buffer of ``unit`` has its secondary slice here."""
        return bool(unit.buffers) and all(buf in self._slices for buf in unit.buffers)

    def keep(self, unit: "Unit") -> None:
        """Copy this rank's secondary slices out of ``unit``'s gathered buffers (before they are freed)."""
        for buf in unit.buffers:
            if buf not in self._slices:
                k = buf.numel // self.size
                self._slices[buf] = buf.data[self.index * k:(self.index + 1) * k].clone()

    def all_gather(self, unit: "Unit"):
        """All-gather ``unit``'s buffers from the secondary slices over the secondary group; the handle."""
        return self.comm.all_gather_coalesced([buf.data for buf in unit.buffers],
                                              [self._slices[buf] for buf in unit.buffers])

    def drop(self) -> None:
        """Forget every secondary slice (the parameters changed); their memory goes."""
        self._slices.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of the secondary slices held now."""
        return sum(t.nbytes for t in self._slices.values())


def gradient_path(comm: Comm, hierarchy: int | str | None, quantize_grads: str | None, block: int):
    """The gradients' reduce-scatter of ``comm`` where it is not its flat exact one: in two levels over groups of
    ``zero.hierarchy``'s ranks (Note [Two-level reduce-scatter]) or, with ``zero.quantize_grads``, of each node's
    ranks where the nodes allow (:func:`~zerorun.zero.placement.gradient_group`); each level, or the flat one,
    quantized with ``zero.quantize_grads`` (``int8``/``int4``, ``block`` elements per scale: Note [Quantized
    gradients] in quantized_grads.py); None: flat and exact.

    Raises:
        ValueError: ``zero.hierarchy`` the ranks' nodes cannot take (one line, the same on every rank).
    """
    bits = BITS[quantize_grads] if quantize_grads else None
    size = gradient_group(hierarchy, bool(bits), comm.topology)
    if size:
        return TwoLevelReduceScatter(comm, size, bits, block)
    return QuantizedReduceScatter(comm, bits, block) if bits else None


class TwoLevelReduceScatter:
    """The gradients' reduce-scatter of a Comm over ``N`` ranks in two levels (Note [Two-level reduce-scatter]):
    over this rank's ``G = size`` consecutive ranks (``inner_comm``, also the secondary shards' group), then over
    the ranks of the same place in every group (``outer_comm``); each level quantized where ``bits`` is given
    (Note [Quantized gradients]). Both Comms count their own bytes (:attr:`comms`)."""

    def __init__(self, comm: Comm, size: int, bits: int | None = None, block: int = 256) -> None:
        first = comm.rank // size * size
        self.groups = comm.world_size // size
        self.inner_comm = Comm(subgroup(comm.group, list(range(first, first + size))))
        place = self.inner_comm.rank
        self.outer_comm = Comm(subgroup(comm.group, [place + j * size for j in range(self.groups)]))
        self.comms = [self.inner_comm, self.outer_comm]
        self.inner, self.outer = (c if bits is None else QuantizedReduceScatter(c, bits, block) for c in self.comms)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor):
        """As :meth:`Comm.reduce_scatter`: ``input`` 1-D of ``N * k`` elements summed over the ranks, elements
        ``[r*k, (r+1)*k)`` into ``output`` (``k`` elements, may be that slice of ``input``) on rank ``r``."""
        k, size = output.numel(), self.inner_comm.world_size
        reordered = input.view(self.groups, size, k).transpose(0, 1).reshape(-1)  # a copy, [G, M, k]
        middle = torch.empty(self.groups * k, dtype=input.dtype, device=input.device)
        first = self.inner.reduce_scatter(middle, reordered)
        return _Chained(first, lambda: self.outer.reduce_scatter(output, middle))

    def release_buffers(self) -> None:
        for comm in self.comms:
            comm.release_buffers()


class _Chained:
    """A two-level collective's handle: ``wait`` waits for ``first``, then issues the second level
    (``then()``) and waits for it (Note [Two-level reduce-scatter])."""

    def __init__(self, first, then) -> None:
        self.first, self.then = first, then

    def wait(self) -> bool:
        if self.then is not None:
            self.first.wait()
            second, self.then, self.first = self.then(), None, None
            second.wait()
        return True
