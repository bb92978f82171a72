"""Stage 3's unit: a group of parameters all-gathered and freed together (Notes [Units], [Unit lifecycle] in
``stage3.py``), owning its flat buffers, its state and its collectives; and the end of a unit's backward
(``UnitInputsDone``). Which modules are units: ``unit_plan.py``.

Note [One all-gather per unit]: a unit holds one flat buffer per optimizer param group (AdamW with weight decay:
its matrices, and its biases and norms) and frozen ones; they are all-gathered as one collective with one handle
(``Comm.all_gather_coalesced``). Under NCCL that is torch's coalesced all-gather (one group launch), each buffer
gathered in place into its own storage: no copy in or out, nothing more held. Under gloo it is one all-gather of a
packed message (this rank's slices end to end as bytes, copied out into the buffers at the wait), which is what
gloo's own coalesced all-gather does inside (flatten, gather, unflatten) without its fault: run concurrently with
the other in-flight collectives of a stage-3 step, it corrupted the heap (``malloc(): unaligned tcache chunk
detected``, or a rank hung: 4 of 4 stress runs of the 2-rank ``root-experts-vary-by-micro-step`` case died within
16 to 590 runs of it; packed, 2 x 1500 runs and 100 of the 3-rank GPT parity case ran clean, as did 1500 with one
all-gather per buffer). Where the buffers' dtypes differ (a float64 parameter kept beside float32 ones, Note [Wide
parameters]; an integer frozen one) every buffer travels as its bytes (a ``uint8`` view: the same bytes in the same
places). Peer units of different layouts pad that message to the largest peer's (Note [Peer units] in
unit_plan.py). Measurements: benchmarks/results/history.md, issue 38.

Note [Units gathered together]: where a unit's all-gather is issued, the all-gathers of the units it prefetches
(Note [Prefetch] in stage3.py) and, at the root, of the outer units gathered with it (Note [Outer units]) follow
at once: at the start of a forward the root's, the embeddings' and the first block's were three collectives
before the first block could run, each a round trip between ranks on a small model. Inside
``Gathering.together()`` (the schedule's forward and backward hooks) the exact all-gathers are queued and issued
as one ``Comm.all_gather_coalesced`` over all their buffers, in the order queued, at the end of the block or at
the first wait for one of them, whichever comes first; each unit holds the one handle. What is gathered, and
when each unit may be used, is as before; only the number of collectives falls. A peer unit's padded message
(Note [Peer units]) goes alone after the ones queued before it; ZeRO++'s gathers (secondary shards, quantized
weights) are issued one by one as before. Only all-gathers whose grouping is the same on every rank that gathers
the same units may be queued together. A unit's own and the root's outer units' (agreed in the first step) are;
so are its prefetches, because what a rank prefetches follows from the units it gathered alone: the recorded
order and "this pass left it" leave out the calls of a unit that is pinned (by a unit that reads it, or a
``gathered_parameters`` block) or already running (Note [Prefetch]; such a call gathers nothing, and a block
calling a pinned one again on one rank once made that rank alone stop prefetching: one rank sent three blocks in
one message, the other one, and gloo aborted). Not the tails' (Note [Outer units]: gathered at their outputs'
gradient or at the first block's backward, whichever comes first on that rank, so one rank would send them in
the block's message and the other alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from zerorun.zero.torch_internals import in_backward

if TYPE_CHECKING:
    from zerorun.zero.flat import FlatBuffer


class UnitState(enum.Enum):
    FREE = "free"
    GATHERING = "gathering"  # all-gather issued, not waited for
    GATHERED = "gathered"


@dataclasses.dataclass
class Gathering:
    """What the units of one engine share to gather and free: its collectives (``Comm``), its parameter store
    (``ParamStore`` or ``None``: Note [Parameter offload] in param_offload.py), the indices of the units
    all-gathered since the last step (Note [Same units on every rank] in stage3_checks.py) and the class its
    parameters take at rest (Note [Plain while gathered] in stage3_access.py), the secondary shards (hpZ) and the
    weights' quantizer (qwZ)."""

    comm: Any
    store: Any
    guard: type
    log: list[int] = dataclasses.field(default_factory=list)
    secondary: Any = None  # SecondaryShards where zero.hierarchy is set (Note [Secondary shards] in hierarchy.py)
    # from a forward with gradients enabled until the optimizer step (or an evaluation's forward): the gathers
    # of a training pass (Notes [Secondary shards] in hierarchy.py, [Quantized weights] in quantize.py)
    training: bool = False
    quantizer: Any = None  # WeightQuantizer where zero.quantize_weights is set (Note [Quantized weights])
    pending: list | None = None  # inside together(): the units whose all-gather is issued at its end

    @contextlib.contextmanager
    def together(self):
        """Inside the block, the units' exact all-gathers are issued as one collective at its end, or at the
        first wait for one of them before it (Note [Units gathered together])."""
        if self.pending is not None or self.secondary is not None or self.quantizer is not None:
            yield
            return
        self.pending = []
        try:
            yield
        finally:  # issued on an error too: a unit in GATHERING must have its handle
            try:
                self.flush()
            finally:
                self.pending = None

    def flush(self) -> None:
        """Issue the pending units' all-gathers as one (Note [Units gathered together])."""
        units, self.pending = self.pending, []
        if units:
            work = self.comm.all_gather_coalesced([b.data for u in units for b in u.buffers],
                                                  [b.shard_data for u in units for b in u.buffers])
            for unit in units:
                unit.works = [work]

    @contextlib.contextmanager
    def exact(self):
        """Inside the block, gathers are from the primary shards and exact (a state dict, ``gathered_parameters``
        between a backward and its step)."""
        was, self.training = self.training, False
        try:
            yield
        finally:
            self.training = was


