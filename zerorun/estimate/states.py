"""Model-state bytes per rank and stage (Note [What is exact] in ``estimate/__init__.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from zerorun.errors import ZerorunError
from zerorun.estimate.layout import PERSISTENT, Layout
from zerorun.estimate.policies import OFFLOADS, OptimizerModel, Precision


# ------------------------------------------------------------------------------------------- per stage
def _pad(n: int, world_size: int) -> int:
    return math.ceil(n / world_size) * world_size


def _stage_buffers(layout: Layout, stage: int) -> tuple[list[int], list[int]]:
    """Unpadded numels of the trainable flat buffers and of the frozen tensors the engine holds at ``stage``
    (stage 3: per unit, frozen ones in one flat buffer per unit and dtype; stages 0-2: frozen parameters whole)."""
    if stage == 3 and layout.exact:
        return [n for u in layout.units for n in u.trainable], [n for u in layout.units for n in u.frozen]
    return list(layout.buffers), list(layout.frozen_params)


def _sizes(numels, sizes: tuple[int, ...], default: int) -> list[int]:
    return list(sizes) if sizes else [default] * len(numels)


def _unit_sizes(u, default: int) -> list[int]:
    """Bytes per element of a stage-3 unit's trainable then frozen flat buffers."""
    return _sizes(u.trainable, u.trainable_bytes, default) + _sizes(u.frozen, u.frozen_bytes, default)


def _stage_sizes(layout: Layout, stage: int, default: int) -> tuple[list[int], list[int]]:
    """Bytes per element of each tensor of :func:`_stage_buffers` (``default``, the precision's, where the
    layout does not say: ``--params``): 8 for a float64 buffer (Note [Wide parameters] in zero/precision.py)."""
    if stage == 3 and layout.exact:
        return ([b for u in layout.units for b in _sizes(u.trainable, u.trainable_bytes, default)],
                [b for u in layout.units for b in _sizes(u.frozen, u.frozen_bytes, default)])
    return _sizes(layout.buffers, layout.buffer_bytes, default), _sizes(layout.frozen_params, layout.frozen_bytes,
                                                                       default)


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes one rank holds at rest: ``params``, ``grads``, ``optimizer`` (in device memory) are
    ``ZeroEngine.memory_bytes()``'s keys; ``host`` and ``disk`` (optimizer bytes offloaded) are
    ``ZeroEngine.offload_bytes()``'s."""

    params: int
    grads: int
    optimizer: int
    host: int = 0
    disk: int = 0
    grad_accum: int = 0  # the fp32 gradient accumulation buffer (Note [Gradient accumulation buffer])

    @property
    def total(self) -> int:
        """Bytes in device memory: parameters + gradients (+ accumulation buffer) + optimizer."""
        return self.params + self.grads + self.grad_accum + self.optimizer


# Note [Gradient accumulation buffer]: gradients are accumulated over micro-steps in ``zero.grad_accum_dtype``
# (``policies.grad_accum_bytes``: unset, fp32 when grad_accum_steps > 1 under bf16/fp16, as DeepSpeed's
# ``data_types.grad_accum_dtype``). Where that is wider than the gradients the stage keeps across micro-steps
# (stages 0-1: the whole gradients in the parameters' dtype; stages 2-3: this rank's gradient slice in the
# reduce dtype, already 4 bytes under ``zero.reduce_dtype: fp32``), the runtime (``zero/reducer.py``) keeps,
# at stages 0-1, a separate fp32 buffer of the whole padded model beside the gradients, Ψ x 4 bytes, counted
# in ``ModelStates.grad_accum`` (``ZeroEngine.memory_bytes()`` counts it in "grads"); at stages 2-3 it keeps
# the rank's gradient slice itself in that dtype, Ψ/N x 4 bytes (padding included), counted in ``grads``.


