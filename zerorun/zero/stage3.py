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
accumulates a leaf once per backward, after all its uses), the unit is freed and its gradient buckets are
reduce-scattered (Note [Launch order] in reducer.py); a unit holding frozen parameters, which no gradient
signals, stays gathered until the end of backward. Forward runs inside backward (activation checkpointing's
recomputation) never free. At the end of the root's forward and of backward, whatever is still gathered (a
mispredicted prefetch) is freed.

Between uses the parameters hold placeholders, and their uses outside their unit are caught or served:
Note [Parameters at rest] and Note [External parameters] in ``stage3_access.py``. The end of each unit's
backward and the check that every rank gathered the same units: ``stage3_backward.py`` and Note [Same units
on every rank] in ``stage3_checks.py``.

Note [Persistent parameters]: parameters of at most ``ZeroConfig.persistence_threshold`` elements (norm
weights, biases; DeepSpeed's ``stage3_param_persistence_threshold``) may stay whole on every rank, in a unit of
their own that is never freed: they cost no all-gather in forward or backward, their gradients are
reduce-scattered in buckets like every other, each rank updates its slice of them, and the slices are
all-gathered after the optimizer step, as at stages 1-2. Memory: their whole bytes more per rank (the whole
tensor besides the slice the optimizer updates); traffic: one all-gather of them per step instead of two.
0 (the default) keeps every parameter partitioned.

Note [Prefetch]: the order of the units in forward and in backward is recorded, and kept until a pass differs.
When unit i starts (gradients on) in a pass that follows it, unit i+1's all-gather is issued (``prefetch_bytes``:
those after i that fit in that many bytes, ``units.units_ahead``), run while i computes; a deviating pass
prefetches no more. A wrong guess costs memory (up to ``prefetch_bytes``) and time, never correctness.
All-gathers and reduce-scatters share one process group, issued in program order (Note [Program order] in
reducer.py).
The root's backward prefetches nothing: it begins with the loss's backward, the step's peak for a language
model (a log-softmax over the vocabulary, three logits-sized tensors at once), where the first block's
parameters are not needed yet; that block is gathered when its backward begins and prefetches the next. On
the 55M GPT of ``benchmarks/zero_stages.py`` (micro-batch 4, 2 ranks) this lowered stage 3's peak RSS per
rank by 21 MiB under glibc tuned and 39 MiB under tcmalloc (realized saving 0.86 -> 0.91 and 0.77 -> 0.86)
at the same step time (2.087 -> 2.064 s, 1.518 -> 1.511 s).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zerorun.zero.deferred import is_deferred, placement, replay, swap_meta_tensors
from zerorun.zero.engine import ZeroEngine
from zerorun.zero.flat import FlatBuffer, pack
from zerorun.zero.param_offload import ParamOffload
from zerorun.zero.precision import DTYPES, compute_dtype
from zerorun.zero.stage3_access import (ParameterAccess, adopt, declared_externals, engine_ref, guarded, placeholder,
                                        plain)
from zerorun.zero.stage3_backward import Stage3Backward
from zerorun.zero.stage3_checks import carry_hooks, check_no_writes, param_versions
from zerorun.zero.stage3_outer import OuterUnits
from zerorun.zero.torch_internals import in_backward
from zerorun.zero.units import (Unit, UnitInputsDone, UnitState, outer_modules, pick_units,  # noqa: F401
                                tensors_in, unit_of_params, units_ahead)


