"""ZeRO stage 3: parameters partitioned too, gathered unit by unit just in time (ZeRO paper §5.3).

Note [Units]: a unit is a module whose parameters are all-gathered and freed together: every instance of a
class named in ``ZeroConfig.units`` (e.g. the GPT's ``Block``), the outer units (the largest modules outside
those holding parameters: embeddings, final norm, LM head; freed early where every rank agreed to, Note
[Outer units] in ``stage3_outer.py``), plus a root unit (the model itself) for the parameters no unit owns. A
parameter reached from two units (a weight tied across units) belongs to the root.
Each unit holds one flat buffer per optimizer param group (and one for frozen parameters); at rest a rank
keeps only its slice of each (``shard``), and the full flat tensor's storage is freed (``resize_(0)``): the
parameters stay views of it, so autograd's saved references stay valid across free and re-gather.

Note [Unit lifecycle]: forward pre-hook: all-gather (wait for a prefetch if one is in flight); forward
post-hook: register pre-backward hooks on the outputs, then free. Pre-backward (the first gradient reaching an
output): all-gather again. Post-backward: once every trainable parameter of the unit has its gradient (autograd
accumulates a leaf once per backward, after all its uses) and the backward of each of its forward calls has
reached the unit's inputs (a unit called twice, whose first call read none of its parameters on one rank, is
not freed there between the two: it would be gathered again on that rank alone), the unit is freed and its
gradient buckets are reduce-scattered (Note [Launch order] in reducer.py); a unit holding frozen parameters,
which no gradient signals, stays gathered until the end of backward, as does one with a call whose inputs need
no gradient (Note [End of a unit's backward] in stage3_schedule.py). Forward runs inside backward (activation
checkpointing's recomputation) never free. At the end of the root's forward and of backward, whatever is still
gathered (a mispredicted prefetch) is freed.

The parts, each owning its state (docs/how-it-is-built.md, "Correctness"): ``Unit`` (units.py), the choice of
units (unit_plan.py), ``Schedule`` (stage3_schedule.py; ``OuterSchedule`` in stage3_outer.py), ``ParameterGuard``
(stage3_access.py), the checks across ranks (stage3_checks.py); this engine builds them and takes the stage
policy's hooks of :class:`ZeroEngine` (Note [Stage policies] in policy.py).

Note [Persistent parameters]: parameters of at most ``ZeroConfig.persistence_threshold`` elements (norm
weights, biases; DeepSpeed's ``stage3_param_persistence_threshold``) may stay whole on every rank, in a unit of
their own that is never freed: they cost no all-gather in forward or backward, their gradients are
reduce-scattered in buckets like every other, each rank updates its slice of them, and the slices are
all-gathered after the optimizer step, as at stages 1-2. Memory: their whole bytes more per rank (the whole
tensor besides the slice the optimizer updates); traffic: one all-gather of them per step instead of two.
0 (the default) keeps every parameter partitioned.

Note [Prefetch]: the order of the units in forward and in backward (but the calls of a pinned or running unit:
Note [Units gathered together] in units.py) is recorded, and kept until a pass differs. In backward a unit counts
at its first gradient of the pass only: a second (a unit called twice, whose first call read its parameters on some
ranks, is reached twice there and once elsewhere) made one rank alone prefetch it again after its backward, a hang.
When unit i starts (gradients on) in a pass that follows it, unit i+1's all-gather is issued (``prefetch_bytes``:
those after i that fit in that many bytes, ``units.units_ahead``), run while i computes; a deviating pass
prefetches no more. Unit i's own all-gather, where it was not prefetched, is issued first and waited for
after those (the same order on every rank; the host does not stop between them). A wrong guess costs memory
(up to ``prefetch_bytes``) and time, never correctness.
All-gathers and reduce-scatters share one process group, issued in program order (Note [Program order] in
reducer.py).
The root's backward prefetches nothing: it begins with the loss's backward, the step's peak for a language
model (a log-softmax over the vocabulary), where the first block is not needed yet (what it saves:
benchmarks/results/history.md, issue 38).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterable

import torch
import torch.nn as nn

from zerorun.zero.deferred import is_deferred, replay_slices, swap_meta_params
from zerorun.zero.engine import ZeroEngine
from zerorun.zero.flat import FlatBuffer, pack
from zerorun.zero import allocator
from zerorun.zero.hierarchy import SecondaryShards
from zerorun.zero.param_offload import ParamStore
from zerorun.zero.precision import DTYPES
from zerorun.zero.quantize import WeightQuantizer
from zerorun.zero.stage3_access import (ParameterGuard, ZeroParameter, adopt, declared_externals, full_state_dict,
                                        placeholder, state_dict_guard)
from zerorun.zero.stage3_checks import GatherDigest, called_on_some_ranks, check_backward_units, timed_out
from zerorun.zero.stage3_schedule import Schedule
from zerorun.zero.unit_plan import describe_units, match_peers, outer_modules, pick_units, unit_of_params
from zerorun.zero.units import Gathering, Unit


class Stage3Engine(ZeroEngine):
    """:class:`ZeroEngine` at stage 3 (Notes [Units], [Unit lifecycle], [Prefetch], [Outer units]).

    Attributes:
        units: the units, indexed in this order on every rank (listed, outer, root, persistent).
        sched: their :class:`~zerorun.zero.stage3_schedule.Schedule`.
        guard: the :class:`~zerorun.zero.stage3_access.ParameterGuard` of their parameters at rest.
        param_store: this rank's parameter slices on disk (Note [Parameter offload]), or ``None``.
    """

    def __init__(self, model: nn.Module, *, param_groups, config, process_group, **kwargs) -> None:
        self._deferred = is_deferred(model)
        self._replay_group = process_group
        if self._deferred:  # Note [Record and replay] in deferred.py
            self._new_of, self._meta_list, param_groups = swap_meta_params(model, param_groups,
                                                                           DTYPES[config.precision])
        unit_modules = pick_units(model, tuple(config.units))
        outer = outer_modules(model, [m for _, m in unit_modules])  # Note [Outer units]
        self.units = ([Unit(n, m, False) for n, m in unit_modules] + [Unit(n, m, False, outer=True) for n, m in outer]
                      + [Unit("", model, True)])
        index = unit_of_params(model, [m for _, m in unit_modules], [m for _, m in outer])
        self._persistent_unit = Unit("<persistent>", model, False, persistent=True)  # Note [Persistent parameters]
        most = config.persistence_threshold
        self._unit_of_param = {p: self._persistent_unit if 0 < most and p.numel() <= most else self.units[i]
                               for p, i in index.items()}  # the root (-1) is last
        self.units.append(self._persistent_unit)
        self.frozen_buffers: list[FlatBuffer] = []  # frozen parameters: sharded and gathered with their unit
        super().__init__(model, param_groups=param_groups, config=config, process_group=process_group, **kwargs)
        # the root stays even when persistence left it empty: its forward hooks end the recorded pass
        self.units_without_params = self._why_no_params([u for u in self.units
                                                         if not (u.buffers or u.is_root or u.persistent)])
        self.units = [u for u in self.units if u.buffers or u.is_root]
        for i, unit in enumerate(self.units):
            unit.index = i
        match_peers(self.units)  # Note [Peer units] in unit_plan.py
        self._persistent_unit.unshard()  # whole on every rank from now on (a no-op when it holds nothing)
        self.sched = Schedule(self.units, config, self.reducer)
        self.reducer.on_ready.append(self.sched.on_bucket_ready)
        self.reducer.rider = GatherDigest(self)  # Note [Same units on every rank]
        self.guard = ParameterGuard(self._unit_of_param, self.sched, {p: n for n, p in model.named_parameters()},
                                    self.world_size)
        for unit in self.units:  # Note [Parameters at rest]
            if not unit.persistent:
                unit.adopted = [p for buf in unit.buffers for p in buf.params if adopt(p, self.guard.use)]
        for module in model.modules():
            module.__dict__["_zerorun_guard"] = weakref.ref(self.guard)  # for register_external_parameter
        for module, param in declared_externals(model):
            self.guard.declare_external(module, self._new_of.get(id(param), param) if self._deferred else param)
        self.sched.hook(config.activation_checkpointing)
        self.sched.handles.append(model.register_state_dict_pre_hook(state_dict_guard))

    def __call__(self, *args, **kwargs):
        """As :meth:`ZeroEngine.__call__`. A forward that raises leaves no unit on the stack: afterwards a
        parameter's use between steps is refused as at rest (Note [Parameters at rest]), not taken for a use
        inside that forward (an all-gather on this rank alone, and an external of the unit that raised). A forward
        without gradients ends with the ranks' agreement on the units it gathered (Note [Same units on every rank]).

        Raises:
            RuntimeError: on every rank, after a forward without gradients in which the ranks ran different units.
        """
        try:
            out = super().__call__(*args, **kwargs)
        except BaseException as e:
            clear = timed_out(self, e, "forward")  # Note [Same units on every rank]: a unit run on some ranks
            self.sched.clear_forward()
            if clear is None:
                raise
            raise clear from e
        if not torch.is_grad_enabled():  # Note [Same units on every rank]: no backward follows to agree
            self.reducer.rider.check_now()
        return out

    # ---------------------------------------------------------------------------------------- construction
    def _why_no_params(self, units: list[Unit]) -> dict[str, list[str]]:
        """The names of ``units`` (named or picked, holding no parameter of their own), by why, for the run's log
        (``unit_plan.describe_units``)."""
        out: dict[str, list[str]] = {}
        for unit in units:
            kinds = {"persistent" if self._unit_of_param[p].persistent else "root" for p in unit.module.parameters()}
            why = {frozenset(): "no parameters", frozenset({"persistent"}): "persistent, zero.persistence_threshold",
                   frozenset({"root"}): "a weight shared with modules outside them stays with the root"}.get(
                frozenset(kinds), "persistent, or shared with modules outside them and kept with the root")
            out.setdefault(why, []).append(unit.name)
        return out

    def _sync_initial_state(self) -> None:
        if not self._deferred:
            super()._sync_initial_state()

    def _partition(self, named, bucket_bytes):
        """Per unit (within one param group), runs of at most ``bucket_bytes``: a unit is gathered whole, but
        each of its buckets is reduce-scattered, and its full gradient freed, as soon as that bucket is
        complete (a root unit holding both the embedding and the LM head does not keep the LM head's
        gradient through the whole backward)."""
        return [run for params in self._by_unit(named).values() for run in pack(params, bucket_bytes)]

    def _by_unit(self, named) -> dict[int, list]:
        """``(name, param)`` pairs grouped by unit (``id`` of the unit), in their order."""
        out: dict[int, list] = {}
        for name, p in named:
            out.setdefault(id(self._unit_of_param[p]), []).append((name, p))
        return out

    def _materialize(self) -> None:
        """Keep only this rank's slice of every flat buffer (Note [Units]); values come from the model's
        parameters, or for a deferred model from the replay of its construction (Note [Record and replay])."""
        names = {p: n for n, p in self.module.named_parameters()}
        frozen_by_unit = self._by_unit((names[p], p) for p in self._frozen)
        for unit in self.units:  # one flat buffer per dtype (integer and bool parameters are frozen ones)
            for run in pack(frozen_by_unit.get(id(unit), []), float("inf")):
                self.frozen_buffers.append(FlatBuffer(run, -1, self.world_size, self.rank, order=-1))
        every = self.buffers + self.frozen_buffers
        for buf in every:
            buf.unit = self._unit_of_param[buf.params[0]]
            buf.unit.buffers.append(buf)
            buf.shard_data = torch.zeros(buf.shard_numel, dtype=buf.dtype, device=buf.device)
        # the slices become views of a file-backed mapping (Note [Parameter offload])
        self.param_store = (ParamStore([b for b in every if not b.unit.persistent], self.config.offload_path, self.rank)
                            if self.config.offload_params == "disk" else None)
        # the secondary shards (Note [Secondary shards]) over the gradients' inner level's group
        self.secondary = SecondaryShards(self.comm.grad_path.inner_comm) if self.config.hierarchy else None
        quantizer = WeightQuantizer(self.config.quantize_block) if self.config.quantize_weights else None
        self.gathering = Gathering(self.comm, self.param_store, ZeroParameter, secondary=self.secondary,
                                   quantizer=quantizer)  # Note [Quantized weights] in quantize.py
        if self._deferred:
            replay_slices(self.module, every, self._new_of, self._meta_list, self._replay_group)
        else:
            with torch.no_grad():
                for buf in every:
                    for p in buf.params:
                        buf.keep_slice(p, p.data)
        for buf in every:  # views are made while the storage exists, then it goes
            buf.data = torch.empty(buf.numel, dtype=buf.dtype, device=buf.device)
            buf.views = [buf.view_of(buf.data, p) for p in buf.params]
            buf.placeholders = [placeholder(p) for p in buf.params]  # Note [Parameters at rest]
        for unit in self.units:
            unit.ctx = self.gathering
            unit.point_params(gathered=False)
        self._release_slices()

    # ------------------------------------------------------------------------------ the stage policy's hooks
    def _param_slice(self, buf: FlatBuffer) -> torch.Tensor:
        return buf.shard_data

    def _after_step(self) -> None:
        """Units are gathered from the updated slices when next used (one left gathered by a forward that raised
        is freed: stale); persistent parameters (Note [Persistent parameters]) are all-gathered now."""
        self.gathering.training = False  # Gathering.training: the pass is over
        self.sched.unpin_second_order()  # Note [Backward outside engine.backward]
        self.sched.free_all()
        self._drop_secondary()
        self._gather_persistent(self._persistent_unit.trainable)  # frozen ones never change: gathered once
        self._release_slices()  # the step wrote every slice

    def backward(self, loss: torch.Tensor) -> None:
        """As :meth:`ZeroEngine.backward`; the root unit is gathered first, whatever structure the forward
        returned the loss in. What :meth:`_check_backward` refuses raises before any gather or check; so does a
        unit reaching the loss on some ranks only (Note [Backward on some ranks] in stage3_checks.py)."""
        self._check_backward(loss)
        where = "the agreement before backward"
        try:
            check_backward_units(self, loss)
            where = "backward"
            allocator.collect()  # Note [Rank allocator]: the units the forward freed go back before backward (host)
            if self.comm.device.type == "cpu":
                allocator.trim_dynamic()  # Note [Trimmed before backward] in allocator.py
            self.sched.backward_start(loss)
            super().backward(loss)
        except RuntimeError as e:
            clear = timed_out(self, e, where)  # Note [Same units on every rank]: a unit run on some ranks only
            if clear is None:
                raise
            raise clear from e

    def _zero_grads(self, discard: bool = False) -> None:
        """As :meth:`ZeroEngine._zero_grads`; a drop (Note [A backward that raised] in user_model.py) frees every
        unit and resets the backward's state too."""
        super()._zero_grads(discard)
        if discard:
            self.gathering.training = False
            self.sched.discard()
            self._drop_secondary()

    def _finish_backward(self) -> None:
        super()._finish_backward()
        self.sched.backward_end()

    def load_master_slices(self, values, states=None, param_scalars=None) -> None:
        """As :meth:`ZeroEngine.load_master_slices`; persistent parameters (Note [Persistent parameters]),
        frozen ones included, are all-gathered again from the loaded slices."""
        super().load_master_slices(values, states, param_scalars)
        self._drop_secondary()
        self._gather_persistent([b for b in self._persistent_unit.buffers if b.group_index < 0])

    def _drop_secondary(self) -> None:
        """The parameters changed: forget the secondary shards (Note [Secondary shards] in hierarchy.py)."""
        if self.secondary is not None:
            self.secondary.drop()

    def _gather_persistent(self, bufs: list[FlatBuffer]) -> None:
        """All-gather these buffers of the persistent unit from their slices (Note [Persistent parameters])."""
        if bufs:
            self.comm.wait([self.comm.all_gather(buf.data, buf.shard_data) for buf in bufs])

    def _release_slices(self) -> None:
        """Drop every unit's slices from memory: Note [Parameter offload] (a no-op without it)."""
        if self.param_store is not None:
            self.param_store.release_all()

    # ------------------------------------------------------------------------------------------- user API
    @contextlib.contextmanager
    def gathered_parameters(self, params: Iterable[nn.Parameter], modifier_rank: int | None = None):
        """Context manager: ``params`` (an iterable of the model's parameters) whole on every rank inside the
        block, as DeepSpeed's ``GatheredParameters`` and FSDP's ``summon_full_params``. Every rank of the
        engine's group must enter it. With ``modifier_rank`` (a rank of that group), in-place writes that rank
        makes inside the block are broadcast on exit and kept by every rank (master slices included); without
        it, a write raises on exit (it would be lost). Shapes and dtypes as the parameters'.

        Raises:
            RuntimeError: a parameter was written inside the block without ``modifier_rank``.
        """
        self.sched.free_held()  # Note [Kept from forward to backward] in stage3_outer.py
        unit_of = self.guard.unit_of
        units = sorted({unit_of[p] for p in params if p in unit_of}, key=lambda u: u.index)
        bufs = [buf for u in units for buf in u.buffers]
        token = object()
        were_free = [u for u in units if not u.pinned_by and u.active == 0]
        with self.gathering.exact():
            for u in units:
                u.unshard()
                u.pinned_by.add(token)
        versions = {p: p._version for buf in bufs for p in buf.params}
        before = {buf: buf.shard_data.clone() for buf in bufs} if modifier_rank is not None else {}
        try:
            yield
        finally:
            for u in units:
                u.pinned_by.discard(token)
            changed = [p for p, v in versions.items() if p._version != v]
            if modifier_rank is not None:  # this rank's slice of each buffer becomes its kept slice
                self.comm.wait([self.comm.broadcast(buf.data, modifier_rank) for buf in bufs])
                for buf in bufs:
                    buf.shard_data.copy_(buf.shard(buf.data))
                self._masters_take([b for b in bufs if b.group_index >= 0], before)
                self._drop_secondary()
                for u in units:  # kept: not a write to a gathered copy (Note [Writes inside a unit's forward])
                    u.versions = u.param_versions()
            for u in were_free:
                u.reshard()
            if changed and modifier_rank is None:
                raise RuntimeError(
                    f"parameter {self.guard.names.get(changed[0], '?')!r} was written inside gathered_parameters "
                    "without modifier_rank: the write is lost when the parameter is partitioned again; pass "
                    "modifier_rank=<the rank whose values to keep> (every rank then takes them)")

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The model's ordinary (unsharded) state dict, gathered unit by unit; every rank must call it.

        Returns:
            On rank 0 (or every rank unless ``rank0_only``): ``{name: tensor}`` with the keys and shapes of
            ``model.state_dict()`` of the unsharded model (CPU clones, in the parameters' dtype); elsewhere an
            empty dict.

        Raises:
            RuntimeError: called on some ranks only: one line when the collective timeout ends the wait.
        """
        self.sched.free_held()  # Note [Kept from forward to backward] in stage3_outer.py
        try:
            with self.gathering.exact():
                return full_state_dict(self.module, self.units, keep=not rank0_only or self.rank == 0)
        except RuntimeError as e:
            clear = called_on_some_ranks(self, e, "full_state_dict()")
            if clear is None:
                raise
            raise clear from e

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict on every rank (see :meth:`full_state_dict`)."""
        return self.full_state_dict(rank0_only=False)

    # ------------------------------------------------------------------------------------------------ report
    def describe_units(self) -> list[str]:
        """What this engine gathers and frees, the lines ``zerorun train`` prints at stage 3: the units by class and
        their gathered bytes, the outer units, what stays gathered and what is kept from forward to backward, with
        the bytes of each (``unit_plan.describe_units``). Local: no collective."""
        return describe_units(self.units, self.units_without_params, self.config.keep_root_bytes)

    def memory_bytes(self) -> dict[str, int]:
        """As :meth:`ZeroEngine.memory_bytes`, at rest: ``params`` counts this rank's slices, plus the whole
        persistent parameters (Note [Persistent parameters]) (theory, fp32 Adam: 16Ψ/N in all, ZeRO §5)."""
        out = super().memory_bytes()
        in_file = self.param_store is not None  # Note [Parameter offload]: the sharded units' slices
        out["params"] = sum(b.shard_data.nbytes for b in self.buffers + self.frozen_buffers
                            if b.unit.persistent or not in_file)
        out["params"] += sum(b.data.nbytes for b in self._persistent_unit.buffers)  # whole as well
        out["params"] += self.secondary.nbytes if self.secondary is not None else 0  # empty between steps
        return out

    def offload_bytes(self) -> dict[str, int]:
        """As :meth:`ZeroEngine.offload_bytes`; ``disk`` includes the parameter swap file's size (bytes)."""
        out = super().offload_bytes()
        out["disk"] += self.param_store.size if self.param_store is not None else 0
        return out

    def close(self) -> None:
        """As :meth:`ZeroEngine.close`, and removes the parameter swap file."""
        super().close()
        if self.param_store is not None:
            self.param_store.close()
