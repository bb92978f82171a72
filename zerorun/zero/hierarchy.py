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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerorun.zero.comm import Comm
from zerorun.zero.topology import Topology, subgroup

if TYPE_CHECKING:
    from zerorun.zero.units import Unit


def hierarchy_size(hierarchy: int | str | None, topo: Topology) -> int | None:
    """The ranks of one secondary group (Note [Secondary shards]) for ``zero.hierarchy`` on ``topo``: None when
    unset; ``"node"``: the ranks of each node; an integer: that many consecutive ranks.

    Raises:
        ValueError: a setting that cannot work on this job (one line, naming ``zero.hierarchy``; the same on
            every rank: the topology is).
    """
    if hierarchy is None:
        return None
    n = topo.world_size
    if hierarchy == "node":
        if topo.num_nodes == 1:
            raise ValueError(f"zero.hierarchy: node: all {n} ranks run on one node, where the flat all-gather "
                             "already stays inside it; remove zero.hierarchy (it would only add a second copy)")
        size = topo.ranks_per_node
        if size is None or not topo.contiguous:
            raise ValueError("zero.hierarchy: node needs the same number of consecutive ranks on every node; "
                             f"this job's ranks run on nodes {list(topo.nodes)}")
    else:
        size = hierarchy
        if size >= n or n % size:
            raise ValueError(f"zero.hierarchy: {size} must divide the world size {n} and be below it "
                             "(ranks per secondary group, DeepSpeed's zero_hpz_partition_size)")
    if size < 2:
        raise ValueError("zero.hierarchy: one rank per node: its secondary shard would be the whole model; "
                         "remove zero.hierarchy")
    return size


class SecondaryShards:
    """The secondary shards of a stage-3 engine's units (Note [Secondary shards]), and the Comm of the secondary
    group they are all-gathered over.

    Attributes:
        comm: collectives over this rank's secondary group (its bytes count in the engine's ``comm_bytes``).
        size: ``L``, the ranks of the group; ``index``: this rank's place in it.
    """

    def __init__(self, comm: Comm, size: int) -> None:
        first = comm.rank // size * size  # the node's ranks where size is the ranks per node (consecutive)
        self.comm = Comm(subgroup(comm.group, list(range(first, first + size))))
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