def _optimizer_slices(layout: Layout, stage: int, world_size: int) -> list[int]:
    """Numel of each tensor this rank's optimizer updates: one per trainable flat buffer, the whole padded
    buffer at stage 0, this rank's slice above (``ZeroEngine._param_slice``)."""
    padded = [_pad(n, world_size) for n in _stage_buffers(layout, stage)[0]]
    return padded if stage == 0 else [n // world_size for n in padded]


#: Above this many ranks (a search for the fewest nodes that fit, up to millions of ranks) the per-rank counts are
#: bounded instead of computed rank by rank: :func:`_bound`.
_EXACT_RANKS = 1 << 14


def _bound(per: list, world_size: int):
    """``(count, numel, cost)`` as :func:`_rank_segments` gives them, for one rank that bounds them all: rank 0's
    elements, which are every rank's most in every buffer at once (slices are equal and padding is at the end),
    and every nonzero parameter of every buffer as a tensor (more than any rank steps once a slice is smaller
    than a parameter: the scalar states of a few hundred tensors, bytes against the GiBs being planned)."""
    import numpy as np

    numel = sum(min(sum(p), _pad(sum(p), world_size) // world_size) for p in per)
    count = sum(sum(1 for n in p if n > 0) for p in per)
    return np.array([count], dtype=np.int64), np.array([numel], dtype=np.int64), np.zeros(1, dtype=np.int64)


def _rank_segments(layout: Layout, stage: int, world_size: int, cost=None, wide: bool | None = None):
    """Per rank, what it steps (Note [Unused parameters] in zero/masters.py): one optimizer tensor for each
    parameter's part in its slice of each trainable flat buffer (the whole padded buffer at stage 0), padding
    in none. Computed per buffer for all ranks at once (binary search over the parameters' offsets), so that a
    70B model on thousands of ranks costs milliseconds.

    Args:
        cost: ``None``, or a function of tensors' numels (a numpy int64 array, elementwise; 0 for 0) to sum
            over each rank's tensors.
        wide: ``True``: the float64 buffers only (more than 4 bytes per element); ``False``: the others;
            ``None``: all.

    Returns:
        ``(count, numel, cost)``: numpy int64 arrays of length ``world_size`` (length 1 at stage 0, where every
        rank steps the same): tensors, their elements, and the summed ``cost`` (zeros without one).
    """
    import numpy as np

    if stage == 3 and layout.exact:
        per = [u.trainable_params[i] if u.trainable_params else (n,) for u in layout.units
               for i, n in enumerate(u.trainable)]
    else:
        per = [layout.buffer_params[i] if layout.buffer_params else (n,) for i, n in enumerate(layout.buffers)]
    if wide is not None:  # Note [Wide parameters] in zero/precision.py
        per = [p for p, b in zip(per, _stage_sizes(layout, stage, 4)[0]) if (b > 4) == wide]
    ranks = 1 if stage == 0 else world_size
    if ranks > _EXACT_RANKS and cost is None:
        return _bound(per, world_size)
    count, numel, costs = (np.zeros(ranks, dtype=np.int64) for _ in range(3))
    for params in per:
        sizes = np.asarray(params, dtype=np.int64)
        if not sizes.size:
            continue
        ends = np.cumsum(sizes)
        starts = ends - sizes
        size = _pad(int(ends[-1]), world_size) // world_size
        lo = np.zeros(1, dtype=np.int64) if stage == 0 else np.arange(ranks, dtype=np.int64) * size
        hi = np.full(1, size * world_size, dtype=np.int64) if stage == 0 else lo + size
        first = np.searchsorted(ends, lo, side="right")  # the first parameter that ends after lo
        stop = np.searchsorted(starts, hi, side="left")  # parameters [first, stop) start before hi
        nonzero = np.concatenate([[0], np.cumsum(sizes > 0)])  # a zero-element parameter has no part
        count += nonzero[stop] - nonzero[np.minimum(first, stop)]
        numel += np.clip(np.minimum(ends[-1], hi) - lo, 0, None)
        if cost is None:
            continue
        last = len(sizes) - 1
        f, s = np.minimum(first, last), np.clip(stop - 1, 0, last)

        def part(k):  # the part of parameter k (per rank) in the rank's slice
            return np.clip(np.minimum(ends[k], hi) - np.maximum(starts[k], lo), 0, None)

        whole = np.concatenate([[0], np.cumsum(cost(sizes))])  # prefix sums of whole parameters' cost
        two = stop - 1 > first  # the slice cuts two parameters or more: edges, and whole ones between them
        costs += np.where(stop > first, cost(part(f)), 0)
        costs += np.where(two, cost(part(s)) + whole[s] - whole[np.minimum(f + 1, s)], 0)
    return count, numel, costs


def model_states(layout: Layout, stage: int, world_size: int, precision: Precision, optimizer: OptimizerModel,
                 offload: str = "none", *, buffer_mb: float = 64.0, device_is_host: bool = False,
                 grad_accum_bytes: int | None = None, offload_params: bool = False) -> ModelStates:
    """Bytes of parameters, gradients and optimizer states per rank at ``stage`` on ``world_size`` ranks
    (Note [What is exact]; ZeRO paper §5: stage 1 partitions optimizer states, 2 also gradients, 3 also
    parameters). The optimizer's bytes include the fp32 master copy where it is separate from the parameters
    (mixed precision; ``cpu`` offload always).

    Args:
        offload: ``zero.offload_optimizer``: ``none``, ``cpu`` or ``disk``.
        buffer_mb: ``zero.offload_buffer_mb`` (``disk``: the host buffer the states are paged through, MiB).
        device_is_host: a CPU-only machine: ``cpu`` offload's masters and states count as ``optimizer``
            (the engine's "device" is the host), else as ``host``.
        grad_accum_bytes: bytes per element gradients are accumulated in (``policies.grad_accum_bytes``);
            wider than what the stage keeps, a buffer of that width is counted in ``grad_accum`` (Note
            [Gradient accumulation buffer]); ``None``: the gradients' own dtype, no buffer.
        offload_params: stage 3, ``zero.offload_params: disk``: the parameter slices of every unit but the
            persistent one move from ``params`` to ``disk``, each buffer's region rounded up to whole pages
            (``paging_math.page_region_bytes``) (Note [Parameter offload] in ``zero/param_offload.py``).

    Raises:
        ValueError: ``stage`` not in 0-3, ``world_size`` < 1, an unknown ``offload``, or ``layout`` packed for
            another precision.
        ZerorunError: ``disk`` with a ``buffer_mb`` too small to page 16 elements (names
            ``zero.offload_buffer_mb``).
    """
    if stage not in (0, 1, 2, 3) or world_size < 1 or offload not in OFFLOADS[:3] or (offload_params and stage != 3):
        raise ValueError(f"stage must be 0-3, world_size >= 1, offload none, cpu or disk and offload_params at stage "
                         f"3 only, got {stage}, {world_size}, {offload!r}, {offload_params}")
    states = _model_states(layout, stage, world_size, precision, optimizer, offload, buffer_mb=buffer_mb,
                           device_is_host=device_is_host, grad_accum_bytes=grad_accum_bytes)
    if not offload_params:
        return states
    N, pb = world_size, precision.param_bytes
    if layout.exact:
        held = [(n, b) for u in layout.units if u.name != PERSISTENT
                for n, b in zip(u.trainable + u.frozen, _unit_sizes(u, pb))]
    else:
        held = list(zip(layout.buffers, _sizes(layout.buffers, layout.buffer_bytes, pb)))
        held += zip(layout.frozen_params, _sizes(layout.frozen_params, layout.frozen_bytes, pb))
    slices = [(_pad(n, N) // N) * b for n, b in held]  # bytes
    from zerorun.zero.paging_math import page_region_bytes

    return replace(states, params=states.params - sum(slices), disk=states.disk + sum(map(page_region_bytes, slices)))


def _model_states(layout: Layout, stage: int, world_size: int, precision: Precision, optimizer: OptimizerModel,
                  offload: str, *, buffer_mb: float, device_is_host: bool,
                  grad_accum_bytes: int | None) -> ModelStates:
    if layout.precision not in (None, precision.name):
        raise ValueError(f"the layout was packed for {layout.precision}, not {precision.name}")
    N = world_size
    trainable, frozen = _stage_buffers(layout, stage)
    tb, fb = _stage_sizes(layout, stage, precision.param_bytes)  # bytes per element (float64: 8)
    padded = [_pad(n, N) for n in trainable]
    shards = [n // N for n in padded]
    if stage == 3:
        params = sum(n * b for n, b in zip(shards, tb)) + sum(_pad(n, N) // N * b for n, b in zip(frozen, fb))
        params += sum(_pad(n, N) * b for u in layout.units if u.name == PERSISTENT  # whole as well as sliced
                      for n, b in zip(u.trainable + u.frozen, _unit_sizes(u, precision.param_bytes)))
    else:
        params = sum(n * b for n, b in zip(padded, tb)) + sum(n * b for n, b in zip(frozen, fb))
    wide = grad_accum_bytes or 0  # Note [Gradient accumulation buffer]
    if stage < 2:  # a float64 buffer's gradients are float64, accumulated in place (Note [Wide parameters])
        grads = sum(n * b for n, b in zip(padded, tb))
        accum = sum(n * wide for n, b in zip(padded, tb) if wide > b)
    else:
        grads, accum = sum(n * max(precision.reduce_bytes, wide, b) for n, b in zip(shards, tb)), 0
    slices = _optimizer_slices(layout, stage, N)
    master = [8 if b > 4 else 4 for b in tb]  # a float64 buffer's master and states are float64
    # the rank that steps the most (padding and parameter cuts differ): per element, and scalars per tensor
    count, numel, _ = _rank_segments(layout, stage, N)
    if any(b > 4 for b in tb):  # float64 elements count twice (8 bytes)
        numel = numel + _rank_segments(layout, stage, N, wide=True)[1]
    states = int((4 * optimizer.states * numel + (optimizer.scalar_bytes if layout.exact else 0) * count).max())
    if offload == "none":
        own = sum(n * m for n, m in zip(slices, master)) if precision.master_bytes else 0  # fp32: aliased
        return ModelStates(params, grads, states + own, grad_accum=accum)
    if offload == "cpu":  # CpuMasters: never aliased, so an fp32 master even at fp32
        held = states + sum(n * m for n, m in zip(slices, master))
        return (ModelStates(params, grads, held, grad_accum=accum) if device_is_host
                else ModelStates(params, grads, 0, host=held, grad_accum=accum))
    from zerorun.zero.paging_math import subgroup_elements, swap_region_bytes

    chunk = subgroup_elements(int(buffer_mb * 2**20), optimizer.states)
    if chunk < 16:
        raise ZerorunError(f"zero.offload_buffer_mb: {buffer_mb} MiB cannot page even 16 elements of master and "
                           f"{optimizer.states} optimizer state tensors twice")
    regions = 1 + optimizer.states  # the master and each state, per sub-group of one parameter (Note [Disk paging])

    def paged(size):  # swap bytes of tensors' (numpy int64 numels) master or one state, ``size``-byte elements
        step = chunk * 4 // size  # a float64 sub-group holds half as many elements, in the same bytes

        def cost(n):
            return (n // step) * swap_region_bytes(size * step) + (n % step > 0) * swap_region_bytes(size * (n % step))
        return cost

    disk = _rank_segments(layout, stage, N, paged(4), wide=False)[2]
    if any(b > 4 for b in tb):
        disk = disk + _rank_segments(layout, stage, N, paged(8), wide=True)[2]
    return ModelStates(params, grads, 0, host=2 * chunk * 4 * regions, disk=regions * int(disk.max()),
                       grad_accum=accum)
