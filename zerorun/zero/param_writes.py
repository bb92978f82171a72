"""The user's in-place writes to parameters between two optimizer steps, at stages 0-2.

Note [Writes between steps]: at stages 0-2 the parameters are whole on every rank and a user may write them in
place (a clamp after ``engine.step()``, WGAN's weight clipping, a pruning mask, ``nn.init`` of a layer, a
max-norm constraint in the forward). Plain PyTorch and DDP keep such a write: the optimizer steps from the written
values. Where the optimizer's fp32 masters are separate tensors (mixed precision at stages 0-2, optimizer offload
at stages 1-2), the step wrote the masters back over the parameters and the write was lost, silently: a clamp
held the forward's values but not the trained ones (at stages 1-2 with optimizer offload, 6% off stage 0's loss by
the third step; fp32 without offload keeps it, the masters being the parameters' own slices). So each step first
reads the parameters' version counters (one per parameter, bumped by every in-place write through it, not by the
engine's writes through its flat buffer): in a flat buffer written since the masters were last written into the
parameters, the master slice takes the elements of this rank's parameter slice that differ from the master cast
to the parameters' dtype (``UserModel._masters_take``, as ``gathered_parameters(modifier_rank=...)`` takes its
block's writes); the optimizer state stays. Untouched elements keep their fp32 values; a written one keeps what
was written (in the parameters' dtype). Cost: a host read of each parameter's counter per step; the comparison
(a copy of the slice to the masters' device, a host read of whether any element moved) only for a buffer
written. A write through ``.data`` (``p.data.clamp_()``) bumps no counter: it is kept where the masters are the
parameters (fp32 without offload) and lost elsewhere, as at stage 3; write through the parameter itself, under
``torch.no_grad()``. Stage 3 refuses a write outside ``gathered_parameters`` (Note [Parameters at rest] in
stage3_access.py) and inside a unit's forward (Note [Writes inside a unit's forward] in stage3_checks.py).

Note [Writes that differ by rank]: a write that depends on the rank's data (``nn.Embedding(max_norm=...)``
renorms, in the forward, the rows its batch looks up) leaves each rank's parameters different. DDP and stage 0
let each rank's copy drift from the others; at stages 1-2 each rank steps one slice and the all-gather after the
step mixed the ranks' writes (2.4% off stage 0's loss in two steps), silently. So at stages 1-2 the step's
agreement at the end of its last backward (``agreements.py``) carries, per flat buffer, whether this rank wrote
it since the engine last did (:class:`ParamWrites`); where some rank did, every rank compares that buffer with
rank 0's, bit for bit (a broadcast of it, then one more host agreement of a flag per parameter), and a parameter
that differs raises on every rank, naming it, before the step. The ranks' flags are summed, so ranks that wrote
alike pass (a clamp after every step: a broadcast of the buffers written per step, no other cost). A write between
the last backward and ``engine.step()`` is not compared (it is taken as written on each rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zerorun.zero.flat import FlatBuffer


class ParamWrites:
    """The version counters of the parameters of ``buffers`` when the engine last wrote them (Note [Writes
    between steps]). Host only: no collective, no device read."""

    def __init__(self, buffers: list[FlatBuffer]) -> None:
        self.buffers = list(buffers)
        self._versions: dict[FlatBuffer, list[int]] = {}
        self.mark()

    def mark(self, bufs: list[FlatBuffer] | None = None) -> None:
        """The engine has just written ``bufs`` (``None``: every buffer) from the masters: remember the counters."""
        for buf in self.buffers if bufs is None else bufs:
            self._versions[buf] = [p._version for p in buf.params]

    def written(self) -> list[FlatBuffer]:
        """The buffers of which a parameter was written in place since :meth:`mark`, in their order."""
        return [b for b in self.buffers if [p._version for p in b.params] != self._versions[b]]


class DifferingWrites:
    """The reducer's rider at stages 1-2 (Note [Writes that differ by rank]): ``engine``'s buffers written since its
    last write of them, and the comparison with rank 0's where some rank wrote one."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def values(self) -> list[int]:
        """Per flat buffer of the engine, 1 where this rank wrote it since the engine last did (host only)."""
        written = set(self.engine.writes.written())
        return [int(b in written) for b in self.engine.buffers]

    def take(self, sums: list[int]) -> None:
        """``sums``: :meth:`values` summed over the ranks. A buffer some rank wrote is compared with rank 0's.

        Raises:
            RuntimeError: on every rank, where a parameter's values differ between ranks, naming it.
        """
        bufs = [b for b, n in zip(self.engine.buffers, sums) if n > 0]
        if not bufs or self.engine.world_size == 1:
            return
        comm = self.engine.comm
        firsts = [b.data.clone() for b in bufs]
        comm.wait([comm.broadcast(t, 0) for t in firsts])
        named = [(name, buf.slots[p], first, buf) for first, buf in zip(firsts, bufs)
                 for name, p in zip(buf.names, buf.params)]
        differ = comm.agree([int(not torch.equal(_bits(first, s), _bits(buf.data, s))) for _, s, first, buf in named])
        name = next((n for (n, *_), d in zip(named, differ) if d), None)
        if name is not None:
            raise RuntimeError(
                f"stage {self.engine.stage}: parameter {name!r} was written in place with values that differ "
                "between ranks since the last step (a write that depends on the rank's data, e.g. "
                "nn.Embedding(max_norm=...) renorming the rows of this rank's batch, or one made on some ranks "
                "only): at stages 1-2 each rank steps one slice of it, so the step would mix the ranks' writes (DDP "
                "and stage 0 let each rank's copy drift instead). Make the write the same on every rank (after "
                "engine.step(), inside engine.gathered_parameters([...], modifier_rank=0)), or use stage 0")


def _bits(flat: torch.Tensor, slot) -> torch.Tensor:
    """The bytes of one parameter's elements of the flat tensor ``flat``: compared bit for bit (NaN alike)."""
    return flat[slot.offset:slot.offset + slot.numel].view(torch.uint8)
