"""The flat-buffer layout ``zerorun estimate`` counts from (Note [What is exact] in ``estimate/__init__.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from zerorun.errors import ZerorunError
from zerorun.estimate.policies import PRECISIONS


#: The stage-3 unit of parameters held whole (``zero.persistence_threshold``; Note [Persistent parameters]).
PERSISTENT = "<persistent>"


# ---------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class UnitCount:
    """A stage-3 unit: its name (``<root>`` for the root), the unpadded numel of each of its flat buffers,
    whether it is an outer unit (Note [Outer units] in zero/stage3_outer.py) and whether it is an embedding
    (``nn.Embedding``: taken to run before the first listed unit, so freed before the peak)."""

    name: str
    trainable: tuple[int, ...]
    frozen: tuple[int, ...] = ()
    outer: bool = False
    embedding: bool = False
    trainable_params: tuple[tuple[int, ...], ...] = ()  # each trainable buffer's parameters' numels (() : one each)
    trainable_bytes: tuple[int, ...] = ()  # bytes per element of each trainable buffer (() : the precision's)
    frozen_bytes: tuple[int, ...] = ()  # of each frozen buffer (one per dtype)
    peers: str = ""  # the ModuleList/ModuleDict holding it among its peers (Note [Peer units] in zero/unit_plan.py)

    @property
    def numel(self) -> int:
        return sum(self.trainable) + sum(self.frozen)

    def nbytes(self, default: int) -> int:
        """Bytes of its parameters (unpadded), ``default`` per element where its buffers' own are not given."""
        trainable = self.trainable_bytes or (default,) * len(self.trainable)
        frozen = self.frozen_bytes or (default,) * len(self.frozen)
        return sum(n * b for n, b in zip(self.trainable + self.frozen, trainable + frozen))


@dataclass(frozen=True)
class Layout:
    """Parameter counts (elements) and the flat buffers the engine builds (Note [What is exact]).

    Attributes:
        total, trainable, frozen: parameters (shared ones counted once).
        buffers: stages 0-2: unpadded numel of each trainable flat buffer.
        frozen_params: stages 0-2: numel of each frozen parameter (held whole, not padded).
        units: stage 3: the units, root last; their buffers are padded and sharded one by one.
        exact: the layout comes from a model (``False``: ``--params``, one buffer of Ψ).
        shape: the model's declared transformer shape (``model.shape``), if any.
        unit_hint: a module class that would make good stage-3 units (:func:`suggest_unit_class`).
        precision: the ``precision`` the buffers were packed for (``None``: ``--params``, no packing).
        buffer_params: stages 0-2: the numel of each parameter of each trainable flat buffer (``()``: each
            buffer one parameter); the optimizer steps each rank's part of each one (Note [Unused parameters]).
        buffer_bytes, frozen_bytes: stages 0-2: bytes per element of each trainable flat buffer and of each
            frozen parameter, as the engine holds them (``()``: the precision's): 8 for a float64 one (Note
            [Wide parameters] in zero/precision.py), an integer parameter's own.
        keep_root_bytes: stage 3's ``zero.keep_root_bytes`` (Note [Kept from forward to backward] in
            zero/stage3_outer.py): the root and the outer units, when their gathered bytes together are at most
            this, are gathered once per micro-step, and the last listed unit too where it fits with them
            (``estimate.hierarchy.kept_units``); 0: twice.
    """

    total: int
    trainable: int
    frozen: int
    buffers: tuple[int, ...]
    frozen_params: tuple[int, ...]
    units: tuple[UnitCount, ...]
    exact: bool = True
    shape: dict | None = None
    unit_hint: str | None = None
    precision: str | None = None
    buffer_params: tuple[tuple[int, ...], ...] = ()
    buffer_bytes: tuple[int, ...] = ()
    frozen_bytes: tuple[int, ...] = ()
    keep_root_bytes: int = 0

    @property
    def listed_units(self) -> list[UnitCount]:
        """The listed stage-3 units (not the root, an outer or the persistent unit), in the model's order."""
        return [u for u in self.units if u.name not in ("<root>", PERSISTENT) and not u.outer]

    @property
    def largest_unit(self) -> UnitCount | None:
        """The listed stage-3 unit of the most bytes (a float64 unit holds twice a float32 one of as many
        elements), or ``None``."""
        inner = self.listed_units
        default = PRECISIONS[self.precision or "fp32"].param_bytes
        return max(inner, key=lambda u: u.nbytes(default)) if inner else None


