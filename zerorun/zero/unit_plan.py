"""Which modules are stage 3's units (Note [Units] in ``stage3.py``): the listed ones (``zero.units``: classes or
module names, or picked by size), the outer ones (Note [Outer units] in ``stage3_outer.py``), each parameter's
unit, the padding of peer units, and what the run says of them. Nothing here gathers or frees.
"""

from __future__ import annotations

import torch.nn as nn

from zerorun.zero.units import Unit


# Note [Peer units]: all-gathers pair up across ranks in the order they are issued, so a step in which ranks
# run different units (an MoE layer routing each rank's tokens to another expert) pairs one rank's unit with
# another's. Between units gathered alike (the same flat buffers, of the same sizes) that pairing is caught,
# on every rank, before backward or at the step (Notes [Backward on some ranks], [Same units on every rank]
# in stage3_checks.py); between units whose all-gathers differ in size or number, gloo aborts one rank on the
# size mismatch and the others hang (NCCL: undefined). The units held directly by one ``nn.ModuleList`` or
# ``nn.ModuleDict`` (the experts of one layer, whatever their classes) are therefore peers; where the peers'
# flat buffers differ (sizes, how many, dtypes: another width, a bias, a frozen or persistent parameter, a
# bucket split), each peer is gathered in one all-gather of the same number of bytes, the largest peer's
# slices (``Unit.gather_bytes``: its slices copied into a padded message, the result copied out into its
# buffers): a misrouted step is then the clear error above. What it costs those peers (under NCCL; gloo packs
# every unit's gather anyway): one copy of the unit's bytes in and out per gather, the message's bytes while it
# is in flight, and the smaller peers' padding in traffic (``zerorun estimate`` counts it);
# memory at rest is unchanged. Peers gathered alike (a GPT's blocks) send no padding (Note [One all-gather per
# unit]). Units nested deeper (each Linear of each expert a unit) are not peers: name the experts, or their
# container's class, in zero.units.
def match_peers(units: list[Unit]) -> None:
    """Note [Peer units]: set :attr:`Unit.gather_bytes` of the units held directly by one ``ModuleList`` or
    ``ModuleDict`` to the largest one's slice bytes where their flat buffers differ."""
    model = next(u.module for u in units if u.is_root)
    peers: dict[str, list[Unit]] = {}
    for unit in units:
        parent = unit.name.rpartition(".")[0]
        if not (unit.is_root or unit.outer or unit.persistent) and "." in unit.name and isinstance(
                model.get_submodule(parent), (nn.ModuleList, nn.ModuleDict)):
            peers.setdefault(parent, []).append(unit)
    for group in peers.values():
        layouts = {tuple((b.dtype, b.numel) for b in u.buffers) for u in group}
        if len(group) > 1 and len(layouts) > 1:
            most = max(u.slice_bytes for u in group)
            for u in group:
                u.gather_bytes = most


