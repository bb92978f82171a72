"""torch.compile at every ZeRO stage: a compiled model given to :func:`zerorun.zero.initialize` (``model.compile``
in a recipe) is unwrapped, and compiled again where each stage can run compiled code.

Note [Compiling per unit]: ``torch.compile(model)`` returns an ``OptimizedModule`` whose call traces the whole
model's ``__call__``: at stages 0-2 that is the model's forward and nothing else, but at stage 3 it is also
the per-unit forward hooks that all-gather and free each unit (``stage3.py``), and the outer units' guarded
parameters (Note [Plain while gathered] in ``stage3_access.py``). Dynamo traced into them, read every
parameter while building its graph (each read a "use outside its unit", wrongly recorded as an external
parameter) and recursed through the guard's ``__torch_function__`` (a RecursionError). So the engine never
runs a compiled call of anything that holds a unit's hooks; it compiles what runs between them, as FSDP2's
users compile each block (``fully_shard(block)``, then ``block.compile()``; FSDP2's hooks are traceable,
zerorun's are not, so here the unit's ``forward`` is compiled, not its call):

- the ``OptimizedModule`` is unwrapped at every stage: the engine holds ``model._orig_mod``, so parameter names,
  ``state_dict`` keys and checkpoints are the model's own, compiled or not, at every stage (no ``_orig_mod.``
  prefix: a compiled run's checkpoint resumes an uncompiled one and back);
- it is compiled again with the user's own dynamo context (``OptimizedModule.dynamo_ctx``: the same backend,
  ``mode``, ``options``, ``dynamic`` and ``fullgraph``): stages 0-2 compile the whole call (what
  ``model.compile(...)`` does); stage 3 compiles the ``forward`` of each listed unit that holds no other unit
  (:func:`unit_forwards`), as an instance attribute, so the unit's hooks run in ``nn.Module.__call__``, eager,
  around the compiled code. The unit's parameters are plain ``nn.Parameter``s while its forward runs (Note
  [Plain while gathered]): dynamo sees ordinary parameters, guarded on their metadata only (not on their
  storage, which the unit's all-gather fills and its free empties), and every unit of one class shares one
  compiled graph: one compile per unit class and grad mode, no recompile per step or per gather, no graph
  break (``tests/test_compile.py`` counts them; a new input shape compiles once more, as anywhere). What the
  compiled forward saves for backward is what eager saves (the tiny GPT's saved tensors: 577 KB eager,
  ``aot_eager`` and ``inductor`` alike): no copy of a unit's weights outlives its free.
- Eager at stage 3: the root's own forward (the code between the units: a GPT's loop over its blocks, the
  loss), the outer units (embeddings, final norm, LM head: Note [Outer units] in ``stage3_outer.py``; their
  schedule is learned from who reads their parameters, so those stay guarded and untraceable), and a listed
  unit that holds another listed unit (its forward would run the inner unit's hooks). Their time is what
  compiling does not save at stage 3.
- A module compiled in place (``nn.Module.compile()``) keeps no record of its options that torch exposes: at
  stage 3, one that does not lie inside a listed unit (the model, a unit, an outer module) is refused before
  anything is partitioned (:func:`refuse_in_place`), naming ``torch.compile(model, ...)``; one inside a unit
  runs compiled, between the unit's hooks.
"""

from __future__ import annotations

import sys
import warnings
from typing import Callable

import torch
import torch.nn as nn

#: a dynamo context: ``compiler(fn)`` is ``fn`` compiled with the backend and options the user chose
Compiler = Callable[[Callable], Callable]


def unwrap(model: nn.Module) -> tuple[nn.Module, Compiler | None]:
    """``(the module, its compiler)``: for ``torch.compile(m, ...)``, ``m`` and the dynamo context that compiled
    it (Note [Compiling per unit]); for any other module, itself and ``None``."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled (it costs 2 s)
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        return model._orig_mod, model.dynamo_ctx
    return model, None


def compile_whole(model: nn.Module, compiler: Compiler) -> None:
    """Stages 0-2: ``model``'s call compiled in place, as ``model.compile(...)`` with the user's options does
    (the whole forward, parameter names unchanged)."""
    model._compiled_call_impl = compiler(model._call_impl)


def unit_forwards(units) -> list[nn.Module]:
    """Stage 3: the modules whose ``forward`` is compiled: each listed unit (not the root, not an outer or the
    persistent unit) that holds no other such unit, in ``units``' order (Note [Compiling per unit])."""
    listed = [u.module for u in units if not (u.is_root or u.outer or u.persistent)]
    ids = {id(m) for m in listed}
    return [m for m in listed if not any(id(sub) in ids for sub in m.modules() if sub is not m)]


def compile_units(engine, compiler: Compiler) -> None:
    """Stage 3: each of :func:`unit_forwards`' modules gets ``forward = compiler(forward)`` (an instance
    attribute; under activation checkpointing the checkpointed forward is compiled). Warns when there is none
    (the root is the only unit: nothing is compiled)."""
    modules = unit_forwards(engine.units)
    for module in modules:
        module.forward = compiler(module.forward)
    # the at-rest guard runs eagerly (a graph break), never traced: tracing it wraps every parameter the guard
    # knows (its dict of units) and so "uses" them all from inside the unit being compiled
    for unit in engine.units:
        for p in unit.adopted:
            p._zerorun_use = torch.compiler.disable(p._zerorun_use, recursive=True)
    if not modules:
        warnings.warn("stage 3 compiles each unit's forward, and this model has no unit but the root: it runs "
                      "uncompiled (name its blocks' class in zero.units)", stacklevel=3)


def refuse_in_place(model: nn.Module, class_names) -> None:
    """Stage 3, before the engine partitions anything: refuse a module compiled in place (``nn.Module.compile``)
    that does not lie inside a listed unit (``class_names``: ``ZeroConfig.units``): the model, a unit or an
    outer module, whose compiled call would trace the units' hooks or guarded parameters.

    Raises:
        ValueError: one line naming the module and the way out, ``torch.compile(model, ...)``.
    """
    compiled = [(n, m) for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    if not compiled:
        return
    from zerorun.zero.unit_plan import pick_units

    units = [unit for _, unit in pick_units(model, tuple(class_names))]
    inside = {id(sub) for unit in units for sub in unit.modules() if sub is not unit}
    for name, module in compiled:
        if id(module) not in inside:
            raise ValueError(
                f"stage 3: {'module ' + repr(name) if name else 'the model'} was compiled in place "
                "(nn.Module.compile), which would trace zerorun's per-unit all-gather hooks: give "
                "zerorun.zero.initialize the uncompiled model as torch.compile(model, backend=...) instead (recipe: "
                "model.compile), and stage 3 compiles each unit's forward with those options")


def dynamo_counts() -> dict[str, int]:
    """Dynamo's counts in this process since it started (``torch._dynamo.reset()`` keeps them: compare two
    readings): ``graphs`` compiled (first compiles and recompiles alike), ``frames`` converted,
    ``graph_breaks``. For tests and benchmarks: a steady training step adds none (Note [Compiling per unit])."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]), "frames": int(counters["frames"]["ok"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}
