"""The gradient reducer: when each bucket's gradient is complete, in which order buckets are reduced, how many
reductions are in flight. One mechanism; a :class:`~zerorun.zero.policy.StagePolicy` says what stages change.

Note [Per-parameter readiness]: a bucket is reduced once every one of its parameters is complete. A parameter is
complete when its gradient has been accumulated as many times as in the last step that reduced (autograd accumulates
a leaf once per graph task, so a layer used twice under reentrant ``torch.utils.checkpoint``, whose recomputations
run as graph tasks of their own, accumulates twice; the first step assumes once); a parameter that got no gradient
in that step is complete at the start of backward (known unused: its bucket is reduced early, with zeros, or at
stages 0-1 with the micro-steps' sum so far). A guess can be wrong (the graph changed): a gradient that arrives
after its bucket was launched is kept aside (stages 0-1 detach ``p.grad`` from the bucket at launch, so autograd
never writes into a buffer a collective is reading), and at the end of the step's last backward the ranks agree,
with one sum on the host of one flag per bucket and one per parameter (Note [Agreements on the host] in ``comm.py``:
no GPU stall; control traffic, not counted in ``bytes_sent``; the parameters' flags are Note [Unused parameters]'s
mask, in ``masters.py``), which buckets got late gradients anywhere, in any micro-step; those are reduced once more
and added (reduction is linear: the late gradients of all micro-steps are summed first). The result is the right
gradient at every stage, whatever the graph does; a wrong guess costs a collective.

Note [Launch order]: every rank must issue the same collectives in the same order. In the first step,
buckets are launched by the registration index of their first parameter, descending (the order backward
usually makes them ready); a bucket that is ready waits for the buckets before it. At the end of the first
step's backward, the order in which rank 0's buckets became ready is broadcast and becomes the launch order
of every later step (DDP rebuilds its buckets after the first iteration the same way), with the buckets rank
0 found unused first: they are launched at the start of backward. Buckets stay runs of consecutive parameters
in registration order (they are the parameters' storage and the optimizer's partition); their launch order is
what is rebuilt. A parameter that gets no gradient in a step gets a zero gradient in its bucket; one that got
none on any rank is then not stepped (Note [Unused parameters] in ``masters.py``).

Note [Program order]: NCCL pairs a communicator's collectives by the order they are issued, and communicators that
can run at the same time must be issued in the same order on every rank, or it may deadlock (gloo pairs by order
too: a mismatch hangs or mixes data). So every rank issues the same sequence of collectives whatever the timing: no
launch is decided by a handle's ``is_completed()``, nor by when a gradient arrives where ranks may differ. Stages
0-2 run no other collective in backward: buckets are launched as they become ready, in the launch order. Stage 3
all-gathers units in backward on the same group (as FSDP2 issues all-gather and reduce-scatter on one group at
program-ordered points, overlapping through streams: Note [Streams] in streams.py), and readiness differs between
ranks (an expert unused on one rank is complete at the start of backward; an outer unit's gradient comes before or
after a listed unit's all-gather: Note [Outer units]). So stage 3 (``policy.ordered_launch``) launches at two points
only: a listed unit's end of backward (Note [End of a unit's backward]), where every rank agreed before backward
that it reaches it (``check_backward_units``), launches that unit's buckets in their fixed order, complete here or
not (a gradient after it is late: Note [Per-parameter readiness]); the end of backward launches every bucket left
(the root's, outer units', persistent ones, a unit's whose end some rank does not reach) in the launch order.
Memory: a bucket's full gradient is held until its point (outer units': the end of backward).

Note [Waiting in hooks]: with ``MAX_INFLIGHT + 1`` reductions in flight (each holds a bucket-sized buffer:
the full gradient at stages 2-3, gloo's receive buffer at stage 1), or as many pool buffers taken, the oldest
is waited for, inside a gradient hook too: waiting issues nothing, so with the same sequence of collectives
on every rank (Note [Program order]) it cannot deadlock. A bucket that must start filling while every taken
buffer is still filling takes one past the bound.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch
import torch.nn as nn

from zerorun.zero.adoption import adoptable
from zerorun.zero.agreements import agree_at_step_end, launch_order
from zerorun.zero.comm import BufferPool, Comm
from zerorun.zero.flat import FlatBuffer
from zerorun.zero.gloo_reduce_scatter import runs
from zerorun.zero.policy import StagePolicy
from zerorun.zero.precision import wide_or
from zerorun.zero.torch_internals import run_last, will_accumulate
from zerorun.zero.user_model import backward_outside_engine, spoiled_by
from zerorun.zero.weakhook import weak_hook


class GradReducer:
    """Reduces the gradients of ``buffers`` over ``comm`` as ``policy`` prescribes (module Notes).

    Args:
        buffers: the trainable flat buffers (their ``data`` allocated unless ``policy.keep_full_grad`` is off).
        comm: the collectives' process group.
        policy: the stage (Note [Stage policies]).
        reduce_dtype: dtype in which gradients are reduced.
        accum_dtype: dtype in which micro-step gradients are summed (``zero.grad_accum_dtype``). A float64
            bucket is reduced and summed in float64 whatever these say (Note [Wide parameters], precision.py).
        max_inflight: ``MAX_INFLIGHT`` (Note [Waiting in hooks]).
        coalesce_bytes: stage 3: the most bytes of buckets launched together reduced as one collective (Note [One
            reduce-scatter per launch] in gloo_reduce_scatter.py).

    Attributes:
        order: the launch order (Note [Launch order]).
        late_fixups: buckets reduced a second time because a gradient came after their launch, in all.
        adopted: bucket gradients taken from autograd without a copy, in all (Note [Adopted gradient] in adoption.py).
        on_ready: callbacks ``f(buf)`` run when a bucket's gradient is complete (stage 3 frees its unit).
        rider: ``None``, or an object whose values join the agreement of the step's last backward (``agreements``).
        spoiled: why this step's gradients are partial, or ``None``; dropped: 1 where ``engine.zero_grad`` dropped
            gradients since the last step, else 0 (Note [A backward that raised] in user_model.py).
    """

    def __init__(self, buffers: list[FlatBuffer], comm: Comm, policy: StagePolicy, *, reduce_dtype: torch.dtype,
                 accum_dtype: torch.dtype, max_inflight: int, coalesce_bytes: int = 0) -> None:
        self.buffers, self.comm, self.policy, self.world_size = buffers, comm, policy, comm.world_size
        self.reduce_dtype, self.accum_dtype = reduce_dtype, accum_dtype
        self.cap, self.coalesce_bytes = max_inflight + 1, coalesce_bytes
        self.pool = BufferPool(keep=max_inflight + 1)
        self.rdtype = {b: wide_or(b.dtype, reduce_dtype) for b in buffers}  # Note [Wide parameters] in precision.py
        self.on_ready: list[Callable[[FlatBuffer], None]] = []
        self.rider: Any = None
        self.order = sorted(buffers, key=lambda b: b.order, reverse=True)
        self.late_fixups = self.adopted = 0
        self._slot = {p: b for b in buffers for p in b.params}
        self._expected = dict.fromkeys(self._slot, 1)
        self._pending: deque[tuple[FlatBuffer, Any, Any]] = deque()
        self._result: dict[FlatBuffer, torch.Tensor] = {}
        self._late: dict[FlatBuffer, torch.Tensor] = {}
        self._adopted: set[FlatBuffer] = set()
        self._used: set[nn.Parameter] = set()
        self.used: set[nn.Parameter] | None = None
        self.sync = self.last = self._recorded = self.running = False  # running: engine.backward's
        self.spoiled, self.dropped = None, 0
        self._reset()

    # ------------------------------------------------------------------------------------------ allocation
    def allocate(self) -> None:
        """Allocate the gradients the stage keeps and register the gradient hooks."""
        for buf in self.buffers:
            buf.acc = None
            accum = wide_or(buf.dtype, self.accum_dtype)
            if self.policy.keep_full_grad:
                buf.grad = torch.zeros_like(buf.data)
                for p in buf.params:
                    p.grad = buf.view_of(buf.grad, p)
                if accum != buf.dtype:  # zero.grad_accum_dtype wider than the gradients
                    buf.acc = torch.zeros(buf.numel, dtype=accum, device=buf.device)
            else:
                buf.shard_grad = torch.zeros(buf.shard_numel, dtype=torch.promote_types(self.rdtype[buf], accum),
                                             device=buf.device)
        on_grad = weak_hook(self._on_grad)  # Note [Hooks hold their owner weakly] in weakhook.py
        self.handles = [p.register_post_accumulate_grad_hook(on_grad) for p in self._slot]

    def grad_bytes(self) -> int:
        """Bytes of gradient this rank keeps across micro-steps (full gradients or slices, accumulators)."""
        if self.policy.keep_full_grad:
            return sum(b.grad.nbytes + (b.acc.nbytes if b.acc is not None else 0) for b in self.buffers)
        return sum(b.shard_grad.nbytes for b in self.buffers)

    def grad_slice(self, buf: FlatBuffer) -> torch.Tensor:
        """This rank's reduced gradient for the part of ``buf`` its optimizer updates (1-D: ``numel`` elements
        when the optimizer is not partitioned, else ``shard_numel``)."""
        if buf in self._result:
            return self._result[buf]
        if not self.policy.keep_full_grad:
            return buf.shard_grad
        return buf.shard(buf.grad) if self.policy.partition_optimizer else buf.grad

    # -------------------------------------------------------------------------------------------- backward
    def _reset(self) -> None:
        self._nready = dict.fromkeys(self.buffers, 0)
        self._ready, self._launched = set(), set()  # buckets complete, launched
        self._ready_seq: list[FlatBuffer] = []  # in the order they became ready
        self._written: dict[FlatBuffer, set] = {}
        self._next = 0
        self._count = dict.fromkeys(self._slot, 0)

    def begin(self, last_micro_step: bool) -> None:
        """Before a backward: whether it reduces; parameters known unused are complete now (Note
        [Per-parameter readiness])."""
        self.sync, self.last = last_micro_step or self.policy.reduce_every_micro_step, last_micro_step
        self.running = True
        self._reset()
        for p, handle in zip(self._slot, self.handles):  # Note [User gradient hooks run first] in user_model.py
            run_last(p, handle)
        if not self.sync:
            return
        for p, n in self._expected.items():
            if n == 0:
                self._param_ready(self._slot[p])
        self._launch_ready()

    def _on_grad(self, p: nn.Parameter) -> None:
        buf = self._slot.get(p)
        if buf is None:  # a user's hook before it returned a value (torch passes it on, then raises that it must not)
            return
        if not self.running:  # Note [One backward per micro-step] in user_model.py
            error = backward_outside_engine(next(n for n, q in zip(buf.names, buf.params) if q is p))
            self.spoiled = self.spoiled or spoiled_by(error)  # autograd accumulated into p.grad already
            raise error
        self._used.add(p)  # Note [Unused parameters]
        if p.grad.layout != torch.strided:  # Note [Sparse gradients] in user_model.py
            p.grad = p.grad.to_dense()
        if buf in self._launched:  # Note [Per-parameter readiness]: a gradient after the launch
            if buf not in self._late:
                self._late[buf] = torch.zeros(buf.numel, dtype=p.grad.dtype, device=buf.device)
            buf.view_of(self._late[buf], p).add_(p.grad)
            p.grad = None
        elif self.policy.keep_full_grad:
            view = buf.view_of(buf.grad, p)
            if p.grad.data_ptr() != view.data_ptr():  # grads were set to None by someone: keep our layout
                view.add_(p.grad)
                p.grad = view
            if not self.sync:
                return
        else:
            if buf.grad is None and adoptable(buf, p.grad, self.rdtype[buf]):  # Note [Adopted gradient]
                self.adopted += 1
                buf.grad = p.grad.view(-1)
                self._adopted.add(buf)
                self._written[buf] = {p}
            else:
                if buf.grad is None:  # filled by copies; what no gradient reaches is zeroed at launch
                    self._make_room(need_buffer=buf)
                    buf.grad = self.pool.take(buf.numel, self.rdtype[buf], buf.device)
                    self._written[buf] = set()
                view = buf.view_of(buf.grad, p)
                (view.add_ if p in self._written[buf] else view.copy_)(p.grad)
                self._written[buf].add(p)
            p.grad = None
        self._count[p] += 1
        if self._count[p] == self._expected[p]:
            self._param_ready(buf)
        self._launch_ready()

    def _param_ready(self, buf: FlatBuffer) -> None:
        self._nready[buf] += 1
        if self._nready[buf] == len(buf.params):
            self._bucket_ready(buf)

    def _bucket_ready(self, buf: FlatBuffer) -> None:
        if buf not in self._ready:
            self._ready.add(buf)
            self._ready_seq.append(buf)
            for callback in self.on_ready:
                callback(buf)

    def accumulates_later(self, p: nn.Parameter) -> bool:
        """Inside a backward: whether ``p``'s gradient has not been accumulated yet but will be."""
        return self._count[p] == 0 and will_accumulate(p)

    def force_ready(self, buf: FlatBuffer) -> None:
        """Stage 3, at the end of a unit's backward: ``buf`` is complete (its unit may be freed) unless the running
        backward will still accumulate into one of its incomplete parameters (Note [Per-parameter readiness])."""
        if buf in self._ready or not self.sync:
            return
        if not any(self._count[p] < self._expected[p] and will_accumulate(p) for p in buf.params):
            self._bucket_ready(buf)

    def _make_room(self, need_buffer: FlatBuffer | None) -> None:
        """Note [Waiting in hooks]: wait for the oldest reductions until one more fits."""
        def full() -> bool:
            return len(self._pending) >= self.cap or need_buffer is not None and self.pool.taken >= self.cap and (
                not self.pool.fits(need_buffer.numel, self.rdtype[need_buffer], need_buffer.device))
        while full() and self._pending:
            self._complete(*self._pending.popleft())

    def _launch_ready(self) -> None:
        if self.policy.ordered_launch:  # Note [Program order]: at the engine's points only
            return
        while self._next < len(self.order) and self.order[self._next] in self._ready:
            if self.policy.bound_in_flight:
                self._make_room(None)
            self._launch([self.order[self._next]])
            self._next += 1

    def launch(self, bufs: list[FlatBuffer]) -> None:
        """Stage 3, at a point every rank reaches in the same order (Note [Program order]): launch the buckets of
        ``bufs`` not launched yet, in that order, whether or not their gradient is complete here; consecutive ones
        as one collective (Note [One reduce-scatter per launch] in gloo_reduce_scatter.py)."""
        todo = [b for b in bufs if self.sync and b not in self._launched]
        join = self.world_size > 1 and self.comm.grad_path is None and not self.policy.keep_full_grad
        for run in runs(todo, self.rdtype, self.coalesce_bytes if join else 0):
            self._make_room(None)
            self._launch(run)

    def _launch_sharded(self, run: list[FlatBuffer]) -> None:
        """Stages 2-3: reduce-scatter the gradients of ``run`` as one collective into their pooled buffers."""
        for buf in run:
            self._launched.add(buf)
            if buf.grad is None:  # no parameter of the bucket got a gradient this micro-step
                buf.grad = self.pool.take(buf.numel, self.rdtype[buf], buf.device)
                buf.grad.zero_()
            else:  # zero the padding and the parameters that got no gradient
                buf.zero_all_but(buf.grad, self._written.pop(buf, set()))
            if self.rdtype[buf] == torch.float16:  # fp16 divides first (Note [Gradient buffer pool])
                buf.grad.div_(self.world_size)
        work = (self.comm.reduce_scatter(run[0].shard(run[0].grad), run[0].grad) if len(run) == 1 else
                self.comm.reduce_scatter_coalesced([b.shard(b.grad) for b in run], [b.grad for b in run]))
        self._pending.extend((buf, work, None) for buf in run)

    def _launch(self, run: list[FlatBuffer]) -> None:
        if not self.policy.keep_full_grad:
            return self._launch_sharded(run)
        buf = run[0]  # stages 0-1 join no buckets (``launch``): a run of one
        self._launched.add(buf)
        n = self.world_size
        for p in buf.params:  # autograd never writes into a bucket a collective reads (Note [Per-parameter ...])
            p.grad = None
        src = buf.grad
        if buf.acc is not None:
            buf.acc.add_(buf.grad)
            src = buf.acc
        grad = src if src.dtype == self.rdtype[buf] else src.to(self.rdtype[buf])
        grad.div_(n)
        if self.policy.all_reduce:
            self._result[buf] = grad
            self._pending.append((buf, self.comm.all_reduce(grad), None))
        else:
            out = buf.shard(grad) if grad is src else torch.empty(buf.shard_numel, dtype=grad.dtype,
                                                                  device=buf.device)
            self._result[buf] = out
            self._pending.append((buf, self.comm.reduce_scatter(out, grad), grad))

    def _complete(self, buf: FlatBuffer, work: Any, keepalive: Any) -> None:
        self.comm.wait([work])
        if not self.policy.keep_full_grad:
            predivided = self.rdtype[buf] == torch.float16
            buf.shard_grad.add_(buf.shard(buf.grad), alpha=1.0 if predivided else 1.0 / self.world_size)
            if buf not in self._adopted:
                self.pool.give_back(buf.grad)
            self._adopted.discard(buf)
            buf.grad = None

    def finish(self) -> None:
        """After a backward: launch what is left (unused parameters: zeros), wait for every reduction, reduce
        late gradients again, learn readiness and (first step) the launch order."""
        if not self.sync:
            for buf in self.buffers:  # micro-steps summed in zero.grad_accum_dtype
                if buf.acc is not None:
                    buf.acc.add_(buf.grad)
                    buf.grad.zero_()
            return
        unused = [b for b in self.order if b not in self._ready]
        for buf in unused:
            self._bucket_ready(buf)
        self._launch_ready()
        if self.policy.ordered_launch:
            self.launch(self.order)
        while self._pending:
            self._complete(*self._pending.popleft())
        if self.last:  # Note [Per-parameter readiness]: once per optimizer step
            self._fix_late()
        self._expected = dict(self._count)
        if not self._recorded:  # Note [Launch order]: rank 0's ready order, its unused buckets first
            self._recorded = True
            self.order = launch_order(self.comm, self.buffers, unused + [b for b in self._ready_seq if b not in unused])
        if self.policy.keep_full_grad and self.policy.reduced_grad_visible:
            for buf in self.buffers:
                result = self._result.get(buf)
                if result is not None and result.data_ptr() != buf.grad.data_ptr():
                    buf.grad.copy_(result)
                for p in buf.params:
                    p.grad = buf.view_of(buf.grad, p)

    def _fix_late(self) -> None:
        """Note [Per-parameter readiness]: the ranks agree on the buckets that got gradients after their launch;
        each is reduced again and added. Note [Unused parameters]: the same agreement carries this rank's
        used-parameter mask; :attr:`used` becomes the parameters that got a gradient on some rank."""
        params = list(self._slot)
        used, late = agree_at_step_end(self.comm, [p in self._used for p in params],
                                       [b in self._late for b in self.buffers], self.dropped, self.rider)
        self.used = {p for p, u in zip(params, used) if u}
        for buf in (b for b, x in zip(self.buffers, late) if x):
            self.late_fixups += 1
            delta = self._late.pop(buf, None)
            delta = (torch.zeros(buf.numel, dtype=self.rdtype[buf], device=buf.device) if delta is None
                     else delta.to(self.rdtype[buf]))
            delta.div_(self.world_size)
            if self.policy.all_reduce:
                self.comm.wait([self.comm.all_reduce(delta)])
                self._result[buf].add_(delta)
                continue
            out = buf.shard(delta)
            self.comm.wait([self.comm.reduce_scatter(out, delta)])
            (self._result[buf] if self.policy.keep_full_grad else buf.shard_grad).add_(out)
        self._late.clear()

    def discard(self) -> None:
        """Drop every gradient since the last step (``engine.zero_grad``: Note [A backward that raised] in
        user_model.py): the reductions in flight, issued alike on every rank, are waited for first."""
        while self._pending:
            self._complete(*self._pending.popleft())
        for buf in self.buffers if not self.policy.keep_full_grad else ():
            if buf.grad is not None and buf not in self._adopted:  # a bucket filling when the backward raised
                self.pool.give_back(buf.grad)
            buf.grad = None
            for p in buf.params:
                p.grad = None
        self._adopted.clear()
        self._late.clear()
        self.zero_grads()
        self.running, self.spoiled, self.dropped = False, None, 1

    def zero_grads(self) -> None:
        """After the optimizer step (or a skipped one): zero the kept gradients; ``p.grad`` views again."""
        self.pool.clear()
        self.dropped = 0
        self._used, self.used = set(), None  # Note [Unused parameters]: learnt again in the next step
        for buf in self.buffers:
            if self.policy.keep_full_grad:
                buf.grad.zero_()
                if buf.acc is not None:
                    buf.acc.zero_()
                for p in buf.params:
                    p.grad = buf.view_of(buf.grad, p)
            else:
                buf.shard_grad.zero_()
        self._result.clear()
