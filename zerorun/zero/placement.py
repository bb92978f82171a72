"""Where a job's ranks run, without torch: the nodes of a group's ranks (:class:`Topology`) and the size of
ZeRO++'s secondary groups (:func:`hierarchy_size`). The runtime reads the nodes from the ranks themselves
(topology.py, Note [Nodes of a group]); ``zerorun train`` and ``zerorun estimate`` from the hosts of the launch
plan, so that a hierarchy the hosts cannot take is refused before anything starts, in the same line.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Topology:
    """The nodes of a group's ranks (Note [Nodes of a group]).

    Attributes:
        nodes: the node index of each rank of the group, by group rank (0, 1, ... in order of first rank).
        rank: this process's rank in the group.
    """

    nodes: tuple[int, ...]
    rank: int

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    @property
    def local_ranks(self) -> list[int]:
        """The group ranks on this rank's node, in order."""
        return [r for r, n in enumerate(self.nodes) if n == self.nodes[self.rank]]

    @property
    def remote(self) -> int:
        """How many ranks of the group run on other nodes than this rank."""
        return self.world_size - len(self.local_ranks)

    @property
    def ranks_per_node(self) -> int | None:
        """The ranks on each node where every node has the same number, else None."""
        counts = {self.nodes.count(n) for n in set(self.nodes)}
        return counts.pop() if len(counts) == 1 else None

    @property
    def contiguous(self) -> bool:
        """Whether every node's ranks are consecutive (torchrun numbers a node's workers so)."""
        return all(self.nodes[r] <= self.nodes[r + 1] for r in range(self.world_size - 1))


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


def gradient_group(hierarchy: int | str | None, quantized: bool, topo: Topology) -> int | None:
    """The ranks of the inner level of the gradients' two-level reduce-scatter (Note [Two-level reduce-scatter]):
    ``zero.hierarchy``'s group (:func:`hierarchy_size`); else, with quantized gradients (Note [Quantized
    gradients]: within the node first, ZeRO++ §3.3), the ranks of each node where there are several nodes of
    the same number (> 1) of consecutive ranks; else None (one level).

    Raises:
        ValueError: as :func:`hierarchy_size`.
    """
    if hierarchy is not None:
        return hierarchy_size(hierarchy, topo)
    size = topo.ranks_per_node
    if quantized and topo.num_nodes > 1 and topo.contiguous and size is not None and size > 1:
        return size
    return None


def hierarchy_on_nodes(hierarchy: int | str | None, node_ranks: tuple[int, ...]) -> int | None:
    """:func:`hierarchy_size` on nodes of ``node_ranks`` ranks each, their ranks consecutive in order (as a launch
    plan numbers them: the hostfile's slots): what ``zerorun train`` and ``zerorun estimate`` check before any
    rank starts.

    Raises:
        ValueError: as :func:`hierarchy_size`.
    """
    return None if hierarchy is None else hierarchy_size(hierarchy, _on_nodes(node_ranks))


def _on_nodes(node_ranks: tuple[int, ...]) -> Topology:
    return Topology(tuple(i for i, k in enumerate(node_ranks) for _ in range(k)), 0)
