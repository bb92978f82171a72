"""Stage 3's schedule: when each unit is gathered and freed (Notes [Unit lifecycle] and [Prefetch] in
``stage3.py``): the units' recorded order, the forward calls on the stack, and the hooks, which only call in.

Note [Backward outside engine.backward]: ``torch.autograd.grad`` over the model's output (an adversarial example's
input gradient, an input-gradient penalty, inside the model's forward or between it and ``engine.backward``) runs
the units' backward hooks as any backward does, but without ``engine.backward``'s start (the root, the units kept
from forward, the outer units gathered at their scheduled points) and end (every unit freed, the pass's record
reset). The outer units' schedule then found a scheduled unit free at its output's gradient and refused it as a
deviation, naming a gradient that was never taken. So the first unit hook of such a pass (``begin_foreign``) gathers
the root and every outer unit, as at the start of a backward before any schedule is learned, and queues the pass's
end on autograd's engine (``end_foreign``: every unit not needed by a running forward freed, the pass's record
dropped; the outer units' first-step record learns nothing from it). Every rank must run the same call, so that the
all-gathers pair up (one run on rank 0 alone, a saliency map for logging, waits for the others until the collective
timeout, as a unit run on some ranks only: Note [Same units on every rank] in stage3_checks.py); a pass that will
accumulate into a parameter (``loss.backward()``, ``torch.autograd.backward(..., inputs=[param])``) raises before
any all-gather (Note [One backward per micro-step] in user_model.py). Parameters may be the inputs of
``torch.autograd.grad`` (a gradient-norm penalty): the guard of Note [Parameters at rest] in stage3_access.py lets
autograd's own functions pass, since only the graph reads the values, and its hooks gather them. With
``create_graph=True`` the pass builds a graph whose nodes hold views of the units' gathered parameters (``W.t()``
for a linear layer's input gradient) and run in a later backward, with no hook of their unit before them: a freed
unit read there was torch's "storage of size 0" error. So every unit such a pass gathers stays gathered (pinned by
``second_order``) until the end of the next ``engine.backward`` or the optimizer step: the memory of stage 2 for
those units over that window, and the numbers of stage 0. A pass that raises midway never reaches its end: the next
forward or ``engine.backward`` ends it first. A pass run before that (the same ``torch.autograd.grad`` again, inside
the forward or after it) finds it begun: if it records a graph, it pins the root and the outer units the raising
pass gathered at its start, as its own start would have (else the end would free them under its graph).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zerorun.zero.recompute import checkpointed
from zerorun.zero.stage3_checks import check_no_writes
from zerorun.zero.stage3_outer import OuterSchedule
from zerorun.zero.torch_internals import in_backward, will_accumulate
from zerorun.zero.unit_plan import last_listed
from zerorun.zero.trees import tensors_in
from zerorun.zero.units import Unit, UnitInputsDone, UnitState, units_ahead
from zerorun.zero.user_model import backward_outside_engine


class Schedule:
    """The order in which ``units`` (the engine's, indexed, the root among them) are gathered and freed.

    Attributes:
        root: the root unit (the model itself).
        active: the units whose forward is on the stack, innermost last.
        outer: the outer units' schedule (Note [Outer units] in stage3_outer.py).
    """

    def __init__(self, units: list[Unit], config, reducer) -> None:
        self.units, self.config, self.reducer = units, config, reducer
        self.root = next(u for u in units if u.is_root)
        self.order: dict[str, list[Unit]] = {"forward": [], "backward": []}  # Note [Prefetch]: as recorded
        self.seen: dict[str, list[Unit]] = {"forward": [], "backward": []}  # in this pass so far
        self.deviated = {"forward": False, "backward": False}  # this pass left the recorded order
        self.active: list[Unit] = []
        self.handles: list = []
        self.foreign = False  # a backward not engine.backward's runs (reducer.running: one that is; Note [Backward
        self.second_order = object()  # outside engine.backward]), and the pin of the units its graph reads
        self.outer = OuterSchedule(self)
        self.last_listed = last_listed(units)  # the first step's guess of the forward's last unit

    def hook(self, checkpointing: bool) -> None:
        """Register the forward hooks of every listed unit and the root (outer units: :class:`OuterSchedule`);
        with ``checkpointing``, a listed unit's forward is recomputed in backward (``recompute.checkpointed``)."""
        for unit in self.units:
            if unit.persistent or unit.outer:
                continue
            self.handles.append(unit.module.register_forward_pre_hook(functools.partial(self.pre_forward, unit),
                                                                      with_kwargs=True))
            self.handles.append(unit.module.register_forward_hook(functools.partial(self.post_forward, unit)))
            if checkpointing and not unit.is_root:
                unit.module.forward = checkpointed(unit.module.forward, unit.module)
        self.outer.hook()

    # ------------------------------------------------------------------------------------------ prefetch
    def note_and_prefetch(self, unit: Unit, phase: str) -> None:
        """``unit`` starts in ``phase``: record it, and when this pass follows the recorded order so far,
        issue the all-gathers of the units ahead (Note [Prefetch])."""
        seen = self.seen[phase]
        # a unit pinned by another (or by a gathered_parameters block), or called again inside its own forward, is
        # gathered already on every rank that runs this: not in the order (Note [Units gathered together]); nor is
        # a unit's second backward in a pass (Note [Prefetch]: whether it comes may differ by rank)
        if (seen and seen[-1] is unit) or unit.pinned_by or unit.active > (phase == "forward") or (
                phase == "backward" and unit in seen):
            return
        seen.append(unit)
        order = self.order[phase]
        i = len(seen) - 1
        if i >= len(order) or order[i] is not unit:  # a pass that deviated prefetches no more (it may come back
            self.deviated[phase] = True  # to the recorded order on one rank and not on another)
        if not self.config.prefetch or self.deviated[phase]:
            return
        if phase == "backward" and unit.is_root:  # Note [Prefetch]: not across the loss's backward
            return
        for ahead in units_ahead(order, i, self.config.prefetch_bytes):  # ZeroConfig.prefetch_bytes
            ahead.unshard(wait=False)

    def end_pass(self, phase: str) -> None:
        if self.seen[phase] and self.seen[phase] != self.order[phase]:
            self.order[phase] = self.seen[phase]
        self.seen[phase] = []
        self.deviated[phase] = False

    def free_all(self, keep: Iterable[Unit] = ()) -> None:
        """Free every unit but those in ``keep`` (Note [Kept from forward to backward] in stage3_outer.py):
        pins of units go; a ``gathered_parameters`` block keeps its own."""
        keep = set(keep)
        self.free([u for u in self.units if u not in keep])
        for unit in self.units:
            if unit in keep and unit.state is UnitState.GATHERED:
                unit.hold()

    def free_held(self) -> None:
        """Free the units kept from a forward (Note [Kept from forward to backward] in stage3_outer.py), before an
        engine call that gathers between a forward and its backward: they are at rest again, the backward gathers
        them as it would have without the hold."""
        self.free([u for u in self.units if u.held])

    @staticmethod
    def free(units: list[Unit]) -> None:
        """Free ``units``: their pins by units go first (a ``gathered_parameters`` block keeps its own)."""
        for unit in units:
            unit.pinned_by = {h for h in unit.pinned_by if not isinstance(h, Unit)}
        for unit in units:
            unit.reshard()

    def end_hold(self) -> None:
        """The units kept from a forward (Note [Kept from forward to backward] in stage3_outer.py) are ordinary
        gathered units again: their backward, a new forward or an engine call that gathers begins."""
        for unit in self.units:
            if unit.held:
                unit.end_hold()

    # ------------------------------------------------------------------------------------------- forward
    def pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: dict) -> Any:
        if unit.is_root and not in_backward():  # a new forward: whatever an interrupted one left on the stack goes
            self.end_stale_foreign()
            self.clear_forward()
            self.end_hold()
            unit.ctx.training = torch.is_grad_enabled()  # Gathering.training, before the root's own gather
        elif not in_backward():
            self.outer.listed_call(unit)
        with unit.ctx.together():  # Note [Units gathered together] in units.py
            unit.unshard(wait=False)  # waited for below, after the all-gathers of the units ahead are issued
            if in_backward():
                unit.unshard()
                return None
            if unit.is_root:
                self.outer.pass_start()
                for u in self.units:  # a forward without backward (evaluation with grad on) keeps no graph alive
                    u.out_nodes, u.in_nodes = [], []
            self.enter(unit)
            if torch.is_grad_enabled():
                self.note_and_prefetch(unit, "forward")
        unit.unshard()
        if not torch.is_grad_enabled() or unit.is_root:  # the end of backward ends the root's backward
            return None
        # Note [End of a unit's backward]
        flat, spec = tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            unit.open_ended = True
            return None
        unit.open_calls += 1
        out = UnitInputsDone.apply(functools.partial(self.unit_backward_done, unit), *(flat[i] for i in at))
        unit.in_nodes.append(out[0].grad_fn)  # Note [Program order] in reducer.py
        for i, t in zip(at, out):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():  # recomputation under activation checkpointing: the unit is still needed
            return output
        self.leave(unit)
        self.watch(unit, output, functools.partial(self.pre_backward, unit))
        check_no_writes(unit)
        if unit.is_root:
            for u in self.units:  # Note [Writes inside a unit's forward]: the root's forward may write any of them
                if u is not unit and u.state is UnitState.GATHERED:
                    check_no_writes(u, own=False)
            keep = self.kept() if torch.is_grad_enabled() else []
            if torch.is_grad_enabled():
                self.end_pass("forward")
            self.outer.pass_end()
            self.free_all(keep=keep)
        elif not self.keeps_last(unit):
            unit.reshard()
        return output

    def keeps_last(self, unit: Unit) -> bool:
        """Whether ``unit``, at the end of its forward call, is the last unit of the recorded forward order (before
        one is recorded: the model's last listed unit) and fits in ``zero.keep_root_bytes`` with the root and the
        outer units: then it stays gathered into backward, whose first unit it is (Note [Kept from forward to
        backward] in stage3_outer.py)."""
        order = self.order["forward"]
        return (torch.is_grad_enabled() and self.outer.small and unit is (order[-1] if order else self.last_listed)
                and self.outer.kept_nbytes + unit.gathered_bytes <= self.config.keep_root_bytes)

    def kept(self) -> list[Unit]:
        """The units a forward with gradients on leaves gathered at its end (Note [Kept from forward to backward] in
        stage3_outer.py): the root and every outer unit when they are small, and the unit :meth:`keeps_last` kept
        if this forward's last unit is it."""
        keep = self.outer.kept()
        last = self.seen["forward"][-1] if self.seen["forward"] else None
        if last is not None and not last.is_root and last.state is not UnitState.FREE and self.keeps_last(last):
            keep.append(last)
        return keep

    def enter(self, unit: Unit) -> None:
        """``unit``'s forward call begins: it is on the stack."""
        unit.active += 1
        self.active.append(unit)

    def leave(self, unit: Unit) -> None:
        """``unit``'s forward call ends."""
        unit.active -= 1
        if self.active and self.active[-1] is unit:
            self.active.pop()

    def watch(self, unit: Unit, output: Any, hook) -> list[torch.Tensor]:
        """With gradients on, ``hook(grad)`` runs when a gradient of a tensor of ``output`` (any structure:
        dataclasses, objects with a ``.loss``, nested containers) comes, and their autograd nodes are recorded
        (Note [Backward on some ranks] in stage3_checks.py). Returns those tensors."""
        tensors = tensors_in(output)
        for t in tensors if torch.is_grad_enabled() else ():
            if t.requires_grad:
                t.register_hook(hook)
                if t.grad_fn is not None:
                    unit.out_nodes.append(t.grad_fn)
        return tensors

    def clear_forward(self) -> None:
        """No forward is running any more: the root's forward raised, or a new one begins after one that did
        (units it left gathered are freed at the step, or by the next forward)."""
        for u in self.active:
            u.active = 0
            u.ctx.training = False
        self.active = []
        self.outer.pass_end()

    # ------------------------------------------------------------------------------------------ backward
    def pre_backward(self, unit: Unit, grad: torch.Tensor | None) -> None:
        foreign = self.in_foreign()  # Note [Backward outside engine.backward]
        if not unit.is_root and not foreign:  # outside the units gathered together: when the tails are gathered
            self.outer.before_listed_backward()  # differs by rank (Note [Outer units]: their all-gather first)
        with unit.ctx.together():  # Note [Units gathered together] in units.py
            unit.unshard(wait=False)  # waited for once the all-gathers of the units ahead are issued too
            self.note_and_prefetch(unit, "backward")
        unit.unshard()
        if foreign:
            self.pin_second_order([unit])
        elif not unit.is_root:
            self.outer.listed_backward(unit)

    def in_foreign(self) -> bool:
        """Inside a backward hook: whether this backward is not ``engine.backward``'s; the first hook of such a pass
        begins it (Note [Backward outside engine.backward]). A pass run after one that raised finds it still begun:
        what its start gathered is pinned again when this one records a graph."""
        if not self.reducer.running and not self.foreign and in_backward():
            self.begin_foreign()
        elif self.foreign and not self.reducer.running:
            self.pin_second_order([self.root] + self.outer.outers)
        return self.foreign

    def begin_foreign(self) -> None:
        """A backward outside ``engine.backward`` begins: the root and every outer unit are gathered (the units kept
        from the forward are ordinary gathered units again), and its end is queued. One that will accumulate into a
        parameter raises first (Note [One backward per micro-step] in user_model.py), before any all-gather (run
        on one rank, the all-gathers would wait for the others)."""
        named = [(n, p) for u in self.units for b in u.trainable for n, p in zip(b.names, b.params)]
        try:
            with torch._C.DisableTorchFunctionSubclass():  # only the parameters' autograd edges: no value is read
                stray = next((n for n, p in named if will_accumulate(p)), None)
        except RuntimeError:  # torch refuses to say inside torch.autograd.grad, which accumulates into no leaf
            stray = None
        if stray is not None:
            raise backward_outside_engine(stray)
        self.foreign = True
        held = [u for u in self.units if u.held]
        self.end_hold()
        for unit in held:
            unit.gather_external()
        everything = [self.root] + self.outer.outers
        with self.root.ctx.together():
            for unit in everything:
                unit.unshard(wait=False)
        for unit in everything:
            unit.unshard()
        self.pin_second_order(everything)
        torch.autograd.Variable._execution_engine.queue_callback(self.end_foreign)

    def pin_second_order(self, units: list[Unit]) -> None:
        """In a backward outside ``engine.backward`` that records a graph (``create_graph=True``), ``units`` stay
        gathered until the end of the next ``engine.backward`` or the step (Note [Backward outside engine.backward])."""
        if torch.is_grad_enabled():
            for unit in units:
                unit.pinned_by.add(self.second_order)

    def unpin_second_order(self) -> None:
        for unit in self.units:
            unit.pinned_by.discard(self.second_order)

    def end_foreign(self) -> None:
        """The backward outside ``engine.backward`` is over: its record goes; outside a forward every unit is freed
        (but those pinned by ``second_order``), inside one they are freed when it ends."""
        self.foreign = False
        self.seen["backward"], self.deviated["backward"] = [], False
        for unit in self.units:
            unit.ready_buffers = 0
        if not self.active:
            self.free_all()

    def end_stale_foreign(self) -> None:
        """A backward outside ``engine.backward`` that raised never reached its end (``end_foreign`` is queued on
        autograd's engine, which runs it only when the pass finishes): end it before a new forward or
        ``engine.backward`` begins (Note [Backward outside engine.backward])."""
        if self.foreign and not in_backward():
            self.end_foreign()

    def backward_start(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` begins: the root is gathered first, whatever structure held the loss."""
        self.end_stale_foreign()
        held = [u for u in self.units if u.held]  # Note [Kept from forward to backward] in stage3_outer.py
        self.end_hold()
        for unit in held:  # the units their forward read, freed at its end (a block's weight in a root penalty)
            unit.gather_external()
        if loss.requires_grad and (self.root.state is UnitState.FREE or self.root in held):
            self.pre_backward(self.root, None)
        self.outer.backward_start()

    def on_bucket_ready(self, buf) -> None:
        """The reducer found ``buf``'s gradient complete: once every trainable bucket of its unit is, and the
        unit's backward has begun on this rank (a bucket known unused is complete before backward starts; the
        unit must not be freed and gathered again, on this rank only), the unit is freed (a unit holding frozen
        parameters, whose last use in backward no gradient signals, is freed at the end of backward)."""
        unit = buf.unit
        unit.ready_buffers += 1
        self.free_if_done(unit)

    def free_if_done(self, unit: Unit) -> None:
        # not while a forward call's backward is still to come (a unit called twice whose first call read none of
        # its parameters on one rank: freed there, gathered again there alone, a hang)
        if (unit.ready_buffers == len(unit.trainable) and len(unit.trainable) == len(unit.buffers)
                and in_backward() and (unit in self.seen["backward"] or unit.outer) and unit.open_calls == 0):
            self.outer.free_if_done(unit) if unit.outer else unit.reshard()

    def unit_backward_done(self, unit: Unit) -> None:
        """Note [End of a unit's backward]: called when autograd has the gradients of one forward call's inputs
        of ``unit``. After the last such call of the step, a bucket of the unit whose missing parameters will get
        no gradient in this backward (an expert no token reached on this rank) is complete now, with zeros for
        them, instead of at the end of backward (``GradReducer.force_ready``). A call whose inputs need no gradient
        (the model's input itself) has no such signal, nor has one whose inputs the loss does not reach (a mask token
        passed in and used on some ranks only): its unit is ``open_ended``, on every rank where it is on one
        (agreed before backward: ``check_backward_units``), kept gathered to the end of backward (as FSDP2 reshards
        such a module at its final callback), with the units it reads, and its end not agreed (its buckets reduce
        at the end of backward): freed once its gradient looked complete (a bucket unused in the last step is
        complete from the start), it would be gathered again for the first call's backward on some ranks alone."""
        unit.open_calls -= 1
        if unit.open_calls > 0:
            return
        for buf in unit.trainable:
            self.reducer.force_ready(buf)
        if unit.ends_agreed:  # Note [Program order] in reducer.py: reached on every rank (else at the end)
            self.reducer.launch(unit.trainable)
        self.free_if_done(unit)
        if unit.state is UnitState.FREE:  # its backward is over: the units it read may go (Unit.reshard)
            unit.release_external()

    def backward_end(self) -> None:
        """After the reductions of a backward: the recorded order is kept, every unit freed."""
        self.end_pass("backward")
        self.discard()

    def discard(self) -> None:
        """Every unit freed and the backward's state reset: at its end, or at ``engine.zero_grad`` after a backward
        that raised (its order not recorded: Note [A backward that raised] in user_model.py)."""
        self.unpin_second_order()
        self.foreign = False
        self.seen["backward"], self.deviated["backward"] = [], False
        self.outer.read_unrecorded = set()
        for unit in self.units:
            unit.ready_buffers = unit.open_calls = 0
            unit.ends_agreed = unit.deferred = unit.open_ended = False
        self.free_all()