class Stage3Engine(ParameterAccess, Stage3Backward, OuterUnits, ParamOffload, ZeroEngine):
    """:class:`ZeroEngine` at stage 3 (Notes [Units], [Unit lifecycle], [Prefetch], [Outer units]). Extra API:
    :meth:`full_state_dict`, :attr:`units`."""

    def __init__(self, model: nn.Module, *, param_groups, config, process_group, **kwargs) -> None:
        self._deferred = is_deferred(model)
        self._meta_of: dict[int, torch.Tensor] = {}  # id(new parameter) -> its meta original (deferred init)
        self._replay_group = process_group
        if self._deferred:
            param_groups = self._swap_meta_params(model, param_groups, DTYPES[config.precision])
        unit_modules = pick_units(model, tuple(config.units))
        outer = outer_modules(model, [m for _, m in unit_modules])  # Note [Outer units]
        self.units = ([Unit(n, m, False) for n, m in unit_modules] + [Unit(n, m, False, outer=True) for n, m in outer]
                      + [Unit("", model, True)])
        self._unit_of_param = self._assign(model)
        self._persistent_unit = Unit("<persistent>", model, False, persistent=True)  # Note [Persistent parameters]
        for p in list(self._unit_of_param):
            if 0 < config.persistence_threshold and p.numel() <= config.persistence_threshold:
                self._unit_of_param[p] = self._persistent_unit
        self.units.append(self._persistent_unit)
        self._frozen_buffers: list[FlatBuffer] = []
        super().__init__(model, param_groups=param_groups, config=config, process_group=process_group, **kwargs)
        self.reducer.on_ready.append(self._on_bucket_ready)
        # the root stays even when persistence left it empty: its forward hooks end the recorded pass
        self.units = [u for u in self.units if u.buffers or u.is_root]
        for i, unit in enumerate(self.units):
            unit.index = i
        self._root = next(u for u in self.units if u.is_root)
        self._gather_log: list[int] = []  # Note [Same units on every rank]: units all-gathered since the last step
        self._gather(self._persistent_unit)  # whole on every rank from now on (a no-op when it holds nothing)
        self._order: dict[str, list[Unit]] = {"forward": [], "backward": []}
        self._seen: dict[str, list[Unit]] = {"forward": [], "backward": []}
        self._handles = []
        for unit in self.units:
            if unit.persistent or unit.outer:  # outer units: hooked in _outer_setup (Note [Outer units])
                continue
            self._handles.append(unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit),
                                                                       with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(functools.partial(self._post_forward, unit)))
            if config.activation_checkpointing and not unit.is_root:
                forward = unit.module.forward

                def checkpointed(*args, _forward=forward, **kw):
                    if not torch.is_grad_enabled():
                        return _forward(*args, **kw)
                    return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kw)

                unit.module.forward = checkpointed
        # Note [Parameters at rest]
        self._active: list[Unit] = []
        self._names = {p: n for n, p in model.named_parameters()}
        self._warned: set = set()
        for unit in self.units:
            if not unit.persistent:
                unit.adopted = [p for buf in unit.buffers for p in buf.params if adopt(p, self._use)]
        for module in model.modules():
            module.__dict__["_zerorun_engine"] = engine_ref(self)
        for module, param in declared_externals(model):
            self.declare_external(module, self._new_of.get(id(param), param) if self._deferred else param)
        self._in_full_state_dict = False
        self._outer_setup()
        self._handles.append(model.register_state_dict_pre_hook(self._state_dict_guard))

    # ---------------------------------------------------------------------------------------- construction
    def _assign(self, model: nn.Module) -> dict[nn.Parameter, Unit]:
        """Each parameter's unit (:func:`unit_of_params`); the root unit is last in ``self.units``, after the
        listed units and the outer units (Note [Outer units])."""
        listed = [u.module for u in self.units[:-1] if not u.outer]
        index = unit_of_params(model, listed, [u.module for u in self.units[:-1] if u.outer])
        return {p: self.units[i] for p, i in index.items()}

    def _swap_meta_params(self, model: nn.Module, param_groups, dtype: torch.dtype):
        """Replace meta parameters by real ones of the same shape whose storage is empty (freed), remembering
        each one's meta original for the replay; buffers become real zeros, filled by the replay. Floating-point
        tensors take ``dtype`` (Note [Mixed precision]: the replayed values are cast as they are kept; float64
        stays: Note [Wide parameters]). Returns ``param_groups`` with its (meta) parameters replaced."""
        self._meta_list = list(model.parameters()) + list(model.buffers())
        device = placement(model)

        def value_of(meta: torch.Tensor) -> torch.Tensor:
            t = torch.zeros(meta.shape, dtype=compute_dtype(meta.dtype, dtype), device=device)
            if isinstance(meta, nn.Parameter):
                t.untyped_storage().resize_(0)
            return t

        # tensors built from data are real already (zero/record.py): they are swapped and replayed too
        self._new_of = swap_meta_tensors(model, value_of, real_too=True)
        names = {id(t): n for n, t in model.named_parameters()}
        for meta in self._meta_list:  # hooks the constructor registered on its (meta) parameters move along
            new = self._new_of.get(id(meta))
            if isinstance(new, nn.Parameter):
                carry_hooks(meta, new, names.get(id(new), "?"))
        if param_groups is None:
            return None
        return [dict(g, params=[self._new_of.get(id(p), p) for p in g["params"]]) for g in param_groups]

    def _sync_initial_state(self) -> None:
        if not self._deferred:
            super()._sync_initial_state()

    def _partition(self, named, bucket_bytes):
        """Per unit (within one param group), runs of at most ``bucket_bytes``: a unit is gathered whole, but
        each of its buckets is reduce-scattered, and its full gradient freed, as soon as that bucket is
        complete (a root unit holding both the embedding and the LM head does not keep the LM head's
        gradient through the whole backward)."""
        by_unit: dict[int, list] = {}
        for name, p in named:
            by_unit.setdefault(id(self._unit_of_param[p]), []).append((name, p))
        return [run for params in by_unit.values() for run in pack(params, bucket_bytes)]

    def _materialize(self) -> None:
        """Keep only this rank's slice of every flat buffer (Note [Units]); values come from the model's
        parameters, or for a deferred model from the replay of its construction (Note [Record and replay])."""
        model = self.module
        names = {p: n for n, p in model.named_parameters()}
        frozen_by_unit: dict[int, list] = {}
        for p in self._frozen:
            frozen_by_unit.setdefault(id(self._unit_of_param[p]), []).append((names[p], p))
        for unit in self.units:  # one flat buffer per dtype (integer and bool parameters are frozen ones)
            for run in pack(frozen_by_unit.get(id(unit), []), float("inf")):
                self.frozen_buffers.append(FlatBuffer(run, -1, self.world_size, self.rank, order=-1))
        for buf in self.buffers + self.frozen_buffers:
            unit = self._unit_of_param[buf.params[0]]
            unit.buffers.append(buf)
            buf.unit = unit
            buf.shard_data = torch.zeros(buf.shard_numel, dtype=buf.dtype, device=buf.device)
        self._offload_params()  # Note [Parameter offload]: the slices become views of a file-backed mapping
        if self._deferred:
            self._replay()
        else:
            with torch.no_grad():
                for buf in self.buffers + self.frozen_buffers:
                    for p in buf.params:
                        self._keep_slice(buf, p, p.data)
        for buf in self.buffers + self.frozen_buffers:  # views are made while the storage exists, then it goes
            buf.data = torch.empty(buf.numel, dtype=buf.dtype, device=buf.device)
            buf.views = [buf.view_of(buf.data, p) for p in buf.params]
            buf.placeholders = [placeholder(p) for p in buf.params]  # Note [Parameters at rest]
            for p, rest in zip(buf.params, buf.placeholders):
                p.data = rest
            buf.data.untyped_storage().resize_(0)
        self._release_slices(None)

    @property
    def frozen_buffers(self) -> list[FlatBuffer]:
        """Flat buffers of frozen parameters (sharded and gathered with their unit, never reduced)."""
        return self._frozen_buffers

    def _keep_slice(self, buf: FlatBuffer, p: nn.Parameter, value: torch.Tensor) -> None:
        """Copy the part of ``value`` (``p``'s full values) that falls in this rank's slice of ``buf``."""
        slot = buf.slots[p]
        lo = max(slot.offset, buf.lo)
        hi = min(slot.offset + slot.numel, buf.lo + buf.shard_numel)
        if lo < hi:
            buf.shard_data[lo - buf.lo:hi - buf.lo].copy_(value.reshape(-1)[lo - slot.offset:hi - slot.offset])

    def _replay(self) -> None:
        where = {id(p): buf for buf in self.buffers + self.frozen_buffers for p in buf.params}

        def keep(meta: torch.Tensor, value: torch.Tensor) -> None:
            target = self._new_of[id(meta)]
            buf = where.get(id(target))
            with torch.no_grad():
                if buf is not None:
                    self._keep_slice(buf, target, value)
                else:  # a module buffer (e.g. BatchNorm's running stats): kept whole
                    target.copy_(value)

        replay(self.module, keep, tensors=self._meta_list, process_group=self._replay_group)

    def _param_slice(self, buf: FlatBuffer) -> torch.Tensor:
        return buf.shard_data

    def _grad_slice(self, buf: FlatBuffer) -> torch.Tensor:
        return buf.shard_grad

    def _after_step(self) -> None:
        """Units are gathered from the updated slices when next used (one left gathered by a forward that raised
        is freed: stale); persistent parameters (Note [Persistent parameters]) are all-gathered now."""
        self._free_all()
        trainable = self._persistent_unit.trainable  # frozen ones never change: gathered once, at construction
        if trainable:
            self.comm.wait([self.comm.all_gather(buf.data, buf.shard_data) for buf in trainable])
        self._release_slices(None)  # the step wrote every slice

    # ------------------------------------------------------------------------------------ gather and free
    def _gather(self, unit: Unit, wait: bool = True) -> None:
        if unit.state is UnitState.FREE:
            for buf in unit.buffers:
                buf.data.untyped_storage().resize_(buf.numel * buf.data.element_size())
            unit.works = [self.comm.all_gather(buf.data, buf.shard_data) for buf in unit.buffers]
            unit.state = UnitState.GATHERING
            if unit.index >= 0:
                self._gather_log.append(unit.index)
            with torch._C.DisableTorchFunctionSubclass():  # the guard's metadata path, skipped per parameter
                for buf in unit.buffers:
                    for p, view in zip(buf.params, buf.views):
                        p.data = view
            for other in unit.external:  # Note [External parameters]
                if not other.deferred:  # Note [Outer units]: a tail this backward gathers later
                    self._gather(other, wait=False)
                    other.pinned_by.add(unit)
        if wait and unit.state is UnitState.GATHERING:
            for other in unit.external:
                if not other.deferred:
                    self._gather(other)
            self.comm.wait(unit.works)
            unit.works = []
            self._release_slices(unit)
            unit.state = UnitState.GATHERED
            unit.versions = param_versions(unit)  # Note [Writes inside a unit's forward]
            plain(unit)  # Note [Plain while gathered]

    def _free(self, unit: Unit) -> None:
        if unit.state is UnitState.FREE or unit.persistent or unit.pinned_by:
            return
        if unit.works:
            self.comm.wait(unit.works)
            unit.works = []
            self._release_slices(unit)
        guarded(unit)  # Note [Plain while gathered]
        with torch._C.DisableTorchFunctionSubclass():
            for buf in unit.buffers:
                for p, rest in zip(buf.params, buf.placeholders):
                    p.data = rest
                buf.data.untyped_storage().resize_(0)
        unit.state = UnitState.FREE
        for other in unit.external:
            other.pinned_by.discard(unit)
            if other.active == 0 and not (other.outer and in_backward()):  # an outer unit: when its own gradient is
                self._free(other)

    def _free_all(self) -> None:
        for unit in self.units:  # pins of units go; a gathered_parameters block keeps its own
            unit.pinned_by = {h for h in unit.pinned_by if not isinstance(h, Unit)}
        for unit in self.units:
            self._free(unit)

    def _note_and_prefetch(self, unit: Unit, phase: str) -> None:
        seen = self._seen[phase]
        if seen and seen[-1] is unit:
            return
        seen.append(unit)
        order = self._order[phase]
        i = len(seen) - 1
        if not self.config.prefetch or i >= len(order) or order[i] is not unit:
            return
        if phase == "backward" and unit.is_root:  # Note [Prefetch]: not across the loss's backward
            return
        for ahead in units_ahead(order, i, self.config.prefetch_bytes):  # ZeroConfig.prefetch_bytes
            self._gather(ahead, wait=False)

    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: dict) -> Any:
        if not unit.is_root and not in_backward():
            self._outer_listed_call(unit)  # Note [Outer units]
        self._gather(unit)
        if in_backward():
            return None
        if unit.is_root:  # a new forward: whatever an interrupted one left on the stack goes
            self._outer_pass_start()
            for u in self._active:
                u.active = 0
            self._active = []
            for u in self.units:  # a forward without backward (evaluation with grad on) keeps no graph alive
                u.out_nodes, u.in_nodes = [], []
        unit.active += 1
        self._active.append(unit)
        if not torch.is_grad_enabled():
            return None
        self._note_and_prefetch(unit, "forward")
        if unit.is_root:  # the end of backward ends the root's backward
            return None
        # Note [End of a unit's backward]
        flat, spec = tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            return None
        unit.open_calls += 1
        out = UnitInputsDone.apply(functools.partial(self._unit_backward_done, unit), *(flat[i] for i in at))
        unit.in_nodes.append((out[0] if len(at) > 1 else out).grad_fn)  # Note [Program order] in reducer.py
        for i, t in zip(at, out if len(at) > 1 else (out,)):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():  # recomputation under activation checkpointing: the unit is still needed
            return output
        unit.active -= 1
        if self._active and self._active[-1] is unit:
            self._active.pop()
        if torch.is_grad_enabled():
            hook = functools.partial(self._pre_backward, unit)
            for t in tensors_in(output):  # any structure: dataclasses, objects with a .loss, nested containers
                if t.requires_grad:
                    t.register_hook(hook)
                    if t.grad_fn is not None:
                        unit.out_nodes.append(t.grad_fn)
        check_no_writes(unit)
        if unit.is_root:
            if torch.is_grad_enabled():
                self._end_pass("forward")
            self._outer_pass_end()
            self._free_all()
        else:
            self._free(unit)
        return output

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        if not unit.is_root:
            self._outer_before_listed_backward()  # Note [Outer units]: the tails' all-gather comes first
        self._gather(unit)
        self._note_and_prefetch(unit, "backward")
        if not unit.is_root:
            self._outer_listed_backward(unit)  # Note [Outer units]

    def _end_pass(self, phase: str) -> None:
        if self._seen[phase] and self._seen[phase] != self._order[phase]:
            self._order[phase] = self._seen[phase]
        self._seen[phase] = []

    # ------------------------------------------------------------------------------------------------ report
    def memory_bytes(self) -> dict[str, int]:
        """As :meth:`ZeroEngine.memory_bytes`, at rest: ``params`` counts this rank's slices, plus the whole
        persistent parameters (Note [Persistent parameters]) (theory, fp32 Adam: 16Ψ/N in all, ZeRO §5)."""
        out = super().memory_bytes()
        out["params"] = sum(b.shard_data.nbytes for b in self.buffers + self.frozen_buffers)
        out["params"] += sum(b.data.nbytes for b in self._persistent_unit.buffers)  # whole as well
        out["params"] -= self._offloaded_param_bytes()  # Note [Parameter offload]: in the file
        return out