def layout_of(model, *, bucket_mb: float = 25.0, units: tuple[str, ...] = (), weight_decay: float = 0.0,
              decay_1d: bool = False, precision: str = "fp32", persistence_threshold: int = 0,
              keep_root_bytes: int | None = None) -> Layout:
    """The :class:`Layout` the engine builds for ``model`` (any device, meta included) with the worker's param
    groups (``default_param_groups``), ``bucket_mb`` buffers and stage-3 ``units`` (empty: picked by size), at
    ``precision``: the engine casts floating-point parameters to it before packing, so ``bucket_mb`` counts
    elements of that size (``model`` itself is not changed); float64 ones stay and are packed apart (Note [Wide
    parameters] in zero/precision.py). Stage 3: parameters of at most
    ``persistence_threshold`` elements form the unit ``PERSISTENT``, held whole (Note [Persistent parameters]);
    ``keep_root_bytes``: ``zero.keep_root_bytes`` (``None``: its default).

    Raises:
        ValueError: a name in ``units`` matches no module class (from ``pick_units``); a parameter is complex,
            which the engine refuses (``refuse_complex``).
    """
    import torch

    from zerorun.zero.config import KEEP_ROOT_BYTES
    from zerorun.zero.engine import default_param_groups
    from zerorun.zero.flat import pack as pack_params
    from zerorun.zero.precision import DTYPES, compute_dtype, refuse_complex
    from zerorun.zero.unit_plan import outer_modules, pick_units, unit_of_params

    refuse_complex(model)  # Note [Wide parameters] in zero/precision.py: as the run refuses it

    names = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        names[p] = (i, name)
    dtype = DTYPES[precision]
    as_cast = {p: torch.empty(p.shape, dtype=compute_dtype(p.dtype, dtype), device="meta") for p in names}

    def pack(named, bucket_bytes):  # Note [Mixed precision]: runs of the cast parameters (numel is what counts)
        return pack_params([(name, as_cast[p]) for name, p in named], bucket_bytes)

    bucket_bytes = int(bucket_mb * 2**20)
    groups = default_param_groups(model, weight_decay, decay_1d)
    unit_modules = pick_units(model, tuple(units))
    outer = outer_modules(model, [m for _, m in unit_modules])  # Note [Outer units] in zero/stage3_outer.py
    unit_index = unit_of_params(model, [m for _, m in unit_modules], [m for _, m in outer])
    for p in unit_index:  # Note [Persistent parameters] in zero/stage3.py
        if p.numel() <= persistence_threshold:
            unit_index[p] = -2
    def runs(named, bucket_bytes):  # each run's parameters' numels, and its bytes per element
        return [(tuple(p.numel() for _, p in run), run[0][1].element_size()) for run in pack(named, bucket_bytes)]

    flat: list[tuple[tuple[int, ...], int]] = []  # each buffer's parameters' numels, its bytes per element
    per_unit: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    for group in groups:
        named = sorted(((names[p][1], p) for p in group["params"]), key=lambda np_: names[np_[1]][0])
        flat += runs(named, bucket_bytes)
        for u, params in _by_unit(named, unit_index).items():
            per_unit.setdefault(u, []).extend(runs(params, bucket_bytes))
    frozen = [p for p in names if not p.requires_grad]
    frozen_by_unit = {u: [(sum(r), b) for r, b in runs(ps, float("inf"))]  # stage 3: one buffer per unit and dtype
                      for u, ps in _by_unit([(names[p][1], p) for p in frozen], unit_index).items()}
    indexed = [(i, name) for i, (name, _) in enumerate(unit_modules + outer)] + [(-1, "<root>"), (-2, PERSISTENT)]
    modules = [m for _, m in unit_modules + outer]
    parents = {i: name.rpartition(".")[0] for i, name in indexed if 0 <= i < len(unit_modules) and "." in name}
    lists = (torch.nn.ModuleList, torch.nn.ModuleDict)
    peers = {i: p for i, p in parents.items() if isinstance(model.get_submodule(p), lists)}
    counted = [UnitCount(name, tuple(sum(b) for b, _ in per_unit.get(i, ())),
                         tuple(n for n, _ in frozen_by_unit.get(i, ())), outer=i >= len(unit_modules),
                         embedding=i >= 0 and isinstance(modules[i], torch.nn.Embedding),
                         trainable_params=tuple(b for b, _ in per_unit.get(i, ())),
                         trainable_bytes=tuple(e for _, e in per_unit.get(i, ())),
                         frozen_bytes=tuple(e for _, e in frozen_by_unit.get(i, ())), peers=peers.get(i, ""))
               for i, name in indexed]
    total = sum(p.numel() for p in names)
    trainable = sum(sum(b) for b, _ in flat)
    shape = getattr(model, "shape", None)
    hint = suggest_unit_class(model)
    return Layout(unit_hint=hint, total=total, trainable=trainable, frozen=total - trainable,
                  buffers=tuple(sum(b) for b, _ in flat), frozen_params=tuple(p.numel() for p in frozen),
                  units=tuple(u for u in counted if u.numel),
                  exact=True, shape=dict(shape) if isinstance(shape, dict) else None, precision=precision,
                  buffer_params=tuple(b for b, _ in flat), buffer_bytes=tuple(e for _, e in flat),
                  frozen_bytes=tuple(as_cast[p].element_size() for p in frozen),
                  keep_root_bytes=KEEP_ROOT_BYTES if keep_root_bytes is None else keep_root_bytes)


