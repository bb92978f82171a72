"""The nodes of an estimate's ranks and ZeRO++'s secondary shards (``zero.hierarchy``): which ranks a rank's
bytes reach on other nodes (Note [Nodes of a group] in zerorun/zero/topology.py) and what the secondary shards
hold (Note [Secondary shards] in zerorun/zero/hierarchy.py)."""

from __future__ import annotations

import functools

from zerorun.errors import ZerorunError
from zerorun.estimate.layout import PERSISTENT, Layout
from zerorun.estimate.states import _pad, _unit_sizes


def group_size(hierarchy: int | str | None, node_ranks: tuple[int, ...]) -> int | None:
    """The ranks of one secondary group for ``zero.hierarchy`` on nodes of ``node_ranks`` ranks each (consecutive
    ranks, in order, as a launch plan numbers them): the runtime's own choice (``hierarchy_size``), or None
    when unset.

    Raises:
        ZerorunError: a setting the runtime refuses on these nodes (its one line, naming ``zero.hierarchy``).
    """
    return gradient_group(hierarchy, False, node_ranks)  # without quantized gradients: zero.hierarchy's group


def gradient_group(hierarchy: int | str | None, quantized: bool, node_ranks: tuple[int, ...]) -> int | None:
    """The ranks of the inner level of the gradients' reduce-scatter on nodes of ``node_ranks`` ranks each: the
    runtime's own choice (``placement.gradient_group``: zero.hierarchy's group, or a node's with quantized
    gradients), or None (one level).

    Raises:
        ZerorunError: as :func:`group_size`.
    """
    from zerorun.zero import placement

    class Nodes(placement.Topology):  # the runtime's, its ranks per node counted in O(ranks), not O(nodes x ranks)
        @property
        def ranks_per_node(self) -> int | None:
            counts = {k for k in node_ranks if k}
            return counts.pop() if len(counts) == 1 else None

    topo = Nodes(tuple(i for i, k in enumerate(node_ranks) for _ in range(k)), 0)
    try:
        return placement.gradient_group(hierarchy, quantized, topo)
    except ValueError as e:
        raise ZerorunError(str(e)) from None


def placements(node_ranks: tuple[int, ...], group: int | None) -> set[tuple[int, int, int]]:
    """``(R, R_g, R_o)`` of every rank (a set: ranks alike count once): ``R`` the ranks on other nodes than it,
    ``R_g`` those of its secondary group of ``group`` consecutive ranks, ``R_o`` those of its outer group (the
    rank of its place in every secondary group: Note [Two-level reduce-scatter]) (0 and 0 without a group).
    ``node_ranks``: the ranks of each node, consecutive in order; empty: one node."""
    world = sum(node_ranks)
    if not group:  # O(nodes): the estimate's search for the fewest nodes tries millions of ranks
        return {(world - k, 0, 0) for k in node_ranks} or {(0, 0, 0)}
    return _grouped(tuple(node_ranks), group)


@functools.lru_cache(maxsize=8)
def _grouped(node_ranks: tuple[int, ...], group: int) -> frozenset[tuple[int, int, int]]:
    """:func:`placements` with a group, counted from each node's span of ranks: O(ranks), not O(ranks^2 / group)."""
    world, out, start = sum(node_ranks), set(), 0
    for k in node_ranks:
        end = start + k
        for rank in range(start, end):
            first, place = rank // group * group, rank % group
            inner = group - (min(end, first + group) - max(start, first))  # of its group's ranks, those elsewhere
            here = (end - place + group - 1) // group - (start - place + group - 1) // group  # r = place mod group
            outer = (world - place + group - 1) // group - here
            out.add((world - k, inner, outer))
        start = end
    return frozenset(out)


