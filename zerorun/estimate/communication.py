"""Communication bytes per rank per step (ZeRO paper §7)."""

from __future__ import annotations

from zerorun.estimate.layout import PERSISTENT, Layout
from zerorun.estimate.states import _pad, _stage_buffers, _stage_sizes, _unit_sizes
from zerorun.estimate.policies import Precision


def comm_bytes(layout: Layout, stage: int, world_size: int, precision: Precision, grad_accum_steps: int = 1) -> int:
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
    buffer's own bytes per element where the layout gives them (float64: 8, Note [Wide parameters]). A stage-3 unit
    holding only frozen parameters is counted as gathered in forward only: it is gathered again
    in backward only if a gradient flows through it, which the layout cannot tell (frozen layers usually come
    first, as when fine-tuning the top of a model, and then none does). Peer units of different layouts (experts
    of different sizes) send the largest peer's slice bytes in each all-gather (Note [Peer units] in
    ``zero/unit_plan.py``): their padding is counted too."""
    N = world_size
    if N == 1:
        return 0
    f = (N - 1) / N
    pb, gb = precision.param_bytes, precision.reduce_bytes  # gradients travel in the reduce dtype
    bufs = _stage_buffers(layout, stage)[0]
    sizes = _stage_sizes(layout, stage, pb)[0]  # a float64 buffer travels in float64 (Note [Wide parameters])
    trainable = sum(_pad(n, N) * b for n, b in zip(bufs, sizes))  # bytes of parameters
    grads = sum(_pad(n, N) * max(gb, b) for n, b in zip(bufs, sizes))
    frozen = frozen_only = persistent = padding = padding_once = 0
    if stage == 3 and layout.exact:
        gathered = [u for u in layout.units if u.name != PERSISTENT]
        frozen = sum(_pad(n, N) * b for u in gathered if u.trainable for n, b in zip(u.frozen, _frozen_sizes(u, pb)))
        frozen_only = sum(_pad(n, N) * b for u in gathered if not u.trainable
                          for n, b in zip(u.frozen, _frozen_sizes(u, pb)))
        persistent = sum(_pad(n, N) * b for u in layout.units if u.name == PERSISTENT
                         for n, b in zip(u.trainable, _unit_sizes(u, pb)))
        padding, padding_once = _peer_padding(layout, N, pb)
    norm = 2 * f * 8
    if stage == 0:
        sent = 2 * f * grads
    elif stage == 1:
        sent = f * (grads + trainable) + norm
    elif stage == 2:
        sent = grad_accum_steps * f * grads + f * trainable + norm
    else:
        gathered_twice = trainable - persistent + frozen  # persistent: all-gathered once per step, after it
        sent = grad_accum_steps * f * (2 * gathered_twice + frozen_only + grads) + f * persistent + norm
        sent += grad_accum_steps * (N - 1) * (2 * padding + padding_once)  # Note [Peer units]
    return int(round(sent))


def _peer_padding(layout: Layout, world_size: int, default: int) -> tuple[int, int]:
    """Note [Peer units] (zero/unit_plan.py): the bytes of padding one rank sends in one all-gather of each peer
    unit (the largest peer's slice bytes less its own), summed over the units gathered in forward and backward
    (holding trainable parameters) and over those gathered in forward only (frozen ones)."""
    groups: dict[str, list] = {}
    for u in layout.units:
        if u.peers:
            groups.setdefault(u.peers, []).append(u)
    twice = once = 0
    for group in (g for g in groups.values() if len(g) > 1):
        slices = [sum(_pad(n, world_size) // world_size * b for n, b in zip(u.trainable + u.frozen,
                                                                            _unit_sizes(u, default)))
                  for u in group]
        for u, own in zip(group, slices):
            if u.trainable:
                twice += max(slices) - own
            else:
                once += max(slices) - own
    return twice, once


def _frozen_sizes(u, default: int) -> list[int]:
    return _unit_sizes(u, default)[len(u.trainable):]
