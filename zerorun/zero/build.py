"""``zerorun.zero.initialize``: the engine of a stage (stages 0-2: :class:`~zerorun.zero.engine.ZeroEngine`, stage 3:
:class:`~zerorun.zero.stage3.Stage3Engine`, a subclass of it). It lives here, above both engines, so that
engine.py never imports stage3.py (which imports engine.py): zero/ has no import circle.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from zerorun.zero import compiling
from zerorun.zero.config import ZeroConfig
from zerorun.zero.engine import ZeroEngine
from zerorun.zero.precision import refuse_complex
from zerorun.zero.stage3 import Stage3Engine

#: id of each parameter an engine at stages 0-2 holds (its gradient hooks stay on it for as long as it lives) ->
#: the engine's stage; an entry goes with its parameter (a deep copy of the model is not held). By id: a tensor's
#: ``==`` is elementwise, so a WeakKeyDictionary's lookups raise.
_HELD: dict[int, int] = {}


def _hold(model: nn.Module, stage: int) -> None:
    for p in model.parameters():
        if id(p) not in _HELD:
            _HELD[id(p)] = stage
            weakref.finalize(p, _HELD.pop, id(p), None)


def initialize(model: nn.Module, *, optimizer: str | type = "AdamW", optimizer_kwargs: dict[str, Any] | None = None,
               param_groups: list[dict[str, Any]] | None = None, config: ZeroConfig | None = None,
               process_group: dist.ProcessGroup | None = None, elementwise: bool = False) -> ZeroEngine:
    """Wrap ``model`` in a :class:`ZeroEngine` on ``process_group`` (default: the world).

    Args:
        model: the model, built identically on every rank (rank 0's values are broadcast), or built by
            :func:`~zerorun.zero.deferred.deferred_init` on the meta device: stage 3 then materializes only
            this rank's slices, with the values normal construction would give. ``torch.compile(model, ...)``
            is unwrapped and compiled again with its options: the whole forward at stages 0-2, each unit's
            forward at stage 3 (Note [Compiling per unit] in ``compiling.py``).
        optimizer: a ``torch.optim`` class or its name; it must be elementwise (Note [Elementwise optimizers]
            in ``optimizers.py``).
        optimizer_kwargs: keyword arguments for the optimizer (``lr``, ``betas``, ``weight_decay``, ...).
        param_groups: torch-style groups (dicts with ``params`` and per-group options); by default
            :func:`~zerorun.zero.optimizers.default_param_groups` with ``optimizer_kwargs["weight_decay"]``.
        config: :class:`ZeroConfig` (stage, bucket size, accumulation, clipping).
        elementwise: declare an optimizer class outside ``optimizers.ELEMENTWISE_OPTIMIZERS`` elementwise.

    Raises:
        ValueError: ``model`` is not an ``nn.Module``; unsupported stage, unknown or non-elementwise optimizer,
            malformed ``param_groups``; a model an engine already holds (its parameters partitioned into a
            stage-3 engine, or carrying the gradient hooks of one at stages 0-2, closed or not); at stage 3, a
            model or unit compiled in place (``nn.Module.compile``); a parameter on the meta device outside
            ``deferred_init``; a complex
            parameter (named; Note [Wide parameters] in ``precision.py``). All before any collective.
        RuntimeError: ``torch.distributed`` is not initialized.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
    from zerorun.zero.deferred import is_deferred, materialize
    from zerorun.zero.stage3_access import held_by_stage3

    model, compiler = compiling.unwrap(model)  # Note [Compiling per unit]
    refuse_complex(model)  # Note [Wide parameters] in precision.py
    held = next(((name, 3 if held_by_stage3(p) else _HELD[id(p)]) for name, p in model.named_parameters()
                 if held_by_stage3(p) or id(p) in _HELD), None)
    if held is not None:
        how = "is partitioned into it" if held[1] == 3 else "carries its gradient hooks"
        raise ValueError(f"this model is held by a stage {held[1]} engine already (parameter {held[0]!r} {how}, "
                         "and stays so while the model lives, closed or not): build a fresh model for a new engine, "
                         "or keep training with the first one (its full_state_dict() has the whole parameters)")

    meta = None if is_deferred(model) else next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(f"parameter {meta!r} is on the meta device and has no values: build the model with "
                         "zerorun.zero.deferred_init(factory, ...) (its construction is recorded and replayed), or "
                         "give it values first (model.to_empty(device=...) and your initialization)")
    config = config or ZeroConfig()
    kwargs = dict(optimizer=optimizer, optimizer_kwargs=optimizer_kwargs or {}, param_groups=param_groups,
                  config=config, process_group=process_group, elementwise=elementwise)
    if config.stage == 3:
        compiling.refuse_in_place(model, config.units)
        engine = Stage3Engine(model, **kwargs)
        if compiler is not None:
            compiling.compile_units(engine, compiler)
        return engine
    if is_deferred(model):
        if param_groups is not None:
            raise ValueError("param_groups of a deferred model must be given at stage 3 only; at stages 0-2 "
                             "materialize it first (zerorun.zero.materialize)")
        metas = dict(model.named_parameters())
        materialize(model)
        from zerorun.zero.deferred import carry_hooks

        for name, p in model.named_parameters():  # hooks the constructor registered move to the real parameters
            if name in metas and metas[name] is not p:
                carry_hooks(metas[name], p, name)
    engine = ZeroEngine(model, **kwargs)
    _hold(model, config.stage)
    if compiler is not None:
        compiling.compile_whole(model, compiler)
    return engine
