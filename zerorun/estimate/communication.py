"""Communication bytes per rank per step (ZeRO paper §7), and of them to other nodes (ZeRO++ §3)."""

from __future__ import annotations

from dataclasses import dataclass

from zerorun.estimate.hierarchy import gathered_units, kept_units, placements, quantized_bytes
from zerorun.estimate.layout import PERSISTENT, Layout
from zerorun.estimate.states import _pad, _stage_buffers, _stage_sizes, _unit_sizes
from zerorun.estimate.policies import Precision


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends per optimizer step: ``sent`` in all, ``inter_node`` of them to ranks on other nodes
    (``comm_bytes`` and ``comm_bytes_inter_node`` of a step event)."""

    sent: int
    inter_node: int


def comm_bytes(layout: Layout, stage: int, world_size: int, precision: Precision, grad_accum_steps: int = 1) -> int:
    """Bytes one rank sends per optimizer step without ``zero.hierarchy``: :func:`traffic`'s ``sent``."""
    return traffic(layout, stage, world_size, precision, grad_accum_steps).sent


def traffic(layout: Layout, stage: int, world_size: int, precision: Precision, grad_accum_steps: int = 1, *,
            node_ranks: tuple[int, ...] = (), group: int | None = None,
            quantize_block: int | None = None, grad_group: int | None = None,
            grad_quantize: tuple[int, int] | None = None) -> Traffic:
    """Bytes one rank sends per optimizer step, as ``zero/comm.py`` counts them (ring: (N-1)/N of a buffer per
    reduce-scatter or all-gather, twice that per all-reduce; ZeRO paper §7): stage 0 all-reduces gradients once
    per step (2Ψ); stages 1-2 reduce-scatter gradients (stage 1 once per step, stage 2 every micro-step) and
    all-gather parameters (2Ψ); stage 3 all-gathers each unit in forward and in backward and reduce-scatters its
    gradients, every micro-step (3Ψ), except persistent parameters, all-gathered once per step after it
    (Note [Persistent parameters]). Stages 1-3 add an all-reduce of the squared gradient norm (8 bytes, fp64:
    Note [Gradient norm] in ``zero/gradnorm.py``); the ranks' agreements (stage 3's digest of the units
    gathered among them) are control traffic on the host, not counted (Note [Agreements on the host] in
    ``zero/comm.py``).
    Parameters travel in ``precision.param_bytes``, gradients in ``precision.reduce_bytes``, or both in a
    buffer's own bytes per element where the layout gives them (float64: 8, Note [Wide parameters]). A listed
    stage-3 unit holding only frozen parameters is counted as gathered in forward only: it is gathered again
    in backward only if a gradient flows through it, which the layout cannot tell (frozen layers usually come
    first, as when fine-tuning the top of a model, and then none does); the root and the outer units (a frozen
    token embedding) are gathered in backward too, at points every rank reaches (Note [Outer units]). Peer units
    of different layouts (experts of different sizes) send the largest peer's slice bytes in each all-gather
    (Note [Peer units] in ``zero/unit_plan.py``): their padding is counted too.

    ``group``: stage 3 with ``zero.hierarchy``, the ranks of a secondary group (:func:`hierarchy.group_size`;
    Note [Secondary shards]): :func:`_stage3`. ``node_ranks``: the ranks of each node, consecutive (empty: one
    node); ``inter_node`` counts each collective's bytes as ``zero/comm.py`` does, ``R / (N - 1)`` of them to the
    ``R`` ranks of its group on other nodes (Note [Nodes of a group] in ``zero/topology.py``), for the rank that
    sends the most there (ranks differ where nodes hold different numbers of ranks).

    ``grad_group``: the ranks of the inner level of the gradients' reduce-scatter (Note [Two-level
    reduce-scatter]; ``zero.hierarchy``'s group or, with quantized gradients, a node's: ``placement.gradient_group``;
    at stage 3 with ``group`` it is ``group``); ``grad_quantize``: ``(bits, block)`` of ``zero.quantize_grads``
    (Note [Quantized gradients]): every reduce-scatter sends each other rank of its level its chunk's message
    (:func:`_reduce_scatter`).
    """
    N = world_size
    if N == 1:
        return Traffic(0, 0)
    f = (N - 1) / N
    pb, gb = precision.param_bytes, precision.reduce_bytes  # gradients travel in the reduce dtype
    bufs = _stage_buffers(layout, stage)[0]
    sizes = _stage_sizes(layout, stage, pb)[0]  # a float64 buffer travels in float64 (Note [Wide parameters])
    trainable = sum(_pad(n, N) * b for n, b in zip(bufs, sizes))  # bytes of parameters
    grads = sum(_pad(n, N) * max(gb, b) for n, b in zip(bufs, sizes))
    norm = 2 * f * 8
    grad_group = group if stage == 3 and group else grad_group
    secondary = 0.0
    if stage == 0:
        flat = 2 * f * grads
    elif stage in (1, 2):
        flat = f * trainable + norm
    else:
        flat, secondary = _stage3(layout, N, pb, grad_accum_steps, group, trainable, quantize_block)
        flat += norm
    times = 0 if stage == 0 else 1 if stage == 1 else grad_accum_steps  # reduce-scatters per step
    levels = _reduce_scatter(bufs, [max(gb, b) for b in sizes], N, grad_group, grad_quantize)
    flat, inner, outer = flat + times * levels[0], secondary + times * levels[1], times * levels[2]
    outer_size = N // grad_group if grad_group else 0
    inter = max(flat * remote / (N - 1) + (inner * remote_g / (grad_group - 1) if outer_size else 0)
                + (outer * remote_o / (outer_size - 1) if outer_size > 1 else 0)
                for remote, remote_g, remote_o in placements(node_ranks or (N,), grad_group))
    return Traffic(int(round(flat + inner + outer)), int(round(inter)))


