"""Stage 3's units: which modules are gathered and freed as one (Note [Units] in ``stage3.py``), what a unit
holds, and the structure walks its hooks need (outputs of any structure, the end of a unit's backward).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from zerorun.zero.flat import FlatBuffer


class UnitState(enum.Enum):
    FREE = "free"
    GATHERING = "gathering"  # all-gather issued, not waited for
    GATHERED = "gathered"


class Unit:
    """A module gathered and freed as one (Note [Units])."""

    def __init__(self, name: str, module: nn.Module, is_root: bool, persistent: bool = False,
                 outer: bool = False) -> None:
        self.name, self.module, self.is_root, self.persistent = name, module, is_root, persistent
        self.outer = outer  # Note [Outer units]: a module outside the listed units, gathered on a learned schedule
        self.buffers: list = []  # FlatBuffer
        self.state = UnitState.FREE
        self.adopted: list = []  # its parameters whose class the engine switches (Note [Plain while gathered])
        self.works: list[Any] = []
        self.ready_buffers = 0
        self.index = -1  # position in the engine's unit list, equal on every rank
        self.open_calls = 0  # forward calls of this step whose backward has not reached the unit's inputs yet
        self.external: list[Unit] = []  # units whose parameters this unit's forward reads (register_external_parameter)
        self.pinned_by: set = set()  # gathered units (or gathered_parameters blocks) that need this one gathered
        self.active = 0  # forward calls of this unit now on the stack
        self.out_nodes: list = []  # grad_fn of its outputs since the last backward (Note [Backward on some ranks])
        self.in_nodes: list = []  # UnitInputsDone's nodes since the last backward (Note [End of a unit's backward])
        self.ends_agreed = False  # this backward, every rank reaches its end of backward (its buckets reduce there)
        # Note [Outer units]: in the first step, whether it ran after the first listed unit's call (first: 0
        # or 1) and whether its output's gradient came after that unit's backward began (bfirst: 0 or 1),
        # whether its parameters were read outside its own forward; and whether every rank agreed to schedule it
        self.first: int | None = None
        self.bfirst: int | None = None
        self.used_outside = False
        self.declared = False  # register_external_parameter(model, one of its parameters): stays with the root
        self.scheduled = False
        # Note [Outer units], tails: in the first step, whether every gradient of its outputs came before any
        # listed unit's backward began (btail: 0 or 1); whether every rank agreed (tail); whether this backward
        # gathers it then rather than with the root (deferred: its outputs reach the loss on every rank)
        self.btail: int | None = None
        self.tail = False
        self.deferred = False

    @property
    def trainable(self) -> list[FlatBuffer]:
        return [b for b in self.buffers if b.group_index >= 0]

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the unit's parameters when gathered (all its flat buffers, whole)."""
        return sum(b.numel * b.dtype.itemsize for b in self.buffers)

    def __repr__(self) -> str:
        return f"Unit({self.name or '<root>'})"


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


def pick_units(model: nn.Module, class_names: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The unit modules of ``model`` (not the root), in module order.

    With ``class_names``: every module whose class name is listed. Without: Note [Automatic units] — modules
    holding between 1/64 and 1/4 of the parameters, taken from the top down (a larger one is split into its
    children); smaller modules stay in their parent's unit.

    Raises:
        ValueError: a listed class name matches no module.
    """
    if class_names:
        found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in class_names]
        missing = set(class_names) - {type(m).__name__ for _, m in found}
        if missing:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(f"zero.units: no module of class {', '.join(sorted(missing))} in the model "
                             f"(its classes: {', '.join(classes)})")
        return found  # a unit inside another listed unit is a unit of its own (its parameters are its own)
    total = sum(p.numel() for p in model.parameters())
    low, high = total / 64, total / 4
    units: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            count = sum(p.numel() for p in child.parameters())
            if count > high and any(True for _ in child.children()):
                visit(full, child)
            elif count >= low:
                units.append((full, child))

    visit("", model)
    return units


def outer_modules(model: nn.Module, unit_modules: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Note [Outer units]: the largest modules of ``model`` that hold parameters and neither are, hold nor lie
    inside one of ``unit_modules`` (a GPT's token and position embeddings, final norm and LM head), in module
    order; none when ``unit_modules`` is empty (the root is then the only unit)."""
    if not unit_modules:
        return []
    ids = {id(m) for m in unit_modules}
    holds_unit: set[int] = set()

    def mark(module: nn.Module) -> bool:  # does module hold a unit (itself excluded)?
        inside = False
        for child in module.children():
            inside |= mark(child) or id(child) in ids
        if inside:
            holds_unit.add(id(module))
        return inside

    mark(model)
    found: dict[int, tuple[str, nn.Module]] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if id(child) in ids or id(child) in found:
                continue
            if id(child) in holds_unit:
                visit(full, child)
            elif any(True for _ in child.parameters()):
                found[id(child)] = (full, child)

    visit("", model)
    return list(found.values())


def unit_of_params(model: nn.Module, unit_modules: list[nn.Module],
                   outer: list[nn.Module] = ()) -> dict[nn.Parameter, int]:
    """Each parameter's unit as an index into ``unit_modules`` (from :func:`pick_units`) followed by ``outer``
    (from :func:`outer_modules`), ``-1`` for the root: the innermost unit around every module that holds it;
    a parameter held by modules in different units (a weight tied across units, or between an outer module
    and the rest of the model) belongs to the root (Note [Units])."""
    index_of = {id(m): i for i, m in enumerate(unit_modules)}
    index_of.update({id(m): len(unit_modules) + j for j, m in enumerate(outer)})
    holders: dict[nn.Parameter, set[int]] = {}

    def visit(module: nn.Module, unit: int) -> None:
        unit = index_of.get(id(module), unit)
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(p, set()).add(unit)
        for child in module.children():
            visit(child, unit)

    visit(model, -1)
    return {p: next(iter(ids)) if len(ids) == 1 else -1 for p, ids in holders.items()}


def tensors_in(obj: Any, _depth: int = 0) -> list[torch.Tensor]:
    """Every tensor inside ``obj``: a tensor, or (recursively, 32 levels deep at most) lists, tuples (named
    tuples too), dicts (``transformers``' ``ModelOutput`` too), dataclass instances and plain objects' attributes
    (an object with a ``.loss``). Used to find a unit's outputs, whatever structure holds them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if _depth > 32 or obj is None or isinstance(obj, (str, bytes, int, float, bool, nn.Module)):
        return []
    if isinstance(obj, dict):
        values = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        values = list(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
        values = list(vars(obj).values())
    else:
        return []
    return [t for v in values for t in tensors_in(v, _depth + 1)]


class UnitInputsDone(torch.autograd.Function):
    """Identity on a unit's forward inputs whose backward calls ``callback()``: once autograd has computed the
    gradients of a unit's inputs, the unit's backward is done (its parameters' gradient accumulators run as
    soon as they are ready, before anything that depends on them: FSDP2 detects the end of a module's backward
    the same way). Shapes and dtypes pass through unchanged."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], *tensors: torch.Tensor):
        ctx.callback = callback
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)