def pick_units(model: nn.Module, entries: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The unit modules of ``model`` (not the root), in module order.

    With ``entries`` (``zero.units``): each is a module's qualified name in ``model`` (``transformer.wte``, as
    FSDP2's ``fully_shard(model.tok_embeddings)``) or a class name (``Block``: every module of that class).
    Without: Note [Automatic units] — modules holding between 1/64 and 1/4 of the parameters, taken from the
    top down (a larger one is split into its children), inside a ``ModuleList``, ``ModuleDict`` or
    ``nn.Sequential`` (a model's repeated blocks, or in one of them); smaller modules stay in their parent's
    unit. Modules outside such containers (a GPT's embeddings and head) are outer units (Note [Outer units]),
    gathered at points every rank reaches: an attribute of the model that some ranks skip (a data-dependent
    branch) was picked as a listed unit, whose all-gathers are paired by use, and hung or aborted the job (a
    review; stages 0-2 trained it as DDP). A model without such containers has the root as its only unit
    (its parameters gathered for the whole pass); name its modules in ``zero.units`` to divide it.

    Raises:
        ValueError: an entry names neither a module nor a class of ``model``; one names the model itself (or its
            class); one names a module that is never called (a ``ModuleList``: no ``forward`` of its own).
    """
    if entries:
        named = dict(model.named_modules())
        own = type(model).__name__
        if "" in entries or (own in entries and not any(type(m).__name__ == own for m in model.modules()
                                                        if m is not model)):
            raise ValueError(f"zero.units: {'' if '' in entries else own!r} names the whole model, which is the root "
                             "unit already")
        by_name = {e for e in entries if e in named}
        classes = set(entries) - by_name
        found = [(n, m) for n, m in model.named_modules() if n and (n in by_name or type(m).__name__ in classes)]
        _check_called(found)
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

    def visit(prefix: str, module: nn.Module, held: bool) -> None:
        held = held or isinstance(module, _CONTAINERS)
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            count = sum(p.numel() for p in child.parameters())
            if (count > high or not _called(child)) and any(True for _ in child.children()):
                visit(full, child, held)
            elif count >= low and _called(child) and held:
                units.append((full, child))

    visit("", model, False)
    return units


#: containers whose modules are automatic units (Note [Automatic units])
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _called(module: nn.Module) -> bool:
    """Whether ``module`` has a ``forward`` of its own (a ``ModuleList``, ``ModuleDict`` or ``ParameterList`` is
    never called: its hooks, which gather a unit, would never run)."""
    return type(module).forward is not nn.Module.forward


def _check_called(found: list[tuple[str, nn.Module]]) -> None:
    """Raises ValueError naming the first of ``found`` that is never called, and the classes inside it."""
    for name, module in found:
        if not _called(module):
            inside = sorted({type(m).__name__ for m in module.children()})
            raise ValueError(f"zero.units: {name!r} is a {type(module).__name__}, which is never called (it has no "
                             f"forward of its own), so it cannot be gathered when it runs: name the class of the "
                             f"modules it holds ({', '.join(inside) or 'none'}) instead")


def outer_modules(model: nn.Module, unit_modules: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Note [Outer units]: the largest modules of ``model`` that hold parameters and neither are, hold nor lie
    inside one of ``unit_modules`` (a GPT's token and position embeddings, final norm and LM head), in module
    order; none when ``unit_modules`` is empty (the root is then the only unit)."""
    if not unit_modules:
        return []
    ids = {id(m) for m in unit_modules}
    found: dict[int, tuple[str, nn.Module]] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if id(child) in ids or id(child) in found:
                continue
            if any(id(m) in ids for m in child.modules()):  # it holds a unit
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


def _mib(nbytes: int) -> str:
    if nbytes < 2**10:
        return f"{nbytes} B"
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _held(unit: Unit) -> str:
    """The parameters ``unit`` holds: the first three names, and how many in all."""
    names = [n for buf in unit.buffers for n in buf.names]
    return f"{', '.join(names[:3])}{f', ... {len(names)} in all' if len(names) > 3 else ''}"


def kept_bytes(units: list[Unit]) -> int:
    """The gathered bytes of the root and the outer units among ``units`` together: what ``zero.keep_root_bytes``
    bounds (Note [Kept from forward to backward] in stage3_outer.py)."""
    return sum(u.gathered_bytes for u in units if u.is_root or u.outer)


def last_listed(units: list[Unit]) -> Unit | None:
    """The model's last listed unit holding parameters (not the root, an outer or the persistent unit), by the
    units' order: the first step's guess of the unit that ends the forward (Note [Kept from forward to backward] in
    stage3_outer.py); None without one."""
    listed = [u for u in units if not (u.is_root or u.outer or u.persistent) and u.buffers]
    return max(listed, key=lambda u: u.index, default=None)


def describe_units(units: list[Unit], without_params: dict[str, list[str]] | None = None,
                   keep_root_bytes: int = 0) -> list[str]:
    """What stage 3 gathers and frees, for the run's log: the listed units grouped by class (count, names,
    gathered bytes each), the outer units picked automatically (Note [Outer units] in stage3_outer.py), and
    what stays gathered (the root's own parameters through each forward and backward, the persistent ones
    always), with their bytes (padding included) and the root's parameters (a weight tied across units belongs to
    the root: Note [Units] in stage3.py); ``without_params``: modules named or picked as units that own no
    parameter, by why (none, persistent, shared); ``keep_root_bytes``: ``zero.keep_root_bytes``, said where the
    root and the outer units fit in it together (Note [Kept from forward to backward] in stage3_outer.py)."""
    by_class: dict[str, list[Unit]] = {}
    for u in units:
        if not (u.is_root or u.outer or u.persistent):
            by_class.setdefault(type(u.module).__name__, []).append(u)
    parts = []
    for cls, group in by_class.items():
        sizes = sorted({u.gathered_bytes for u in group})
        size = _mib(sizes[0]) if len(sizes) == 1 else f"{_mib(sizes[0])}-{_mib(sizes[-1])}"
        names = ", ".join(u.name for u in group) if len(group) <= 3 else f"{group[0].name} .. {group[-1].name}"
        if len(group) > 3 and [u.index for u in group] != list(range(group[0].index, group[-1].index + 1)):
            names = f"{', '.join(u.name for u in group[:3])}, ..."  # not one run: no range
        parts.append(f"{len(group)} x {cls} ({names}), {size} each")
    none = ("none (automatic units come from a ModuleList, ModuleDict or nn.Sequential: the parameters below are "
            "gathered for each whole pass; name modules in zero.units to divide them)")
    lines = [f"stage 3 units, gathered and freed one by one: {'; '.join(parts) or none}"]
    for why, names in (without_params or {}).items():
        lines.append(f"stage 3: {', '.join(names)} own no parameter of their own ({why}): not units")
    outer = [f"{u.name} {_mib(u.gathered_bytes)}" for u in units if u.outer]
    if outer:
        lines.append(f"stage 3 outer units, picked automatically and gathered on a schedule learned in the first "
                     f"step: {', '.join(outer)} (name a module in zero.units to make it a unit of its own)")
    kept = [f"root {_mib(u.gathered_bytes)}, {_held(u)} (through each forward and backward)" if u.is_root else
            f"persistent {_mib(u.gathered_bytes)} (always: zero.persistence_threshold)"
            for u in units if (u.is_root or u.persistent) and u.buffers]
    if kept:
        lines.append(f"stage 3 parameters that stay gathered: {'; '.join(kept)}")
    held = kept_bytes(units)
    if 0 < held <= keep_root_bytes:
        last, said = last_listed(units), ""
        if last is not None:
            unit = f"the last listed in the model's order, {last.name} {_mib(last.gathered_bytes)}"  # not the run's
            fits = held + last.gathered_bytes <= keep_root_bytes  # order, which the first step records (a review)
            said = (f", and so is the unit the forward ends with where it fits with them ({unit})" if fits else
                    f" (the unit the forward ends with too where it fits with them; {unit}, does not)")
        lines.append(f"stage 3: the root and the outer units, {_mib(held)} together, are gathered once per micro-step "
                     f"and kept from each forward into its backward, not on the schedule above{said} "
                     f"(zero.keep_root_bytes {_mib(keep_root_bytes)}; 0 frees them after forward)")
    return lines
