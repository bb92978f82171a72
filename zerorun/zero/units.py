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


# Note [Peer units]: all-gathers pair up across ranks in the order they are issued, so a step in which ranks
# run different units (an MoE layer routing each rank's tokens to another expert) pairs one rank's unit with
# another's. Between units of one size that pairing is caught, on every rank, before backward or at the step
# (Notes [Backward on some ranks], [Same units on every rank] in stage3_checks.py); between units of
# different sizes gloo aborts one rank on the size mismatch and the others hang (NCCL: undefined). Units of
# one class held by one ``nn.ModuleList`` or ``nn.ModuleDict`` (the experts of one layer) are therefore
# peers (two Linears that are attributes of one attention module are not: both always run), and the flat
# buffers of peers of different sizes are padded at their end to the largest peer's (FlatBuffer.pad_to:
# zeros, never read, zero gradient): every all-gather and reduce-scatter of a peer is as long as the
# others', and a misrouted step is the clear error above. The cost is the padding's bytes (memory at rest
# and when gathered, and traffic) for the smaller peers only; units that differ in how their parameters are
# split into flat buffers (another number of buffers, or dtypes) are left unpadded.
def pad_peers(units: list[Unit]) -> None:
    """Note [Peer units]: pad the flat buffers of units of one class in one ``ModuleList``/``ModuleDict`` to the
    largest such unit's, buffer by buffer, where their buffer layouts (count, dtype, param group) match."""
    model = next(u.module for u in units if u.is_root)
    peers: dict[tuple[str, str], list[Unit]] = {}
    for unit in units:
        parent = unit.name.rpartition(".")[0]
        if not (unit.is_root or unit.outer or unit.persistent) and "." in unit.name and isinstance(
                model.get_submodule(parent), (nn.ModuleList, nn.ModuleDict)):
            peers.setdefault((parent, type(unit.module).__name__), []).append(unit)
    for group in peers.values():
        layouts = {tuple((b.dtype, b.group_index) for b in u.buffers) for u in group}
        if len(group) < 2 or len(layouts) != 1:
            continue
        for i in range(len(group[0].buffers)):
            longest = max(u.buffers[i].numel for u in group)
            for u in group:
                if u.buffers[i].numel < longest:
                    u.buffers[i].pad_to(longest)


def pick_units(model: nn.Module, entries: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The unit modules of ``model`` (not the root), in module order.

    With ``entries`` (``zero.units``): each is a module's qualified name in ``model`` (``transformer.wte``, as
    FSDP2's ``fully_shard(model.tok_embeddings)``) or a class name (``Block``: every module of that class).
    Without: Note [Automatic units] — modules holding between 1/64 and 1/4 of the parameters, taken from the
    top down (a larger one is split into its children); smaller modules stay in their parent's unit.

    Raises:
        ValueError: an entry names neither a module nor a class of ``model``; one names the model itself.
    """
    if entries:
        named = dict(model.named_modules())
        if "" in entries:
            raise ValueError("zero.units: '' names the whole model, which is the root unit already")
        by_name = {e for e in entries if e in named}
        classes = set(entries) - by_name
        found = [(n, m) for n, m in model.named_modules() if n and (n in by_name or type(m).__name__ in classes)]
        missing = classes - {type(m).__name__ for _, m in found}
        if missing:
            kinds = sorted({type(m).__name__ for m in model.modules()})
            top = [n for n, _ in model.named_children()]
            raise ValueError(f"zero.units: no module of class {', '.join(sorted(missing))} in the model and no module "
                             f"of that name (its classes: {', '.join(kinds)}; its top-level modules: {', '.join(top)})")
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


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def describe_units(units: list[Unit], without_params: list[str] = ()) -> list[str]:
    """What stage 3 gathers and frees, for the run's log: the listed units grouped by class (count, names,
    gathered bytes each), the outer units picked automatically (Note [Outer units] in stage3_outer.py), and
    what stays gathered (the root's own parameters through each forward and backward, the persistent ones
    always), with their bytes (padding included); ``without_params``: modules named or picked as units that own
    no parameter (a weight tied across units belongs to the root: Note [Units] in stage3.py)."""
    by_class: dict[str, list[Unit]] = {}
    for u in units:
        if not (u.is_root or u.outer or u.persistent):
            by_class.setdefault(type(u.module).__name__, []).append(u)
    parts = []
    for cls, group in by_class.items():
        sizes = sorted({u.gathered_bytes for u in group})
        size = _mib(sizes[0]) if len(sizes) == 1 else f"{_mib(sizes[0])}-{_mib(sizes[-1])}"
        names = group[0].name if len(group) == 1 else f"{group[0].name} .. {group[-1].name}"
        parts.append(f"{len(group)} x {cls} ({names}), {size} each")
    lines = [f"stage 3 units, gathered and freed one by one: {'; '.join(parts) or 'none'}"]
    if without_params:
        lines.append(f"stage 3: {', '.join(without_params)} own no parameter of their own (a weight shared with "
                     "modules outside them stays with the root): not units")
    outer = [f"{u.name} {_mib(u.gathered_bytes)}" for u in units if u.outer]
    if outer:
        lines.append(f"stage 3 outer units, picked automatically and gathered on a schedule learned in the first "
                     f"step: {', '.join(outer)} (name a module in zero.units to make it a unit of its own)")
    kept = [f"{'root' if u.is_root else 'persistent'} {_mib(u.gathered_bytes)}" for u in units
            if (u.is_root or u.persistent) and u.buffers]
    if kept:
        lines.append(f"stage 3 parameters that stay gathered: {', '.join(kept)} (root: through each forward and "
                     "backward; persistent: always, zero.persistence_threshold)")
    return lines