def padded_units(layout: Layout, world_size: int, default: int) -> set[str]:
    """The units whose all-gather is padded to their peers' (``Unit.gather_bytes > 0``: Note [Peer units] in
    zero/unit_plan.py): those of one ModuleList or ModuleDict whose padded flat buffers differ."""
    groups: dict[str, list] = {}
    for u in layout.units:
        if u.peers:
            groups.setdefault(u.peers, []).append(u)
    out = set()
    for group in groups.values():
        shapes = {tuple((_pad(n, world_size), b) for n, b in zip(u.trainable + u.frozen, _unit_sizes(u, default)))
                  for u in group}
        if len(group) > 1 and len(shapes) > 1:
            out.update(u.name for u in group)
    return out


def gathered_units(layout: Layout, world_size: int, default: int, padded: bool,
                   block: int | None = None) -> tuple[int, int]:
    """Bytes of one all-gather of every unit but the persistent one, padded to ``world_size`` (the unit's own
    bytes, without its peers' padding), summed over the units gathered in forward and backward (those holding
    trainable parameters; the root and the outer units, which backward gathers at the points every rank reaches
    whatever they hold) and over the listed units holding frozen ones only and the :func:`kept_units` (forward
    only): of the padded units (``padded``), or of the others. With ``block``: as int8 messages of ``block``
    elements per scale (``zero.quantize_weights``), ``world_size`` times one rank's message."""
    skip = padded_units(layout, world_size, default)
    kept = kept_units(layout, world_size, default)
    twice = once = 0
    for u in layout.units:
        if u.name == PERSISTENT or (u.name in skip) != padded:
            continue
        nbytes = _padded_bytes(u, world_size, default) if block is None else sum(
            world_size * quantized_bytes(_pad(n, world_size) // world_size, block)
            for n, _ in zip(u.trainable + u.frozen, _unit_sizes(u, default)))
        if (u.trainable or u.outer or u.name == "<root>") and u.name not in kept:
            twice += nbytes
        else:
            once += nbytes
    return twice, once


def kept_units(layout: Layout, world_size: int, default: int) -> set[str]:
    """The units a forward with gradients on leaves gathered into its backward (Note [Kept from forward to
    backward] in zero/stage3_outer.py): the root and every outer unit, when their padded bytes together are at
    most ``layout.keep_root_bytes``, and the last listed unit too when it fits with them (the runtime keeps the
    last of the recorded forward order: the model's last listed module where it runs them in their order);
    else none."""
    units = [u for u in layout.units if u.name == "<root>" or u.outer]
    nbytes, cap = sum(_padded_bytes(u, world_size, default) for u in units), layout.keep_root_bytes
    if not (0 < cap and nbytes <= cap):
        return set()
    listed = [u for u in layout.listed_units if _padded_bytes(u, world_size, default)]
    last = [u.name for u in listed[-1:] if nbytes + _padded_bytes(u, world_size, default) <= cap]
    return {u.name for u in units} | set(last)


def _padded_bytes(u, world_size: int, default: int) -> int:
    """Bytes of one all-gather of layout unit ``u``: its flat buffers padded to ``world_size``, whole."""
    return sum(_pad(n, world_size) * b for n, b in zip(u.trainable + u.frozen, _unit_sizes(u, default)))


def secondary_bytes(layout: Layout, world_size: int, default: int, group: int | None) -> int:
    """The bytes of the secondary slices (Note [Secondary shards]) one rank holds from a forward to the optimizer
    step (``SecondaryShards.nbytes`` just before ``step()``): ``1/group`` of every flat buffer of every unit that
    ran forward, but the persistent unit and the units padded to their peers'; 0 without a group or layout."""
    if not group or not layout.exact:
        return 0
    skip = padded_units(layout, world_size, default) | {PERSISTENT}
    return sum(_pad(n, world_size) // group * b for u in layout.units if u.name not in skip
               for n, b in zip(u.trainable + u.frozen, _unit_sizes(u, default)))


def quantized_bytes(numel: int, block: int, bits: int = 8) -> int:
    """Bytes of one rank's message of ``bits``-wide values for a slice of ``numel`` floating elements
    (zero/quantize.py)."""
    import torch

    from zerorun.zero.quantize import message_bytes

    return message_bytes([(numel, torch.float32)], block, bits) if numel else 0