def _reduce_scatter(bufs: list[int], sizes: list[int], N: int, group: int | None,
                    quantize: tuple[int, int] | None) -> tuple[float, float, float]:
    """Bytes one rank sends in one reduce-scatter of every gradient bucket (``bufs`` elements of ``sizes`` bytes
    each), over all ``N`` ranks, over its inner group of ``group`` ranks and over its outer group of ``N /
    group`` (Note [Two-level reduce-scatter]: a bucket of ``n`` bytes costs ``(G - 1) / G * n`` within, ``(M - 1)
    / M * n / G`` across). ``quantize``: ``(bits, block)``, each level an all-to-all of one message per other
    rank of the level, for a chunk of ``k = n / N`` elements (``M * k`` within, ``k`` across), but float64
    buckets (8 bytes), which stay exact: Note [Quantized gradients] in zero/quantized_grads.py."""
    m, flat, inner, outer = N // group if group else 1, 0.0, 0.0, 0.0
    for n, b in zip((_pad(n, N) for n in bufs), sizes):
        if not quantize or b > 4:  # exact; float64 buckets stay exact under quantize_grads (wide: 8 bytes)
            if group:
                inner, outer = inner + (group - 1) / group * n * b, outer + (m - 1) / m * n * b / group
            else:
                flat += (N - 1) / N * n * b
        elif group:
            inner += (group - 1) * quantized_bytes(m * (n // N), quantize[1], quantize[0])
            outer += (m - 1) * quantized_bytes(n // N, quantize[1], quantize[0])
        else:
            flat += (N - 1) * quantized_bytes(n // N, quantize[1], quantize[0])
    return flat, inner, outer


def _stage3(layout: Layout, N: int, pb: int, accum: int, group: int | None, trainable: int,
            block: int | None = None) -> tuple[float, float]:
    """Stage 3's all-gather bytes per step over all ``N`` ranks and over the secondary group of ``group`` ranks
    (Note [Secondary shards]): each unit's first all-gather of a step (micro-step 1's forward) is flat, every
    later one (its backward, the later micro-steps) gathers the secondary slices, ``(group - 1) / group`` of the
    unit; never the persistent unit nor units padded to their peers' (the gradients: :func:`_reduce_scatter`). With
    ``block`` (``zero.quantize_weights``, Note [Quantized weights] in zero/quantize.py) the all-gathers from the
    primary shards send int8 blocks and a scale each (a frozen buffer taken as floating); the secondary ones
    send the dequantized values, exact bytes."""
    f = (N - 1) / N
    if layout.exact:
        twice, once = gathered_units(layout, N, pb, padded=True)
        twice_s, once_s = gathered_units(layout, N, pb, padded=False)
        twice_q, once_q = gathered_units(layout, N, pb, padded=False, block=block) if block else (twice_s, once_s)
        persistent = sum(_pad(n, N) * b for u in layout.units if u.name == PERSISTENT
                         for n, b in zip(u.trainable, _unit_sizes(u, pb)))
        padding, padding_once = _peer_padding(layout, N, pb)
    else:  # --params: one buffer, gathered twice
        twice, once, twice_s, once_s, persistent, padding, padding_once = trainable, 0, 0, 0, 0, 0, 0
        twice_q = once_q = 0
    flat = accum * f * (2 * twice + once) + f * persistent  # persistent: once per step, after it
    flat += accum * (N - 1) * (2 * padding + padding_once)  # Note [Peer units]
    if not group:
        return flat + accum * f * (2 * twice_q + once_q), 0.0
    later = twice_s + (accum - 1) * (2 * twice_s + once_s)  # micro-step 1's backward, then every gather
    return flat + f * (twice_q + once_q), (group - 1) / group * later


def _peer_padding(layout: Layout, world_size: int, default: int) -> tuple[int, int]:
    """Note [Peer units] (zero/unit_plan.py): the bytes of padding one rank sends in one all-gather of each peer
    unit (the largest peer's slice bytes less its own), summed over the units gathered in forward and backward
    (holding trainable parameters) and over those gathered in forward only (frozen ones, and the unit kept from
    forward to backward: ``hierarchy.kept_units``)."""
    groups: dict[str, list] = {}
    for u in layout.units:
        if u.peers:
            groups.setdefault(u.peers, []).append(u)
    kept = kept_units(layout, world_size, default)
    twice = once = 0
    for group in (g for g in groups.values() if len(g) > 1):
        slices = [sum(_pad(n, world_size) // world_size * b for n, b in zip(u.trainable + u.frozen,
                                                                            _unit_sizes(u, default)))
                  for u in group]
        for u, own in zip(group, slices):
            if u.trainable and u.name not in kept:
                twice += max(slices) - own
            else:
                once += max(slices) - own
    return twice, once

