"""Which node each rank of a process group runs on, and the group of this rank's node (ZeRO++'s hierarchy).

Note [Nodes of a group]: a node is what the launch plan started as one: one torchrun agent, whose workers share
its node rank (``GROUP_RANK``, set by torchrun for every worker: zerorun's launcher starts one agent per host of
the hostfile, per SLURM node, or one on localhost). A process started otherwise (a user's own launcher, the
test suite's rank pool) has no ``GROUP_RANK`` and is placed by its host name. Several "hosts" on one machine
(loopback SSH hosts 127.0.0.1, 127.0.0.2, ...) are several nodes, as the launch plan made them, and the figures
that follow count their traffic as it would cross a network. The ranks exchange their node keys once per group
(an all-gather of small objects on the control group, at the engine's setup): every rank derives the same
table. Bytes "between nodes" (``comm_bytes_inter_node``) are counted as if each rank sent each of its pieces
straight to the ranks that need it (an all-gather of ``s`` bytes per rank: ``s`` to each of the ``R`` ranks on
other nodes, ``R * s``), which is ZeRO++'s accounting of cross-node volume (Wang et al., arXiv:2306.10209, §3):
independent of the ring or tree a library runs, and equal to the total sent for every rank when each node holds
one rank.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from zerorun.zero.placement import Topology

#: groups of some ranks of a group, by (group, global ranks) (made once: engines in a sweep share them)
_SUBGROUPS: dict = {}


def node_key() -> str:
    """This process's node: torchrun's node rank (``GROUP_RANK``) where set, else the host name."""
    group_rank = os.environ.get("GROUP_RANK")
    return f"node {group_rank}" if group_rank is not None else f"host {socket.gethostname()}"


def topology(group: dist.ProcessGroup | None, control: dist.ProcessGroup | None) -> Topology:
    """The :class:`Topology` of ``group``'s ranks, their node keys exchanged over ``control`` (Note [Agreements on
    the host] in comm.py): one all-gather of small objects, at each engine's setup. Collective over the group's
    ranks (every one exchanges: a key kept from an earlier exchange could differ from the one a peer now has)."""
    keys: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, node_key(), group=control)
    order = list(dict.fromkeys(keys))
    return Topology(tuple(order.index(k) for k in keys), dist.get_rank(group))


def subgroup(group: dist.ProcessGroup | None, ranks: list[int]) -> dist.ProcessGroup:
    """The process group of ``ranks`` (ranks of ``group``, this one among them), with ``group``'s backend, made by
    those ranks only (``use_local_synchronization``) and once for the life of the process (engines in a sweep
    share it)."""
    members = tuple(dist.get_global_rank(group, r) if group is not None else r for r in ranks)
    key = (group if group is not None else dist.group.WORLD, members)
    if key not in _SUBGROUPS:
        _SUBGROUPS[key] = dist.new_group(list(members), backend=dist.get_backend(group),
                                         use_local_synchronization=True)
    return _SUBGROUPS[key]