def _by_unit(named: list, unit_index: dict) -> dict[int, list]:
    """``named`` (``(name, parameter)`` pairs, in order) grouped by each parameter's unit index."""
    out: dict[int, list] = {}
    for name, p in named:
        out.setdefault(unit_index[p], []).append((name, p))
    return out


def suggest_unit_class(model) -> str | None:
    """A module class whose instances would make good stage-3 units: together they hold at least half of the
    parameters, each at most a quarter; the largest such instances win (a transformer block rather than its
    linear layers). ``None`` if no class qualifies."""
    total = sum(p.numel() for p in model.parameters())
    by_class: dict[str, list[int]] = {}
    for m in model.modules():
        if m is not model and type(m).__name__ not in ("ModuleList", "Sequential", "ModuleDict"):
            by_class.setdefault(type(m).__name__, []).append(sum(p.numel() for p in m.parameters()))
    good = [(max(sizes), name) for name, sizes in by_class.items()
            if sum(sizes) >= total / 2 and max(sizes) <= total / 4 and len(sizes) > 1]
    return max(good)[1] if good else None


def layout_of_count(params: int, largest_layer: int | None = None) -> Layout:
    """A :class:`Layout` from a parameter count alone (``--params``): one flat buffer of ``params`` elements; the
    largest layer, if given, is the stage-3 unit gathered (twice, with prefetch)."""
    units = (UnitCount("<largest layer>", (largest_layer,)),) if largest_layer else ()
    return Layout(total=params, trainable=params, frozen=0, buffers=(params,), frozen_params=(), units=units,
                  exact=False)


def layout_of_recipe(recipe, precision: str | None = None) -> Layout:
    """Build ``recipe``'s model on the meta device (no parameter memory) and return its :class:`Layout` at
    ``precision`` (default: the recipe's).

    Raises:
        ZerorunError: the model module or factory fails, or ``zero.units`` names no module class.
    """
    import torch

    from zerorun.rank.userload import build_model

    with torch.device("meta"):
        model = build_model(*recipe.model.source())
    opt = recipe.train.optimizer
    try:
        return layout_of(model, bucket_mb=recipe.zero.bucket_mb, units=tuple(recipe.zero.units),
                         weight_decay=opt.weight_decay, decay_1d=opt.decay_1d,
                         precision=precision or recipe.precision,
                         persistence_threshold=recipe.zero.persistence_threshold,
                         keep_root_bytes=recipe.zero.keep_root_bytes)
    except ValueError as e:
        raise ZerorunError(f"recipe: {e}") from None
