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
    (stage 3: per unit, frozen ones in one flat buffer per unit; stages 0-2: frozen parameters whole)."""
    if stage == 3 and layout.exact:
        return [n for u in layout.units for n in u.trainable], [n for u in layout.units for n in u.frozen]
    return list(layout.buffers), list(layout.frozen_params)


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


def _segments(layout: Layout, stage: int, world_size: int) -> list[list[int]]:
    """Per rank, the numel of each optimizer tensor it steps: each parameter's part in its slice of each
    trainable flat buffer (the whole padded buffer at stage 0), padding in none (Note [Unused parameters] in
    zero/masters.py)."""
    if stage == 3 and layout.exact:
        per = [u.trainable_params[i] if u.trainable_params else (n,) for u in layout.units
               for i, n in enumerate(u.trainable)]
    else:
        per = [layout.buffer_params[i] if layout.buffer_params else (n,) for i, n in enumerate(layout.buffers)]
    out: list[list[int]] = [[] for _ in range(world_size)]
    for params in per:
        size = _pad(sum(params), world_size) // world_size
        for r in range(world_size):
            lo, hi = (0, size * world_size) if stage == 0 else (r * size, (r + 1) * size)
            offset = 0
            for n in params:
                part = min(offset + n, hi) - max(offset, lo)
                if part > 0:
                    out[r].append(part)
                offset += n
    return out


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
    N, size = world_size, precision.param_bytes
    held = ([n for u in layout.units if u.name != PERSISTENT for n in u.trainable + u.frozen] if layout.exact
            else [*layout.buffers, *layout.frozen_params])
    slices = [_pad(n, N) // N for n in held]
    from zerorun.zero.paging_math import page_region_bytes

    return replace(states, params=states.params - sum(n * size for n in slices),
                   disk=states.disk + sum(page_region_bytes(n * size) for n in slices))


def _model_states(layout: Layout, stage: int, world_size: int, precision: Precision, optimizer: OptimizerModel,
                  offload: str, *, buffer_mb: float, device_is_host: bool,
                  grad_accum_bytes: int | None) -> ModelStates:
    if layout.precision not in (None, precision.name):
        raise ValueError(f"the layout was packed for {layout.precision}, not {precision.name}")
    N = world_size
    trainable, frozen = _stage_buffers(layout, stage)
    padded = [_pad(n, N) for n in trainable]
    shards = [n // N for n in padded]
    if stage == 3:
        params = (sum(shards) + sum(_pad(n, N) // N for n in frozen)) * precision.param_bytes
        params += sum(_pad(n, N) for u in layout.units if u.name == PERSISTENT  # whole as well as sliced
                      for n in u.trainable + u.frozen) * precision.param_bytes
    else:
        params = (sum(padded) + sum(frozen)) * precision.param_bytes
    wide = grad_accum_bytes or 0  # Note [Gradient accumulation buffer]
    if stage < 2:
        grads = sum(padded) * precision.grad_bytes
        accum = sum(padded) * wide if wide > precision.grad_bytes else 0
    else:
        grads, accum = sum(shards) * max(precision.reduce_bytes, wide), 0
    slices = _optimizer_slices(layout, stage, N)
    segments = _segments(layout, stage, N)  # the rank that steps the most (padding and parameter cuts differ)
    states = max(4 * optimizer.states * sum(segs) + (optimizer.scalar_bytes if layout.exact else 0) * len(segs)
                 for segs in segments)  # per element, and scalars: one per optimizer tensor
    if offload == "none":
        return ModelStates(params, grads, states + precision.master_bytes * sum(slices), grad_accum=accum)
    if offload == "cpu":  # CpuMasters: never aliased, so an fp32 master even at fp32
        held = states + 4 * sum(slices)
        return (ModelStates(params, grads, held, grad_accum=accum) if device_is_host
                else ModelStates(params, grads, 0, host=held, grad_accum=accum))
    from zerorun.zero.paging_math import subgroup_elements, swap_region_bytes

    chunk = subgroup_elements(int(buffer_mb * 2**20), optimizer.states)
    if chunk < 16:
        raise ZerorunError(f"zero.offload_buffer_mb: {buffer_mb} MiB cannot page even 16 elements of master and "
                           f"{optimizer.states} optimizer state tensors twice")
    regions = 1 + optimizer.states  # the master and each state, per sub-group of one parameter (Note [Disk paging])
    disk = 0
    for segs in segments:
        mine = 0
        for n in segs:
            full, rest = divmod(n, chunk)
            mine += regions * (full * swap_region_bytes(4 * chunk) + (swap_region_bytes(4 * rest) if rest else 0))
        disk = max(disk, mine)
    return ModelStates(params, grads, 0, host=2 * chunk * 4 * regions, disk=disk, grad_accum=accum)
