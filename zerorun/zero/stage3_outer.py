"""Stage 3: the parts of the model outside the listed units, gathered on a schedule learned in the first step.

Note [Outer units]: the modules outside every listed unit (a GPT's embeddings, final norm and LM head; found
by ``unit_plan.outer_modules``) would otherwise be the root unit's, whole on every rank from the start of the
forward to its end and through the whole backward, at the step's peak (ZeRO paper §5.3: only the parameters in
use are whole; what they cost the 55M GPT: benchmarks/results/history.md, issue 38). Each is a unit of its own,
an outer unit. It cannot simply be gathered when it runs, as the listed units are: an outer module may run on
some ranks only (an expert on the root that no token reached on one rank), and an all-gather issued by some
ranks alone hangs. Its all-gathers are therefore tied to points every rank reaches together: the start of the
root's forward, the first listed unit's forward call, the start of backward and the first backward entry of
the unit that made that first call (every rank runs the same listed units: Note [Same units on every rank]).
Counting calls instead would break models whose depth changes between steps (LayerDrop, early exit); "the
first call" does not.

- Every outer unit is gathered with the root: at the start of the forward and again at the start of backward
  (unless kept between the two: Note [Kept from forward to backward]), and in backward freed as soon as its own
  gradient buckets are complete (the LM head early in backward).
- An outer unit that, in the first step, ran only before the first listed unit's call, on every rank, and
  whose parameters nothing else read (a GPT's token and position embeddings) is also freed when that first
  call begins, and in backward gathered only when the first call's unit begins its backward (or at the start
  of backward if, in the first step, its output's gradient came earlier). The first step records this (the
  outer units are gathered with the root meanwhile); the agreement at the end of its last backward compares
  the records across ranks (``[x, x*x]`` per value, with the gather digest: ``stage3_checks.GatherDigest``), and only a
  unit every rank agrees on is scheduled so.
- A scheduled unit that later runs after the first call, whose output's gradient arrives before its
  all-gather, or whose parameters other code reads, raises on that rank (never a read of the freed
  placeholder), naming ``zerorun.zero.register_external_parameter(model, param)``, which keeps it with the root.
- A tail: an outer unit that is not scheduled and, in the first step, on every rank, got every gradient of
  its outputs before any listed unit's backward began, its parameters read by nothing else (a GPT's final
  norm and LM head). In forward it stays with the root. In a backward where its outputs reach the loss on
  every rank (found with the listed units' check before backward, Note [Backward on some ranks], in the same
  agreement), it is not gathered at the start but when the first gradient of a tail's output arrives, or
  when the first listed unit's backward begins if that comes first: every tail then, in the units' order,
  before that unit's own all-gather, so the all-gathers are in the same order on every rank whichever of the
  two came first. Where its outputs reach the loss on some ranks only, it is gathered with the root. So the
  LM head is not held through the loss's backward, the step's peak (a log-softmax over the vocabulary).
  Autograd may read a tail's parameters before its outputs' gradient comes, through tensors it saved in
  forward on another path (a weight penalty on the head, in the root or inside the head's own forward; an
  auxiliary loss through ``head.weight.detach()``): while the root's forward runs, ``saved_tensors_hooks``
  mark every saved tensor on a tail's storage, and unpacking one in backward gathers the tails first. Such a
  read comes, on every rank alike, before any listed unit's backward (or after the tails' gather), so the
  all-gather order stays the same. A tail whose parameters user code reads with autograd recording in
  backward before its gather raises as a scheduled unit does. The first step's record is a third value per
  outer unit in the same agreement.
- A read of an outer unit's parameters outside its own forward that autograd does not record (``detach()``,
  ``.data``, under ``no_grad``) returns an alias that a later op may save (``F.linear(x, head.weight.detach())``
  in a block): its backward reads it, and no gradient of the unit waits for it. Such a unit is kept gathered to
  the end of that backward and, a tail, not deferred (``read_unrecorded``, reported unreached in the agreement
  before backward), else the alias would read freed memory.

Evaluation (a forward with gradients off) gathers the scheduled units with the root.

Note [Kept from forward to backward]: when the root and every outer unit together hold at most
``zero.keep_root_bytes`` when gathered (1 MiB by default: a GPT of a few layers, a model of small modules), none of
the above applies to them: they are all-gathered once per micro-step, with the root at the start of the forward,
and stay gathered past its end into its backward, as FSDP2 leaves its root module unsharded after forward; in
backward each outer unit is freed once its gradient buckets are complete, the root at the end. Freeing a megabyte
early would save nothing measurable, and gathering it again costs a round trip; with no tail deferred there are no
saved-tensor hooks over the forward, the larger part of stage 3's Python on a model of many small ops
(benchmarks/results/history.md, issue 38). The first step learns as above; a unit it schedules is gathered with the
root's all-gather and not freed at the first listed call. Every rank decides alike (the bytes are the same
everywhere), and the same from the first step (``zerorun estimate`` counts them once:
``estimate.hierarchy.kept_units``). Between the forward and its backward they are guarded as at rest: user code
reading or writing them there, outside a forward, is refused as where they are freed (a write would be lost),
until the backward or a new forward begins; ``gathered_parameters`` and ``full_state_dict`` there free them
first (a read-only block would otherwise leave them unguarded). The units their forward reads (a root penalty on a block's weight: Note [External
parameters]) are freed at the forward's end and gathered again when backward begins, as with the root. The
optimizer step, a forward with gradients off and a checkpoint's load free them too. Larger ones (an LM head of
``V x d``) follow the schedule above.
With them, the listed unit that ends the forward stays gathered too, where its bytes fit in ``zero.keep_root_bytes``
with theirs: it is the first unit of backward, gathered again at once otherwise, with no prefetch to hide it (the
root's backward issues none: Note [Prefetch] in stage3.py); torchtitan leaves its last block unsharded after
forward for the same reason, and DeepSpeed's ``stage3_max_reuse_distance`` keeps a parameter used again that soon.
It is the last unit of the recorded forward order (``Schedule.keeps_last``), not freed at the end of its own call
and kept when the forward ends with it; ``zerorun estimate`` takes the model's last listed unit. The model of many
small ops in one unit (``benchmarks/stage3_small_ops.py``) then adds one all-gather per step over stage 2, not two.
Whether it was kept is agreed before backward (``check_backward_units``): a rank whose forward ended elsewhere
(a recorded order that differs) would otherwise all-gather it alone; then every rank frees it and gathers it again.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import torch

from zerorun.zero.stage3_checks import check_no_writes
from zerorun.zero.torch_internals import in_backward
from zerorun.zero.unit_plan import kept_bytes
from zerorun.zero.units import Unit, UnitState


@dataclasses.dataclass
class OuterRecord:
    """What the first step learns of one outer unit and what every rank agreed on it (Note [Outer units])."""

    first: int | None = None  # it ran after the first listed unit's call (1) or only before it (0)
    bfirst: int | None = None  # its output's gradient came after that unit's backward began (1) or before (0)
    btail: int | None = None  # every gradient of its outputs came before any listed unit's backward began (1)
    used_outside: bool = False  # its parameters were read outside its own forward
    declared: bool = False  # register_external_parameter(model, one of its parameters): stays with the root
    scheduled: bool = False  # every rank agreed: gathered at the schedule's points, not with the root
    tail: bool = False  # every rank agreed it is a tail: in backward, gathered at its own outputs' gradient


#: A tensor autograd saved for backward that is a view of a tail's parameters (Note [Outer units]).
_TailSaved = collections.namedtuple("_TailSaved", "unit tensor")


def _fold(old: int | None, new: int, pick) -> int:
    """``new`` folded into what earlier passes of the first step recorded (``pick``: ``min`` or ``max``)."""
    return new if old is None else pick(old, new)


class OuterSchedule:
    """The outer units' schedule (Note [Outer units]): what the first step learns of them, and the points every
    rank reaches at which they are gathered and freed. Owned by the engine's
    :class:`~zerorun.zero.stage3_schedule.Schedule` (``sched``), which calls into it from its hooks."""

    def __init__(self, sched) -> None:
        self.sched = sched
        self.outers = [u for u in sched.units if u.outer]
        self.rec = {u: OuterRecord() for u in self.outers}
        self.learning = bool(self.outers)
        self.running = False  # a forward of the root with gradients on is running
        self.first_call: Unit | None = None  # the unit of this pass's first listed-unit call
        self.anchor_entered = False  # that unit's backward has begun
        self.listed_begun = False  # a listed unit's backward has begun in this backward
        self.saved_hooks = None  # saved_tensors_hooks over the root's forward when there are tails
        # outer units read outside their own forward without autograd recording since the last backward (detach,
        # .data, no_grad): what the read returned may be saved by a later op, whose backward reads it, no gradient
        # of the unit waiting for it: kept gathered to the end of backward, and not deferred (a tail)
        self.read_unrecorded: set[Unit] = set()
        self.tail_storages: dict[int, Unit] = {}
        # Note [Kept from forward to backward]: the root and every outer unit fit in zero.keep_root_bytes together
        cap, self.kept_nbytes = sched.config.keep_root_bytes, kept_bytes(sched.units)
        self.small = 0 < cap and self.kept_nbytes <= cap

    def hook(self) -> None:
        """Gather the outer units with the root until the first step has learned their schedule, and hook their
        modules' forward."""
        for unit in self.outers:
            if unit not in self.sched.root.external:  # Note [External parameters]: gathered with the root
                self.sched.root.external.append(unit)
            pre, post = functools.partial(self.pre_forward, unit), functools.partial(self.post_forward, unit)
            self.sched.handles += [unit.module.register_forward_pre_hook(pre), unit.module.register_forward_hook(post)]

    def scheduled_units(self) -> list[Unit]:
        return [u for u in self.outers if self.rec[u].scheduled]

    def tails(self) -> list[Unit]:
        """The tails deferred in backward where their outputs reach the loss on every rank: none where the root
        and the outer units are small enough to be kept (Note [Kept from forward to backward])."""
        return [] if self.small else [u for u in self.outers if self.rec[u].tail]

    def kept(self) -> list[Unit]:
        """Note [Kept from forward to backward]: the units a forward with gradients on leaves gathered at its end:
        the root and every outer unit when they are :attr:`small`; else none."""
        return [self.sched.root] + self.outers if self.small else []

    def declare(self, unit: Unit) -> None:
        """A parameter of ``unit`` was declared external to the root: it stays with the root."""
        self.rec[unit].declared, self.rec[unit].scheduled = True, False

    # ------------------------------------------------------------------------------------------- forward
    def pass_start(self) -> None:
        """The root's forward begins (not a recomputation); the root is gathered."""
        self.running = torch.is_grad_enabled()
        self.first_call = None
        for unit in self.scheduled_units():
            unit.unshard(wait=False)
        tails = self.tails()
        if self.running and tails:  # a tail's parameters saved for backward by any node: gathered before read
            self.tail_storages = {b.data.untyped_storage()._cdata: u for u in tails for b in u.buffers}
            self.saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._tail_pack, self._tail_unpack)
            self.saved_hooks.__enter__()

    def _tail_pack(self, t: torch.Tensor):
        unit = self.tail_storages.get(t.untyped_storage()._cdata)
        return t if unit is None else _TailSaved(unit, t)

    def _tail_unpack(self, saved):
        if not isinstance(saved, _TailSaved):
            return saved
        if self.sched.in_foreign():  # Note [Backward outside engine.backward]: every outer unit gathered at its start
            return saved.tensor
        if saved.unit.deferred:  # read by a node before the tails' gather (a penalty on the head's weight)
            self.gather_tails()
        if saved.unit.state is UnitState.GATHERING:
            saved.unit.unshard()
        return saved.tensor

    def pass_end(self) -> None:
        """The root's forward ends, or raised: the saved-tensor hooks over it go."""
        self.running = False
        if self.saved_hooks is not None:
            self.saved_hooks.__exit__(None, None, None)
            self.saved_hooks = None

    def listed_call(self, unit: Unit) -> None:
        """A listed unit's forward call begins (before its all-gather is issued)."""
        if not self.running or self.first_call is not None:
            return
        self.first_call = unit
        for outer in self.scheduled_units() if not self.small else ():  # Note [Kept from forward to backward]
            if outer.active == 0:
                outer.reshard()

    def pre_forward(self, unit: Unit, module, args) -> None:
        rec = self.rec[unit]
        if in_backward() or not self.running:
            if self.learning and in_backward():
                rec.used_outside = True  # recomputed in backward: no window to learn
            return
        if self.learning:  # every forward of the first step counts
            rec.first = _fold(rec.first, int(self.first_call is not None), max)
        elif rec.scheduled:
            if unit.state is UnitState.FREE:
                raise self.deviation(unit, "ran after the first listed unit's forward call")
            unit.unshard()
        self.sched.enter(unit)

    def post_forward(self, unit: Unit, module, args, output):
        if in_backward() or not self.running:
            return output
        rec = self.rec[unit]
        self.sched.leave(unit)
        if self.learning and self.first_call is not None:
            rec.first = 1  # a listed unit called from inside it: it runs past the first call
        check_no_writes(unit)  # Note [Writes inside a unit's forward]
        storages = {b.data.untyped_storage().data_ptr() for b in unit.buffers}
        for t in self.sched.watch(unit, output, functools.partial(self.pre_backward, unit)):
            if t.untyped_storage().data_ptr() in storages:  # a view of its parameters: read after it is freed
                if self.learning:
                    rec.used_outside = True
                elif rec.scheduled:
                    raise self.deviation(unit, "returned a view of its parameters")
        return output

    # ------------------------------------------------------------------------------------------ backward
    def backward_start(self) -> None:
        """Backward begins; the root (and with it every outer unit not scheduled) is gathered."""
        self.anchor_entered = False
        self.listed_begun = False
        for unit in self.scheduled_units():
            if self.rec[unit].bfirst == 0 or self.first_call is None:
                unit.unshard(wait=False)

    def listed_backward(self, unit: Unit) -> None:
        """A listed unit's backward begins."""
        if unit is not self.first_call or self.anchor_entered:
            return
        self.anchor_entered = True
        for outer in self.scheduled_units():
            if self.rec[outer].bfirst == 1:
                outer.unshard(wait=False)

    def before_listed_backward(self) -> None:
        """A listed unit's backward is about to begin (before its all-gather): the first time in this backward,
        the deferred tails not gathered yet are, so their all-gather precedes every listed unit's on every rank."""
        if not self.listed_begun:
            self.listed_begun = True
            self.gather_tails()

    def gather_tails(self) -> None:
        """The deferred tails' all-gathers, once per backward, in the units' order (the same on every rank)."""
        for outer in self.outers:
            if outer.deferred:
                outer.deferred = False
                outer.unshard(wait=False)

    def pre_backward(self, unit: Unit, grad: torch.Tensor | None = None) -> None:
        if self.sched.in_foreign():  # Note [Backward outside engine.backward]: gathered at its start, learns nothing
            unit.unshard()
            return
        rec = self.rec[unit]
        if self.learning:  # every backward of the first step counts: before the anchor once is before
            rec.bfirst = _fold(rec.bfirst, int(self.anchor_entered), min)
            rec.btail = _fold(rec.btail, int(not self.listed_begun), min)
            return
        if rec.tail:  # deferred: its outputs' first gradient, unless a listed unit's backward began first
            self.gather_tails()
            if unit.state is UnitState.GATHERING:
                unit.unshard()
        elif rec.scheduled:
            if unit.state is UnitState.FREE:
                raise self.deviation(unit, "took a gradient before the first listed unit's backward began")
            unit.unshard()

    def free_if_done(self, unit: Unit) -> None:
        """In backward, ``unit``'s gradient buckets are complete: it is freed, even while the root, gathered
        with it at the start of backward, is not; unless a parameter of it that was unused last time (so
        complete at once: Note [Per-parameter readiness]) still gets its gradient in this backward (an expert
        that runs in this micro-step only), whose computation may need the weights: then at the end."""
        if unit in self.read_unrecorded or any(self.sched.reducer.accumulates_later(p) for buf in unit.trainable
                                                for p in buf.params):
            return
        unit.pinned_by.discard(self.sched.root)
        unit.reshard()

    # ------------------------------------------------------------------------------------- parameter use
    def use(self, unit: Unit, func) -> bool:
        """A parameter of the outer unit ``unit`` is about to be read by ``func`` (Note [Parameters at rest]):
        ``True`` when it may be, ``False`` to go on as for any unit."""
        holder = self.sched.active[-1] if self.sched.active else None
        # an evaluation's forward decides nothing; a read that autograd records is a use (it decides the schedule);
        # one it does not track, detach(), p.data (the guard's only "__get__") or any read under no_grad, returns an
        # alias a later op may save: kept to the end of backward (Note [Outer units])
        name = getattr(func, "__name__", "")
        recorded = torch.is_grad_enabled() and name != "detach"
        outside = holder is not unit and (self.running or in_backward())
        if outside and (not recorded or name == "__get__"):
            self.read_unrecorded.add(unit)  # F.linear(x, head.weight.detach()) inside a block saves the alias
        if outside and recorded:
            if self.learning:
                self.rec[unit].used_outside = True
            elif self.rec[unit].scheduled or unit.deferred and unit.state is UnitState.FREE:
                raise self.deviation(unit, f"had a parameter read outside its own forward (by "
                                           f"{getattr(func, '__name__', func)})")
        if unit.state is UnitState.GATHERING:
            unit.unshard()
        return unit.state is UnitState.GATHERED

    def codes(self) -> list[int]:
        """This rank's record, three values per outer unit, for the first step's agreement: 1 when it ran only
        before the first listed call (else 0: not to be scheduled); then whether its output's gradient came
        after that call's unit began its backward (2) or before (1); then 1 when it may be a tail."""
        out: list[int] = []
        for rec in map(self.rec.get, self.outers):
            own = not rec.used_outside and not rec.declared
            ok = own and rec.first == 0
            out += [int(ok), rec.bfirst + 1 if ok and rec.bfirst is not None else 0, int(own and rec.btail == 1)]
        return out

    def agree(self, same: list[bool], sums: list[int]) -> None:
        """After the first step's agreement on :meth:`codes` (``same``: each value is the same on every rank;
        ``sums``: its sum over the ranks): schedule the outer units every rank recorded alike."""
        for i, unit in enumerate(self.outers):
            rec = self.rec[unit]
            if same[3 * i] and same[3 * i + 1] and sums[3 * i] > 0:
                rec.scheduled = True
                rec.bfirst = rec.bfirst if sums[3 * i + 1] > 0 else 0  # no gradient seen: at the start
                self.sched.root.external.remove(unit)
                unit.pinned_by.discard(self.sched.root)
            else:  # stays with the root: its record was this rank's alone
                rec.first = rec.bfirst = None
                rec.tail = same[3 * i + 2] and sums[3 * i + 2] > 0  # a tail: in backward, gathered at its gradient
        self.learning = False

    def deviation(self, unit: Unit, what: str) -> RuntimeError:
        return RuntimeError(
            f"stage 3: module {unit.name!r} (outside the units of zero.units) {what}, unlike in the first step; "
            "its all-gathers are scheduled from the first step on every rank (Note [Outer units]), so it cannot "
            "be gathered here on this rank alone. Keep its parameters with the root unit: "
            "zerorun.zero.register_external_parameter(model, param) for each, before the first step")