class Unit:
    """A module gathered and freed as one (Note [Units]): its flat buffers (at rest this rank's slice of each,
    ``shard_data``; while gathered the whole ``data``, which its parameters view), its state, and the
    all-gathers in flight. :meth:`unshard` and :meth:`reshard` are the lifecycle (Note [Unit lifecycle]);
    ``ctx`` (:class:`Gathering`) is set by the engine before either runs."""

    def __init__(self, name: str, module: nn.Module, is_root: bool, persistent: bool = False,
                 outer: bool = False) -> None:
        self.ctx: Gathering | None = None
        self.name, self.module, self.is_root, self.persistent = name, module, is_root, persistent
        self.outer = outer  # Note [Outer units]: a module outside the listed units, gathered on a learned schedule
        self.buffers: list = []  # FlatBuffer
        self.state = UnitState.FREE
        self.adopted: list = []  # its parameters whose class the engine switches (Note [Plain while gathered])
        self.gather_bytes = 0  # > 0: one all-gather of this many bytes per rank (Note [Peer units] in unit_plan.py)
        self.works: list[Any] = []
        self.ready_buffers = 0
        self.index = -1  # position in the engine's unit list, equal on every rank
        self.open_calls = 0  # forward calls of this step whose backward has not reached the unit's inputs yet
        # a forward call of this step whose inputs need no gradient, or that the loss reaches but not its inputs, on
        # some rank: nothing signals the end of its backward, so the unit stays gathered to the end of backward on
        # every rank (Note [End of a unit's backward] in stage3_schedule.py)
        self.open_ended = False
        self.external: list[Unit] = []  # units whose parameters this unit's forward reads (register_external_parameter)
        self.pinned_by: set = set()  # gathered units (or gathered_parameters blocks) that need this one gathered
        self.active = 0  # forward calls of this unit now on the stack
        self.out_nodes: list = []  # grad_fn of its outputs since the last backward (Note [Backward on some ranks])
        self.in_nodes: list = []  # UnitInputsDone's nodes since the last backward (Note [End of a unit's backward])
        self.ends_agreed = False  # this backward, every rank reaches its end of backward (its buckets reduce there)
        # Note [Outer units]: a tail that this backward gathers at its own outputs' gradient, not with the root
        self.deferred = False
        self.held = False  # gathered past its forward's end for its backward (Note [Kept from forward to backward])

    @property
    def trainable(self) -> list[FlatBuffer]:
        return [b for b in self.buffers if b.group_index >= 0]

    @property
    def slice_bytes(self) -> int:
        """Bytes of this rank's slices of the unit's flat buffers (what it sends in an all-gather)."""
        return sum(b.shard_numel * b.dtype.itemsize for b in self.buffers)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the unit's parameters when gathered (all its flat buffers, whole)."""
        return sum(b.numel * b.dtype.itemsize for b in self.buffers)

    def __repr__(self) -> str:
        return f"Unit({self.name or '<root>'})"

    # ------------------------------------------------------------------------------------------ lifecycle
    def unshard(self, wait: bool = True) -> None:
        """All-gather the unit's buffers if it is free (its parameters then view the gathered ``data``), with
        the units its forward reads (:attr:`external`, pinned); with ``wait``, wait for the all-gathers:
        the unit is then ``GATHERED`` and its parameters plain (Note [Plain while gathered])."""
        ctx = self.ctx
        if self.state is UnitState.FREE:
            self.point_params(gathered=True)
            if ctx.secondary is not None and ctx.training and ctx.secondary.holds(self):  # Note [Secondary shards]
                self.works = [ctx.secondary.all_gather(self)]
            elif ctx.quantizer is not None and ctx.training and not self.gather_bytes:  # Note [Quantized weights]
                self.works = [ctx.quantizer.all_gather(ctx.comm, [b.data for b in self.buffers],
                                                       [b.shard_data for b in self.buffers])]
            elif ctx.pending is not None and not self.gather_bytes:  # Note [Units gathered together]
                ctx.pending.append(self)
            else:
                if ctx.pending:  # a peer unit's padded message goes alone, after the ones before it
                    ctx.flush()
                self.works = [ctx.comm.all_gather_coalesced([b.data for b in self.buffers],
                                                            [b.shard_data for b in self.buffers], self.gather_bytes)]
            self.state = UnitState.GATHERING
            if self.index >= 0:
                ctx.log.append(self.index)
            for other in self.external:  # Note [External parameters] in stage3_access.py
                if not other.deferred:  # Note [Outer units]: a tail this backward gathers later
                    other.unshard(wait=False)
                    other.pinned_by.add(self)
        if wait and self.state is UnitState.GATHERING:
            for other in self.external:
                if not other.deferred:
                    other.unshard()
            self._wait()
            self.state = UnitState.GATHERED
            self.versions = self.param_versions()  # Note [Writes inside a unit's forward] in stage3_checks.py
            if not self.outer:  # outer units stay guarded: their schedule is learned from who reads them
                for p in self.adopted:
                    p.__class__ = nn.Parameter

    def reshard(self) -> None:
        """Free the gathered ``data`` (its parameters hold placeholders again, guarded: Note [Parameters at
        rest]) unless the unit is persistent or pinned by another gathered unit; then the units it pinned
        that are not running are freed too (an outer unit in backward: when its own gradient is done)."""
        if self.state is UnitState.FREE or self.persistent or self.pinned_by or (self.open_ended and in_backward()):
            return
        self._wait()
        self.keep_secondary()
        for p in self.adopted:
            p.__class__ = self.ctx.guard
        self.point_params(gathered=False)
        self.state = UnitState.FREE
        self.held = False
        if in_backward() and self.open_calls > 0:  # its backward goes on: its first ops' input gradients, which
            return  # may read the units it reads, come after its own parameters' (released at its end)
        self.release_external()

    def hold(self) -> None:
        """Note [Kept from forward to backward] in stage3_outer.py: the gathered unit stays gathered past the end of
        the forward for its backward; until then its parameters are guarded as at rest (user code reading them
        between the forward and its backward is refused, as where the unit is freed)."""
        self.held = True
        self.keep_secondary()
        for p in self.adopted:
            p.__class__ = self.ctx.guard

    def end_hold(self) -> None:
        """The window after the forward ends (backward, a new forward, an engine call that gathers): the unit is an
        ordinary gathered one again, its parameters plain unless it is an outer unit (Note [Plain while gathered])."""
        self.held = False
        if not self.outer and self.state is UnitState.GATHERED:
            for p in self.adopted:
                p.__class__ = nn.Parameter

    def gather_external(self) -> None:
        """All-gather the units this gathered unit's forward reads (:attr:`external`), pinned by it, as
        :meth:`unshard` does with its own all-gather, and wait for them: a unit kept from its forward into its
        backward (Note [Kept from forward to backward] in stage3_outer.py) whose external units the forward's end
        freed."""
        others = [o for o in self.external if not o.deferred]
        for other in others:
            other.unshard(wait=False)
            other.pinned_by.add(self)
        for other in others:
            other.unshard()

    def keep_secondary(self) -> None:
        """At the end of its use in a forward that a backward follows (freed, or kept gathered: Note [Kept from
        forward to backward] in stage3_outer.py), this rank's secondary slices of the gathered unit are kept, so
        that its later all-gathers stay within the secondary group (Note [Secondary shards] in hierarchy.py)."""
        secondary = self.ctx.secondary
        if secondary is not None and self.ctx.training and not self.gather_bytes and not in_backward():
            secondary.keep(self)

    def point_params(self, gathered: bool) -> None:
        """The flat buffers' storage gets its bytes and the parameters view it (``gathered``), or the parameters
        hold their placeholders and the storage goes (Note [Parameters at rest] in stage3_access.py)."""
        with torch._C.DisableTorchFunctionSubclass():  # the guard's metadata path, skipped per parameter
            for buf in self.buffers:
                buf.data.untyped_storage().resize_(buf.data.nbytes if gathered else 0)
                for p, t in zip(buf.params, buf.views if gathered else buf.placeholders):
                    p.data = t

    def release_external(self) -> None:
        """Unpin the units this one's forward reads (:attr:`external`) and free those not running."""
        for other in self.external:
            other.pinned_by.discard(self)
            if other.active == 0 and not (other.outer and in_backward()):
                other.reshard()

    def _wait(self) -> None:
        if self.ctx.pending and self in self.ctx.pending:
            self.ctx.flush()
        if self.works:
            self.ctx.comm.wait(self.works)
            self.works = []
            if self.ctx.store is not None:  # Note [Parameter offload]: the slices' pages go again
                self.ctx.store.release(self.buffers)

    def param_versions(self) -> list[int]:
        """The version counters (bumped by every in-place write) of the parameters, in buffer order, read
        without the at-rest guard (Note [Writes inside a unit's forward] in stage3_checks.py)."""
        with torch._C.DisableTorchFunctionSubclass():
            return [p._version for buf in self.buffers for p in buf.params]


def units_ahead(order: list[Unit], i: int, limit: int | None) -> list[Unit]:
    """The units to all-gather ahead when ``order[i]`` (the recorded order, Note [Prefetch] in ``stage3.py``)
    starts: the next one when ``limit`` is None, else the following ones while their
    :attr:`Unit.gathered_bytes` sum to at most ``limit`` bytes (ZeroConfig.prefetch_bytes; a unit already
    gathered counts too: it is live ahead of use)."""
    if limit is None:
        return order[i + 1:i + 2]
    ahead, total = [], 0
    for unit in order[i + 1:]:
        total += unit.gathered_bytes
        if total > limit:
            break
        ahead.append(unit)
    return ahead


class UnitInputsDone(torch.autograd.Function):
    """Identity on a unit's forward inputs whose backward calls ``callback()``: once autograd has computed the
    gradients of a unit's inputs, the unit's backward is done (its parameters' gradient accumulators run as
    soon as they are ready, before anything that depends on them: FSDP2 detects the end of a module's backward
    the same way). Shapes and dtypes pass through unchanged; the result is a tuple."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], *tensors: torch.Tensor):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)
