"""``zerorun estimate``: memory per rank and communication per step for every ZeRO stage, before launching.

Pure arithmetic over parameter counts (DESIGN.md): the model is built on the meta device (no memory, any
size) only to count its parameters and lay them out the way the engine will.

Note [What is exact]: model-state bytes per rank (parameters, gradients, optimizer states) are predicted from
the same flat-buffer layout the engine builds (``zero/flat.py`` ``pack``, ``zero/stage3.py`` ``pick_units`` and
``unit_of_params``, ``zero/engine.py`` ``default_param_groups``): one buffer per run of at most ``bucket_mb`` of a
param group (stage 3: per unit), each padded to a multiple of the world size N, a rank holding 1/N of it where
the stage partitions. They equal ``ZeroEngine.memory_bytes()`` and ``offload_bytes()`` (tests/test_estimate.py)
for every precision and ``zero.offload_optimizer``:

- fp32: parameters and gradients 4 bytes; without offload the parameters are their own master (optimizer =
  the states only: fp32 Adam 4Ψ + 4Ψ + 8Ψ, divided by the stage).
- bf16/fp16 (Note [Mixed precision] in ``zero/precision.py``; ZeRO paper §5): parameters and gradients 2
  bytes, and the buffers are packed in 2-byte elements (a ``bucket_mb`` bucket holds twice as many); the
  optimizer keeps an fp32 master of its slice beside the states (Adam: 2Ψ + 2Ψ + 12Ψ with K = 12 = master 4 +
  momentum 4 + variance 4). ``zero.reduce_dtype: fp32`` makes the stage 2-3 gradient slices, and every
  gradient collective, 4 bytes.
- ``offload_optimizer: cpu`` (``zero/offload.py`` ``CpuMasters``): a separate fp32 master always (fp32
  included) plus the states, in host memory (``offload_bytes()["host"]``) on an accelerator; on a CPU-only
  machine the host is the device and they stay in ``memory_bytes()["optimizer"]``.
- ``disk`` (``DiskMasters``): nothing in device memory; a host buffer of ``offload_buffer_mb`` and, per
  rank, a swap file holding master and states of each sub-group (Note [Disk paging]), each region rounded up
  to 64 bytes.

Communication per rank per step counts bytes sent as ``zero/comm.py`` does (ring algorithms: reduce-scatter
and all-gather send (N-1)/N of the buffer, all-reduce twice that; ZeRO paper §7: 2Ψ elements for stages 0-2,
3Ψ for stage 3). Without a recipe (``--params``), the layout is one buffer of Ψ elements.

Note [What is approximate]: the working set stage 3 adds (the root unit, which stays gathered through forward
and backward, plus the largest unit being computed and the next one being prefetched), the full gradient
buckets stages 2-3 hold while their reduce-scatters are in flight, and activations (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", §4, generalized to the element size and to
models without dropout); host memory for cpu offload on an accelerator (the masters and states plus the pinned
copies of every gradient and parameter slice its step stages). Not counted: the Python/torch runtime (about
0.3-0.5 GiB per process on CPU), the allocator's cache and fragmentation, activation gradients during backward,
communication buffers.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from zerorun.errors import ZerorunError

#: A stage fits when its device total leaves at least this fraction of the device memory free.
MIN_HEADROOM = 0.10
#: The stage-3 unit of parameters held whole (``zero.persistence_threshold``; Note [Persistent parameters]).
PERSISTENT = "<persistent>"
#: Full bucket gradients held at once at stages 2-3 (``ZeroEngine.MAX_INFLIGHT + 1``, Note [Gradient buffer pool]
#: in zero/engine.py): all of them may be in flight.
INFLIGHT_BUCKETS = 2 + 1

# Note [Peak]: a rank's memory peaks either at the end of forward (model states, all activations, at stage 3
# the gathered units) or during backward, where activations are freed as gradient buckets fill and wait for
# their reduce-scatters. The estimate is model states + gathered units + max(activations, backward transients)
# (benchmarks/estimate_vs_measured.py: stage 1 on gloo, whose pending reduce-scatters each hold a receive buffer
# the size of their bucket, peaks at the end of backward once activations are smaller than the gradients).

# ------------------------------------------------------------------------------------------------- sizes
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*")  # fullmatch
_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_BIT_PREFIX = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _split(text: str, flag: str, example: str) -> tuple[float, str]:
    m = _NUMBER.fullmatch(str(text))
    if not m:
        raise ZerorunError(f"{flag}: cannot read {text!r}: expected a number with a unit, e.g. {example}")
    value = float(m.group(1))
    if not math.isfinite(value) or value > 1e30:  # 1e400 parses as inf; no model, memory or link is that big
        raise ZerorunError(f"{flag}: {text!r} is too large")
    return value, m.group(2)


def parse_count(text: str, flag: str = "--params") -> int:
    """A count such as ``7B``, ``350M``, ``1.5K`` or ``1000`` (decimal prefixes: K 1e3, M 1e6, B/G 1e9, T 1e12).

    Raises:
        ZerorunError: not a positive count; the message names ``flag``.
    """
    return _scaled(text, flag, _COUNT_UNITS, "7B, 350M", "a positive count such as 7B, 350M or 125000")


def parse_bytes(text: str, flag: str = "--device-memory") -> int:
    """A size in bytes: ``80GiB`` (binary: KiB, MiB, GiB, TiB), ``80GB`` (decimal: KB, MB, GB, TB) or bytes.

    Raises:
        ZerorunError: not a positive size; the message names ``flag``.
    """
    return _scaled(text, flag, _BYTE_UNITS, "80GiB, 80GB", "a positive size such as 80GiB, 80GB or 512MiB")


def _scaled(text: str, flag: str, units: dict[str, float], example: str, expected: str) -> int:
    value, unit = _split(text, flag, example)
    mult = units.get(unit.upper())
    if mult is None or value <= 0 or round(value * mult) < 1:
        raise ZerorunError(f"{flag}: cannot read {text!r}: expected {expected}")
    return int(round(value * mult))


def parse_bandwidth(text: str, flag: str = "--bandwidth") -> float:
    """A link speed per rank: bits per second (``100Gbps``, ``400Mbps``) or bytes per second (``12.5GB/s``,
    ``10GiB/s``). Returns bytes per second (float).

    Raises:
        ZerorunError: not a positive speed; the message names ``flag``.
    """
    value, unit = _split(text, flag, "100Gbps, 12.5GB/s")
    u = unit.upper()
    mult = None
    if u.endswith("BPS") and unit[-3] == "b":  # bits: Gbps
        prefix = _BIT_PREFIX.get(u[:-3])
        mult = prefix / 8 if prefix else None
    elif u.endswith("/S"):
        mult = _BYTE_UNITS.get(u[:-2]) if u[:-2] else None
    if mult is None or value <= 0:
        raise ZerorunError(f"{flag}: cannot read {text!r}: expected a positive speed such as 100Gbps or 12.5GB/s")
    return value * mult


def format_bytes(n: float) -> str:
    """``n`` bytes with a binary unit: ``'1.50 GiB'``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_count(n: int) -> str:
    """``n`` elements with a decimal suffix: ``'7.50B'``, ``'54.7M'``."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


# -------------------------------------------------------------------------------------- policies
@dataclass(frozen=True)
class Precision:
    """Bytes per element of what a rank holds (ZeRO paper §5; Note [Mixed precision] in ``zero/precision.py``).

    Attributes:
        name: ``precision`` (fp32, bf16, fp16): the dtype the engine casts the model to before packing it.
        param_bytes: the parameters the model computes with (fp32 4, bf16/fp16 2).
        grad_bytes: their gradients as backward writes them (stages 0-1 keep them whole in this dtype).
        master_bytes: the fp32 master copy kept with the optimizer states without offload (0 when the
            parameters are fp32: they are their own master).
        activation_bytes: activations (the compute dtype).
        reduce_bytes: gradients as they are reduced and kept as slices at stages 2-3 (``zero.reduce_dtype:
            fp32``: 4; else ``grad_bytes``).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    activation_bytes: int
    reduce_bytes: int

    @property
    def label(self) -> str:
        """``name``, with ``" (reduce fp32)"`` when gradients are reduced wider than they are computed."""
        return self.name + (" (reduce fp32)" if self.reduce_bytes > self.grad_bytes else "")


PRECISIONS = {"fp32": Precision("fp32", 4, 4, 0, 4, 4), "bf16": Precision("bf16", 2, 2, 4, 2, 2),
              "fp16": Precision("fp16", 2, 2, 4, 2, 2)}
#: ``zero.offload_optimizer`` values, and ``all`` (every variant the machine supports).
OFFLOADS = ("none", "cpu", "disk", "all")


def precision_of(name: str, reduce_dtype: str | None = None, flag: str = "--precision") -> Precision:
    """The :class:`Precision` of ``precision: name`` with ``zero.reduce_dtype`` (``None`` or ``"fp32"``).

    Raises:
        ZerorunError: ``name`` is not fp32, bf16 or fp16; the message names ``flag``.
    """
    if name not in PRECISIONS:
        raise ZerorunError(f"{flag}: {name!r} is not one of fp32, bf16, fp16")
    p = PRECISIONS[name]
    return replace(p, reduce_bytes=4) if reduce_dtype == "fp32" else p


@dataclass(frozen=True)
class OptimizerModel:
    """What an optimizer keeps per element of the tensors it updates.

    Attributes:
        states: fp32 state tensors of the parameter's size (Adam: ``exp_avg``, ``exp_avg_sq``: 2; SGD with
            momentum: 1).
        scalar_bytes: bytes of scalar state tensors per updated tensor (Adam's ``step``: a float32 scalar, 4),
            one per flat buffer; counted only where the layout is known.
    """

    name: str
    states: int
    scalar_bytes: int


def optimizer_model(name: str, kwargs: dict[str, Any] | None = None, flag: str = "--optimizer") -> OptimizerModel:
    """The :class:`OptimizerModel` of a ``torch.optim`` optimizer ``name`` (or ``adam``, ``sgd``, ``none``) with
    its keyword arguments (``momentum``, ``amsgrad``, ``centered`` change the state count).

    Raises:
        ZerorunError: an optimizer whose states are not modelled; the message names ``flag``.
    """
    kw = kwargs or {}
    key = name.lower()
    if key == "none":
        return OptimizerModel(name, 0, 0)
    if key in ("adam", "adamw"):
        return OptimizerModel(name, 3 if kw.get("amsgrad") else 2, 4)
    if key in ("radam", "adamax", "adadelta"):
        return OptimizerModel(name, 2, 4)
    if key == "nadam":
        return OptimizerModel(name, 2, 8)  # step and mu_product
    if key == "rprop":
        return OptimizerModel(name, 2, 4)
    if key == "adagrad":
        return OptimizerModel(name, 1, 4)
    if key == "rmsprop":
        return OptimizerModel(name, 1 + bool(kw.get("momentum")) + bool(kw.get("centered")), 4)
    if key == "sgd":
        return OptimizerModel(name, 1 if kw.get("momentum", 0.9 if name == "sgd" else 0) else 0, 0)
    raise ZerorunError(f"{flag}: no memory model for optimizer {name!r}; use adam, sgd, none or one of "
                       "Adam, AdamW, NAdam, RAdam, Adamax, Adadelta, Adagrad, RMSprop, Rprop, SGD")


# ---------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class UnitCount:
    """A stage-3 unit: its name (``<root>`` for the root) and the unpadded numel of each of its flat buffers."""

    name: str
    trainable: tuple[int, ...]
    frozen: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return sum(self.trainable) + sum(self.frozen)


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

    @property
    def largest_unit(self) -> UnitCount | None:
        """The largest non-root stage-3 unit, or ``None``."""
        inner = [u for u in self.units if u.name not in ("<root>", PERSISTENT)]
        return max(inner, key=lambda u: u.numel) if inner else None


def layout_of(model, *, bucket_mb: float = 25.0, units: tuple[str, ...] = (), weight_decay: float = 0.0,
              decay_1d: bool = False, precision: str = "fp32", persistence_threshold: int = 0) -> Layout:
    """The :class:`Layout` the engine builds for ``model`` (any device, meta included) with the worker's param
    groups (``default_param_groups``), ``bucket_mb`` buffers and stage-3 ``units`` (empty: picked by size), at
    ``precision``: the engine casts floating-point parameters to it before packing, so ``bucket_mb`` counts
    elements of that size (``model`` itself is not changed). Stage 3: parameters of at most
    ``persistence_threshold`` elements form the unit ``PERSISTENT``, held whole (Note [Persistent parameters]).

    Raises:
        ValueError: a name in ``units`` matches no module class (from ``pick_units``).
    """
    import torch

    from zerorun.zero.engine import default_param_groups
    from zerorun.zero.flat import pack as pack_params
    from zerorun.zero.precision import DTYPES
    from zerorun.zero.stage3 import pick_units, unit_of_params

    names = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        names[p] = (i, name)
    dtype = DTYPES[precision]
    as_cast = {p: torch.empty(p.shape, dtype=dtype, device="meta") if p.is_floating_point() else p for p in names}

    def pack(named, bucket_bytes):  # Note [Mixed precision]: runs of the cast parameters (numel is what counts)
        return pack_params([(name, as_cast[p]) for name, p in named], bucket_bytes)

    bucket_bytes = int(bucket_mb * 2**20)
    groups = default_param_groups(model, weight_decay, decay_1d)
    unit_modules = pick_units(model, tuple(units))
    unit_index = unit_of_params(model, [m for _, m in unit_modules])
    for p in unit_index:  # Note [Persistent parameters] in zero/stage3.py
        if p.numel() <= persistence_threshold:
            unit_index[p] = -2
    flat: list[int] = []
    per_unit: dict[int, list[int]] = {}
    for group in groups:
        named = sorted(((names[p][1], p) for p in group["params"]), key=lambda np_: names[np_[1]][0])
        flat += [sum(p.numel() for _, p in run) for run in pack(named, bucket_bytes)]
        by_unit: dict[int, list] = {}
        for name, p in named:
            by_unit.setdefault(unit_index[p], []).append((name, p))
        for u, params in by_unit.items():
            per_unit.setdefault(u, []).extend(sum(p.numel() for _, p in run) for run in pack(params, bucket_bytes))
    frozen = [p for p in names if not p.requires_grad]
    frozen_by_unit: dict[int, int] = {}
    for p in frozen:
        frozen_by_unit[unit_index[p]] = frozen_by_unit.get(unit_index[p], 0) + p.numel()
    indexed = [(i, name) for i, (name, _) in enumerate(unit_modules)] + [(-1, "<root>"), (-2, PERSISTENT)]
    counted = [UnitCount(name, tuple(per_unit.get(i, ())), (frozen_by_unit[i],) if i in frozen_by_unit else ())
               for i, name in indexed]
    total = sum(p.numel() for p in names)
    trainable = sum(flat)
    shape = getattr(model, "shape", None)
    hint = suggest_unit_class(model)
    return Layout(unit_hint=hint, total=total, trainable=trainable, frozen=total - trainable, buffers=tuple(flat),
                  frozen_params=tuple(p.numel() for p in frozen), units=tuple(u for u in counted if u.numel),
                  exact=True, shape=dict(shape) if isinstance(shape, dict) else None, precision=precision)


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

    from zerorun.userload import build_model

    with torch.device("meta"):
        model = build_model(*recipe.model.source())
    opt = recipe.train.optimizer
    try:
        return layout_of(model, bucket_mb=recipe.zero.bucket_mb, units=tuple(recipe.zero.units),
                         weight_decay=opt.weight_decay, decay_1d=opt.decay_1d,
                         precision=precision or recipe.precision,
                         persistence_threshold=recipe.zero.persistence_threshold)
    except ValueError as e:
        raise ZerorunError(f"recipe: {e}") from None


# ------------------------------------------------------------------------------------------ activations
def activation_bytes(shape: dict, *, micro_batch: int, seq_len: int | None = None, element_bytes: int = 4,
                     dropout: float | None = None) -> dict[str, int]:
    """Activation memory of one micro-batch of a GPT-style decoder (Korthikanti et al. 2022, §4).

    The paper's per-layer count, ``s·b·h·(34 + 5·a·s/h)`` bytes (16-bit activations, 1-byte dropout masks), is
    generalized to ``e`` bytes per element and ``d`` = 1 byte per dropout mask (0 without dropout):
    attention ``s·b·h·(5e + d) + a·s²·b·(e + [dropout](d + e))``, MLP ``s·b·h·(9e + d)``, two LayerNorms
    ``2·s·b·h·e``. Output layer (§4.3): final LayerNorm and LM-head inputs ``2·s·b·h·e``, logits and fp32
    log-softmax ``s·b·V·(e + 4)``; embedding dropout mask ``s·b·h·d``. Full activation checkpointing (one
    checkpoint per layer, §4.4) keeps each layer's input, ``s·b·h·e`` per layer, and recomputes one layer at a
    time.

    Args:
        shape: ``{"n_layer", "d_model", "n_head", "seq_len", "vocab_size"}`` (and optionally ``dropout``, and
            ``fused_attention``, which :func:`estimate` reads: the scores are not kept).
        micro_batch: samples per micro-batch ``b``; seq_len: tokens ``s`` (default ``shape["seq_len"]``).

    Returns:
        Bytes: ``per_layer`` and ``attention_scores`` (the ``a·s²·b`` part of it, which fused attention kernels
        such as ``F.scaled_dot_product_attention``'s flash kernel do not store), ``output``, ``total`` (no
        checkpointing), ``checkpointed``, and ``total_fused`` / ``checkpointed_fused`` without the scores.

    Raises:
        KeyError: ``shape`` lacks a key.
    """
    L, h, a, V = (int(shape[k]) for k in ("n_layer", "d_model", "n_head", "vocab_size"))
    s, b, e = int(seq_len or shape["seq_len"]), micro_batch, element_bytes
    drop = float(dropout if dropout is not None else shape.get("dropout", 0.0)) > 0
    d = 1 if drop else 0
    sbh = s * b * h
    scores = a * s * s * b * (e + (d + e if drop else 0))
    per_layer = sbh * (16 * e + 2 * d) + scores
    output = 2 * sbh * e + s * b * V * (e + 4) + sbh * d
    out = {"per_layer": per_layer, "attention_scores": scores, "output": output,
           "total": L * per_layer + output, "checkpointed": L * sbh * e + per_layer + output}
    out["total_fused"] = out["total"] - L * scores
    out["checkpointed_fused"] = out["checkpointed"] - scores
    return out


# ------------------------------------------------------------------------------------------- per stage
def _pad(n: int, world_size: int) -> int:
    return math.ceil(n / world_size) * world_size


def _stage_buffers(layout: Layout, stage: int) -> tuple[list[int], list[int]]:
    """Unpadded numels of the trainable flat buffers and of the frozen tensors the engine holds at ``stage``
    (stage 3: per unit, frozen ones in one flat buffer per unit; stages 0-2: frozen parameters whole)."""
    if stage == 3 and layout.exact:
        return [n for u in layout.units for n in u.trainable], [n for u in layout.units for n in u.frozen]
    return list(layout.buffers), list(layout.frozen_params)


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes one rank holds at rest: ``params``, ``grads``, ``optimizer`` (in device memory) are
    ``ZeroEngine.memory_bytes()``'s keys; ``host`` and ``disk`` (optimizer bytes offloaded) are
    ``ZeroEngine.offload_bytes()``'s."""

    params: int
    grads: int
    optimizer: int
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        """Bytes in device memory: parameters + gradients + optimizer."""
        return self.params + self.grads + self.optimizer


def _optimizer_slices(layout: Layout, stage: int, world_size: int) -> list[int]:
    """Numel of each tensor this rank's optimizer updates: one per trainable flat buffer, the whole padded
    buffer at stage 0, this rank's slice above (``ZeroEngine._param_slice``)."""
    padded = [_pad(n, world_size) for n in _stage_buffers(layout, stage)[0]]
    return padded if stage == 0 else [n // world_size for n in padded]


def model_states(layout: Layout, stage: int, world_size: int, precision: Precision, optimizer: OptimizerModel,
                 offload: str = "none", *, buffer_mb: float = 64.0, device_is_host: bool = False) -> ModelStates:
    """Bytes of parameters, gradients and optimizer states per rank at ``stage`` on ``world_size`` ranks
    (Note [What is exact]; ZeRO paper §5: stage 1 partitions optimizer states, 2 also gradients, 3 also
    parameters). The optimizer's bytes include the fp32 master copy where it is separate from the parameters
    (mixed precision; ``cpu`` offload always).

    Args:
        offload: ``zero.offload_optimizer``: ``none``, ``cpu`` or ``disk``.
        buffer_mb: ``zero.offload_buffer_mb`` (``disk``: the host buffer the states are paged through, MiB).
        device_is_host: a CPU-only machine: ``cpu`` offload's masters and states count as ``optimizer``
            (the engine's "device" is the host), else as ``host``.

    Raises:
        ValueError: ``stage`` not in 0-3, ``world_size`` < 1, an unknown ``offload``, or ``layout`` packed for
            another precision.
        ZerorunError: ``disk`` with a ``buffer_mb`` too small to page 16 elements (names
            ``zero.offload_buffer_mb``).
    """
    if stage not in (0, 1, 2, 3) or world_size < 1 or offload not in OFFLOADS[:3]:
        raise ValueError(f"stage must be 0-3, world_size >= 1 and offload none, cpu or disk, got {stage}, "
                         f"{world_size}, {offload!r}")
    if layout.precision not in (None, precision.name):
        raise ValueError(f"the layout was packed for {layout.precision}, not {precision.name}")
    N = world_size
    trainable, frozen = _stage_buffers(layout, stage)
    padded = [_pad(n, N) for n in trainable]
    shards = [n // N for n in padded]
    if stage == 3:
        params = (sum(shards) + sum(_pad(n, N) // N for n in frozen)) * precision.param_bytes
        params += sum(_pad(n, N) for u in layout.units if u.name == PERSISTENT  # whole as well as sliced
                      for n in u.trainable + u.frozen) * precision.param_bytes
    else:
        params = (sum(padded) + sum(frozen)) * precision.param_bytes
    grads = sum(padded) * precision.grad_bytes if stage < 2 else sum(shards) * precision.reduce_bytes
    slices = _optimizer_slices(layout, stage, N)
    states = 4 * optimizer.states * sum(slices)
    scalars = (optimizer.scalar_bytes if layout.exact else 0) * len(slices)  # one per optimizer tensor
    if offload == "none":
        return ModelStates(params, grads, states + scalars + precision.master_bytes * sum(slices))
    if offload == "cpu":  # CpuMasters: never aliased, so an fp32 master even at fp32
        held = states + scalars + 4 * sum(slices)
        return ModelStates(params, grads, held) if device_is_host else ModelStates(params, grads, 0, host=held)
    from zerorun.zero.offload import subgroup_elements, swap_region_bytes

    chunk = subgroup_elements(int(buffer_mb * 2**20), optimizer.states)
    if chunk < 16:
        raise ZerorunError(f"zero.offload_buffer_mb: {buffer_mb} MiB cannot page even 16 elements of master and "
                           f"{optimizer.states} optimizer state tensors twice")
    regions = 1 + optimizer.states  # the master and each state, per sub-group (Note [Disk paging])
    disk = 0
    for n in slices:
        full, rest = divmod(n, chunk)
        disk += regions * (full * swap_region_bytes(4 * chunk) + (swap_region_bytes(4 * rest) if rest else 0))
    return ModelStates(params, grads, 0, host=2 * chunk * 4 * regions, disk=disk)


@dataclass(frozen=True)
class WorkingSet:
    """Transient bytes per rank above the model states at rest (Note [Peak]).

    Attributes:
        gathered: stage 3: the gathered parameters (the root unit, the largest unit and, with prefetch, the
            next largest), present while activations are.
        backward: gradient buckets in flight (stages 2-3: ``INFLIGHT_BUCKETS`` of the largest) plus, on gloo,
            the receive buffer of each pending reduce-scatter (Note [Reduce-scatter on gloo] in zero/comm.py;
            stage 1: every bucket, reduced all at once at the end of backward; stages 2-3: up to
            ``INFLIGHT_BUCKETS``).
    """

    gathered: int
    backward: int

    @property
    def total(self) -> int:
        return self.gathered + self.backward


def working_set(layout: Layout, stage: int, world_size: int, precision: Precision, *,
                bucket_mb: float = 25.0, prefetch: bool = True, gloo: bool = False) -> WorkingSet:
    """The :class:`WorkingSet` of ``stage`` on ``world_size`` ranks (Note [What is approximate]); ``gloo``: the
    collectives run on gloo (CPU), where each pending reduce-scatter holds a receive buffer of its input's size
    (Note [Reduce-scatter on gloo] in zero/comm.py; gloo's own reduce-scatter held a staging copy of the same
    size: 10 pending reduce-scatters of 19 MiB held 197 MiB; all-gathers 35 MiB; all-reduce nothing).
    Under ``zero.reduce_dtype: fp32`` with 2-byte gradients, stage 0 keeps each bucket's reduced fp32 copy until
    the step, and stage 1 reduces fp32 copies of its buckets, bounded as stage 2 is, keeping the fp32 slices."""
    N = world_size
    bufs = _stage_buffers(layout, stage)[0]
    wide = precision.reduce_bytes > precision.grad_bytes
    if stage == 0 or world_size == 1:
        return WorkingSet(0, sum(_pad(n, N) for n in bufs) * precision.reduce_bytes if wide and stage == 0 else 0)
    if layout.exact:
        largest = sorted((_pad(n, N) for n in bufs), reverse=True)
    else:  # one buffer of Ψ: the engine would cut it into buckets of bucket_mb
        largest = [min(_pad(bufs[0], N), int(bucket_mb * 2**20) // precision.param_bytes)] * INFLIGHT_BUCKETS
    if stage == 1 and not wide:  # the full gradients are model states
        staged = (sum(_pad(n, N) for n in bufs) if layout.exact else _pad(bufs[0], N)) if gloo else 0
        backward = staged * precision.grad_bytes
    else:
        held = sum(largest[:INFLIGHT_BUCKETS])
        staged = sum(largest[:INFLIGHT_BUCKETS]) if gloo else 0
        kept = sum(_pad(n, N) // N for n in bufs) if stage == 1 else 0
        backward = (held + staged + kept) * precision.reduce_bytes
    if stage < 3:
        return WorkingSet(0, backward)
    if not layout.exact:
        return WorkingSet(sum(u.numel for u in layout.units) * (2 if prefetch else 1) * precision.param_bytes,
                          backward)
    sizes = sorted((sum(_pad(n, N) for n in u.trainable + u.frozen) for u in layout.units
                    if u.name not in ("<root>", PERSISTENT)),
                   reverse=True)
    root = sum(sum(_pad(n, N) for n in u.trainable + u.frozen) for u in layout.units if u.name == "<root>")
    return WorkingSet((root + sum(sizes[:2 if prefetch else 1])) * precision.param_bytes, backward)


def comm_bytes(layout: Layout, stage: int, world_size: int, precision: Precision, grad_accum_steps: int = 1) -> int:
    """Bytes one rank sends per optimizer step, as ``zero/comm.py`` counts them (ring: (N-1)/N of a buffer per
    reduce-scatter or all-gather, twice that per all-reduce; ZeRO paper §7): stage 0 all-reduces gradients once
    per step (2Ψ); stages 1-2 reduce-scatter gradients (stage 1 once per step, stage 2 every micro-step) and
    all-gather parameters (2Ψ); stage 3 all-gathers each unit in forward and in backward and reduce-scatters its
    gradients, every micro-step (3Ψ), except persistent parameters, all-gathered once per step after it
    (Note [Persistent parameters]). Stages 1-2 add an all-reduce of the squared gradient norm (4 bytes); at
    stage 3 it carries 24 bytes (fp64 norm and the digest of the units gathered, Note [Same units on every
    rank] in ``zero/stage3_checks.py``).
    Parameters travel in ``precision.param_bytes``, gradients in ``precision.reduce_bytes``. A stage-3 unit
    holding only frozen parameters is counted as gathered in forward only: it is gathered again
    in backward only if a gradient flows through it, which the layout cannot tell (frozen layers usually come
    first, as when fine-tuning the top of a model, and then none does)."""
    N = world_size
    if N == 1:
        return 0
    f = (N - 1) / N
    pb, gb = precision.param_bytes, precision.reduce_bytes  # gradients travel in the reduce dtype
    bufs = _stage_buffers(layout, stage)[0]
    trainable = sum(_pad(n, N) for n in bufs)
    frozen = frozen_only = persistent = 0
    if stage == 3 and layout.exact:
        gathered = [u for u in layout.units if u.name != PERSISTENT]
        frozen = sum(_pad(n, N) for u in gathered if u.trainable for n in u.frozen)
        frozen_only = sum(_pad(n, N) for u in gathered if not u.trainable for n in u.frozen)
        persistent = sum(_pad(n, N) for u in layout.units if u.name == PERSISTENT for n in u.trainable)
    norm = 2 * f * (24 if stage == 3 else 4)
    if stage == 0:
        sent = 2 * f * trainable * gb
    elif stage == 1:
        sent = f * trainable * (gb + pb) + norm
    elif stage == 2:
        sent = grad_accum_steps * f * trainable * gb + f * trainable * pb + norm
    else:
        gathered_twice = trainable - persistent + frozen  # persistent: all-gathered once per step, after it
        sent = (grad_accum_steps * f * ((2 * gathered_twice + frozen_only) * pb + trainable * gb)
                + f * persistent * pb + norm)
    return int(round(sent))


# --------------------------------------------------------------------------------------------- report
@dataclass(frozen=True)
class Setup:
    """Everything an estimate depends on besides the model.

    Attributes:
        nodes, procs_per_node: the hosts; world size = ``nodes * procs_per_node`` unless ``world_size`` is set
            (a hostfile whose nodes run different numbers of ranks).
        device_memory: bytes per rank; device: what it is (``"cpu"``: host memory shared by the node's ranks).
        cpu_memory: host bytes per node. bandwidth: bytes per second per rank.
        micro_batch, seq_len, grad_accum_steps, bucket_mb, prefetch, activation_checkpointing: as in a recipe.
        offload: the ``zero.offload_optimizer`` variants to estimate besides no offload: ``none``, ``cpu``,
            ``disk`` or ``all`` (both; on a CPU-only machine disk only). offload_buffer_mb: disk's host buffer.
    """

    nodes: int
    procs_per_node: int
    precision: Precision
    optimizer: OptimizerModel
    device_memory: int
    device: str
    cpu_memory: int
    bandwidth: float
    micro_batch: int = 1
    seq_len: int | None = None
    grad_accum_steps: int = 1
    bucket_mb: float = 25.0
    prefetch: bool = True
    activation_checkpointing: bool = False
    world_size: int | None = None
    offload: str = "none"
    offload_buffer_mb: float = 64.0

    @property
    def ranks(self) -> int:
        return self.world_size or self.nodes * self.procs_per_node


@dataclass
class StageRow:
    """One stage (and offload variant) of an :class:`Estimate`. Bytes per rank unless named per node."""

    stage: int
    offload: str  # "none", "cpu" (optimizer states + fp32 master slices in host memory) or "disk"
    params: int
    grads: int
    optimizer: int  # in device memory (memory_bytes()["optimizer"]); offloaded: offload_host, offload_disk
    model_states: int
    working_set: int  # gathered + backward (Note [Peak])
    gathered: int
    backward_transient: int
    activations: int
    device_total: int
    headroom: int
    fits: bool
    cpu_per_node: int  # at least the model built in fp32 by every rank at start (Note [Host memory at start])
    disk_per_node: int
    comm_bytes: int
    comm_s: float
    offload_host: int = 0  # per rank: offload_bytes()["host"] (cpu on an accelerator; disk's paging buffer)
    offload_disk: int = 0  # per rank: offload_bytes()["disk"] (the swap file)

    @property
    def label(self) -> str:
        return f"{self.stage}" + ("" if self.offload == "none" else f" + offload {self.offload}")


@dataclass
class Estimate:
    """The result of :func:`estimate`: inputs, counts, one :class:`StageRow` per stage/offload variant,
    activations (bytes per micro-batch, or ``None`` without a declared shape) and a recommendation."""

    setup: dict
    params: dict
    rows: list[StageRow]
    activations: dict | None
    recommendation: str
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"setup": self.setup, "params": self.params, "stages": [asdict(r) | {"label": r.label}
                                                                        for r in self.rows],
                "activations": self.activations, "recommendation": self.recommendation, "notes": self.notes}


# Note [Host memory at start]: on an accelerator every rank builds the whole model in fp32 host memory before
# moving it to its device (worker.py; meta-device init is used on CPU only), so a node needs at least
# ranks per node x 4 bytes x all parameters of host memory for a moment, at every stage.
def _row(layout: Layout, setup: Setup, stage: int, offload: str, act: int, world_size: int | None = None) -> StageRow:
    N = world_size or setup.ranks
    p = setup.precision
    on_host = setup.device == "cpu"
    ms = model_states(layout, stage, N, p, setup.optimizer, offload, buffer_mb=setup.offload_buffer_mb,
                      device_is_host=on_host)
    ws = working_set(layout, stage, N, p, bucket_mb=setup.bucket_mb, prefetch=setup.prefetch, gloo=on_host)
    total = ms.total + ws.gathered + max(act, ws.backward)  # Note [Peak]
    if on_host:  # the device is the host: disk's paging buffer takes the same memory
        total += ms.host
        host_rank = total
    else:  # Note [Host memory at start]; cpu offload also stages every gradient slice and parameter slice
        slices = sum(_optimizer_slices(layout, stage, N))
        staged = slices * (p.reduce_bytes + p.param_bytes) if offload == "cpu" else 0
        host_rank = max(ms.host + staged, layout.total * 4)
    headroom = setup.device_memory - total
    cpu = setup.procs_per_node * host_rank
    fits = headroom >= MIN_HEADROOM * setup.device_memory and cpu <= setup.cpu_memory
    sent = comm_bytes(layout, stage, N, p, setup.grad_accum_steps)
    return StageRow(stage, offload, ms.params, ms.grads, ms.optimizer, ms.total, ws.total, ws.gathered,
                    ws.backward, act, total, headroom, fits, cpu, setup.procs_per_node * ms.disk, sent,
                    sent / setup.bandwidth, ms.host, ms.disk)


def offload_variants(setup: Setup) -> tuple[str, ...]:
    """The offload modes :func:`estimate` adds rows for (at stages 0-3, after the rows without offload):
    ``setup.offload``'s, where ``all`` is cpu and disk on an accelerator and disk alone on a CPU-only machine
    (there ``cpu`` moves nothing off the device and adds an fp32 master at fp32; asked for by name it is
    estimated all the same, as the engine runs it)."""
    if setup.offload == "all":
        return ("disk",) if setup.device == "cpu" else ("cpu", "disk")
    return () if setup.offload == "none" else (setup.offload,)


def estimate(layout: Layout, setup: Setup) -> Estimate:
    """Per-rank memory, per-node host memory and communication for stages 0-3 (and, per
    :func:`offload_variants`, with the optimizer offloaded), activations when ``layout.shape`` is declared,
    and a recommendation: the lowest stage that fits with ``MIN_HEADROOM`` (no offload first), or what to
    change.

    Raises:
        ValueError: ``setup.offload`` not one of :data:`OFFLOADS`; see :func:`model_states`.
    """
    if setup.offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {setup.offload!r}")
    act = None
    notes: list[str] = []
    if layout.shape:
        try:
            act = activation_bytes(layout.shape, micro_batch=setup.micro_batch, seq_len=setup.seq_len,
                                   element_bytes=setup.precision.activation_bytes)
        except (KeyError, TypeError, ValueError):
            notes.append("model.shape lacks n_layer, d_model, n_head, seq_len or vocab_size: activations not "
                         "estimated")
    if act is None:
        notes.append("activations not counted: no transformer shape (a recipe whose model sets `shape`: n_layer, "
                     "d_model, n_head, seq_len, vocab_size)")
    if not layout.exact and not layout.units:
        notes.append("stage 3's gathered units not counted: pass --largest-layer")

    fused = "_fused" if layout.shape and layout.shape.get("fused_attention") else ""
    if act is not None:
        act["fused_attention"] = bool(fused)

    def act_for(stage: int, checkpointed: bool = setup.activation_checkpointing) -> int:
        if act is None:
            return 0
        return act[("checkpointed" if stage == 3 and checkpointed else "total") + fused]

    modes = offload_variants(setup)
    if setup.offload == "all" and setup.device == "cpu":
        notes.append("no cpu-offload rows: on a CPU-only machine the device memory is host memory (--offload cpu "
                     "shows them)")
    if "disk" in modes:
        notes.append(f"disk offload: a host buffer of {setup.offload_buffer_mb:g} MiB per rank "
                     "(zero.offload_buffer_mb) and the swap files under zero.offload_path (disk column)")
    variants = [(s, "none") for s in range(4)] + [(s, o) for o in modes for s in range(4)]
    rows = [_row(layout, setup, s, o, act_for(s)) for s, o in variants]
    rec = _recommend(setup, layout, rows, act_for)
    largest = layout.largest_unit
    params = {"total": layout.total, "trainable": layout.trainable, "frozen": layout.frozen,
              "largest_unit": {"name": largest.name, "params": largest.numel} if largest else None,
              "units": len([u for u in layout.units if u.name != "<root>"]), "exact_layout": layout.exact,
              "shape": layout.shape}
    s = setup
    info = {"nodes": s.nodes, "procs_per_node": s.procs_per_node, "world_size": s.ranks,
            "precision": s.precision.name, "reduce_dtype": "fp32" if s.precision.reduce_bytes == 4 else
            s.precision.name, "optimizer": s.optimizer.name, "optimizer_states": s.optimizer.states,
            "offload": s.offload, "offload_buffer_mb": s.offload_buffer_mb,
            "device": s.device, "device_memory": s.device_memory, "cpu_memory_per_node": s.cpu_memory,
            "bandwidth_bytes_per_s": s.bandwidth, "micro_batch": s.micro_batch,
            "seq_len": s.seq_len or (layout.shape or {}).get("seq_len"),
            "grad_accum_steps": s.grad_accum_steps, "activation_checkpointing": s.activation_checkpointing,
            "min_headroom": MIN_HEADROOM}
    return Estimate(info, params, rows, act, rec, notes)


def _recommend(setup: Setup, layout: Layout, rows: list[StageRow], act_for) -> str:
    for row in rows:
        if row.fits:
            return (f"stage {row.label}: {format_bytes(row.device_total)} of {format_bytes(setup.device_memory)} "
                    f"per rank, headroom {format_bytes(row.headroom)} "
                    f"({row.headroom / setup.device_memory:.0%})")
    hints = []
    s3 = rows[3]
    tries = [(act_for(3), "")]
    if layout.shape and not setup.activation_checkpointing:
        tries.append((act_for(3, checkpointed=True), " with train.activation_checkpointing"))
    for activations, how in tries:
        nodes = _nodes_for_stage3(layout, setup, activations)
        if nodes is not None:
            hints.append(f"stage 3{how} fits on {nodes} nodes ({nodes * setup.procs_per_node} ranks)")
            break
    if s3.gathered > 0.25 * setup.device_memory and layout.unit_hint:
        hints.append(f"stage 3 gathers {format_bytes(s3.gathered)} at once: make smaller units, e.g. "
                     f"zero.units: [{layout.unit_hint}]")
    if s3.activations > 0.25 * setup.device_memory:
        one = act_for(0) // max(setup.micro_batch, 1)
        hints.append(f"activations take {format_bytes(s3.activations)} per rank: a smaller train.micro_batch_size "
                     f"({format_bytes(one)} per sample) or train.activation_checkpointing at stage 3 "
                     f"({format_bytes(act_for(3, checkpointed=True))})")
    device_ok = [r for r in rows if r.headroom >= MIN_HEADROOM * setup.device_memory]
    if device_ok:  # then host memory is what is short (Note [Host memory at start])
        r = device_ok[0]
        hints.append(f"stage {r.label} fits the device but needs {format_bytes(r.cpu_per_node)} host memory per "
                     f"node (have {format_bytes(setup.cpu_memory)}): fewer ranks per node or more host memory")
    best = min(rows, key=lambda r: r.device_total)
    head = (f"no stage fits {format_bytes(setup.device_memory)} per rank with {MIN_HEADROOM:.0%} headroom "
            f"(smallest: stage {best.label}, {format_bytes(best.device_total)})")
    return head + ("; " + "; ".join(hints) if hints else "; use more device memory per rank")


def _nodes_for_stage3(layout: Layout, setup: Setup, activations: int, max_nodes: int = 1 << 20) -> int | None:
    """The fewest nodes (of ``setup.procs_per_node`` ranks) on which stage 3 fits, or ``None``."""
    def fits(nodes: int) -> bool:
        return _row(layout, setup, 3, "none", activations, world_size=nodes * setup.procs_per_node).fits

    if not fits(max_nodes):
        return None
    lo, hi = setup.nodes, max_nodes  # per-rank bytes shrink as ranks grow: bisect
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def render(est: Estimate, console=None) -> None:
    """Print ``est`` as rich tables (bytes in binary units, time in seconds)."""
    from rich.console import Console
    from rich.markup import escape as e
    from rich.table import Table
    from rich.text import Text

    import sys

    from rich import box

    console = console or Console(width=None if sys.stdout.isatty() else 120)
    s, p = est.setup, est.params
    largest = p["largest_unit"]
    console.print(f"[bold]Model[/bold]: {p['total']:,} parameters ({format_count(p['total'])}): "
                  f"{p['trainable']:,} trainable, {p['frozen']:,} frozen"
                  + (f"; largest unit {e(str(largest['name']))} {largest['params']:,}" if largest else "")
                  + ("" if p["exact_layout"] else " (from --params)"))
    console.print(f"[bold]Setup[/bold]: {s['world_size']} ranks ({s['nodes']} nodes x {s['procs_per_node']}), "
                  f"{e(str(s['precision']))}" + (" (reduce fp32)" if s["reduce_dtype"] != s["precision"] else "")
                  + f", {e(str(s['optimizer']))} ({s['optimizer_states']} states), device {e(str(s['device']))} "
                  f"{format_bytes(s['device_memory'])} per rank, host {format_bytes(s['cpu_memory_per_node'])} "
                  f"per node, {s['bandwidth_bytes_per_s'] * 8 / 1e9:g} Gbit/s per rank")
    unit, size = ("GiB", 2**30) if max(r.device_total for r in est.rows) >= 2**30 else ("MiB", 2**20)
    t = Table(title=f"{unit} per rank (host, disk: per node; sent: per step), by ZeRO stage", box=box.SIMPLE_HEAD,
              padding=(0, 1))
    for col in ("stage", "params", "grads", "optim", "states", "working", "activ", "total", "fits", "host",
                "disk", "sent", "comm"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    v = lambda n: f"{n / size:.3g}" if n < 100 * size else f"{n / size:.0f}"  # noqa: E731
    for r in est.rows:
        fits = f"[green]yes[/green] {r.headroom / s['device_memory']:.0%}" if r.fits else \
            f"[red]no[/red] {r.headroom / s['device_memory']:.0%}"
        t.add_row(Text(r.label.replace(" + offload ", "+")), v(r.params), v(r.grads), v(r.optimizer), v(r.model_states),
                  v(r.working_set), v(r.activations) if est.activations else "-", v(r.device_total), fits,
                  v(r.cpu_per_node), v(r.disk_per_node), v(r.comm_bytes), f"{r.comm_s:.3g} s")
    console.print(t)
    a = est.activations
    if a:
        console.print(f"[bold]Activations[/bold] per micro-batch ({s['micro_batch']} x {s['seq_len']} tokens; "
                      f"Korthikanti et al. 2022 §4): {format_bytes(a['total'])} without checkpointing "
                      f"({format_bytes(a['per_layer'])} per layer, {format_bytes(a['attention_scores'])} of it "
                      f"attention scores), {format_bytes(a['checkpointed'])} with activation checkpointing; "
                      + (f"the model declares fused attention, which keeps no scores: "
                         f"{format_bytes(a['total_fused'])} and {format_bytes(a['checkpointed_fused'])}"
                         if a["fused_attention"] else "the model does not declare fused attention"))
    for note in est.notes:
        console.print(Text(f"note: {note}"))
    console.print(f"[bold]Recommendation[/bold]: {e(est.recommendation)}")


def detect_memory(procs_per_node: int) -> tuple[int, str, int]:
    """``(device bytes per rank, device description, host bytes per node)`` of this machine: the first CUDA
    device's memory, or on a CPU-only machine host memory divided by ``procs_per_node``. torch (seconds to
    import) is asked only on a machine with a GPU driver's device files (NVIDIA's or AMD's)."""
    import os

    import psutil

    host = psutil.virtual_memory().total
    if not any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd", "/proc/driver/nvidia")):
        return host // procs_per_node, "cpu", host
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return props.total_memory, f"cuda ({props.name}, detected)", host
    except Exception:  # noqa: BLE001 - no usable CUDA: fall back to host memory
        pass
    return host // procs_per_node, "cpu", host


def from_arguments(*, recipe: str | None, overrides: list[str], hostfile: str | None, params: str | None,
                   largest_layer: str | None, nodes: int | None, procs_per_node: int | None, precision: str | None,
                   optimizer: str | None, device_memory: str | None, cpu_memory: str | None, bandwidth: str,
                   micro_batch: int | None, offload: str | None = None) -> Estimate:
    """The :class:`Estimate` for ``zerorun estimate``'s arguments (strings as typed; see ``zerorun estimate
    --help``): a recipe (with overrides) or ``params``, the hostfile or ``nodes`` x ``procs_per_node``, sizes
    parsed with :func:`parse_count`, :func:`parse_bytes` and :func:`parse_bandwidth`. A recipe gives the
    precision, ``zero.reduce_dtype``, ``zero.offload_optimizer`` (when it sets it; else every variant, as
    without a recipe: ``all``) and ``zero.offload_buffer_mb``; ``precision`` and ``offload`` override them.

    Raises:
        ZerorunError: neither or both of ``recipe`` and ``params``; a bad recipe, hostfile, model module or
            flag value (the message names the file, field or flag).
    """
    if (recipe is None) == (params is None):
        raise ZerorunError("estimate: give a recipe file or --params (not both)")
    hosts = None
    if hostfile:
        from zerorun.hostfile import read_hostfile

        hosts = read_hostfile(hostfile)
    if offload is not None and offload not in OFFLOADS:
        raise ZerorunError(f"--offload: {offload!r} is not one of {', '.join(OFFLOADS)}")
    r = None
    if recipe is not None:
        from zerorun.recipe import load_recipe

        r = load_recipe(recipe, overrides or [])
        prec = precision_of(precision or r.precision, r.zero.reduce_dtype)
        layout = layout_of_recipe(r, prec.name)
        if offload is None and "offload_optimizer" in r.zero.model_fields_set:
            offload = r.zero.offload_optimizer
    else:
        if overrides:
            raise ZerorunError(f"estimate: overrides ({overrides[0]}) need a recipe")
        largest = parse_count(largest_layer, "--largest-layer") if largest_layer else None
        layout = layout_of_count(parse_count(params, "--params"), largest)
        prec = precision_of(precision or "fp32")
    ppn = procs_per_node or (max(h.slots for h in hosts) if hosts else (r.launch.procs_per_node if r else 1))
    n_nodes = nodes or (len(hosts) if hosts else 1)
    world = sum(h.slots for h in hosts) if hosts and not (nodes or procs_per_node) else None
    if optimizer is not None:
        opt = optimizer_model(optimizer)
    elif r is not None:
        opt = optimizer_model(r.train.optimizer.name, r.train.optimizer.kwargs(), "train.optimizer.name")
    else:
        opt = optimizer_model("adam")
    dev, kind, host = detect_memory(ppn)
    if device_memory:
        dev, kind = parse_bytes(device_memory, "--device-memory"), "given"
    if cpu_memory:
        host = parse_bytes(cpu_memory, "--cpu-memory")
    setup = Setup(
        nodes=n_nodes, procs_per_node=ppn, world_size=world, precision=prec, optimizer=opt,
        device_memory=dev, device=kind, cpu_memory=host, bandwidth=parse_bandwidth(bandwidth, "--bandwidth"),
        micro_batch=micro_batch or (r.train.micro_batch_size if r else 1),
        seq_len=r.data.seq_len if r else None, grad_accum_steps=r.train.grad_accum_steps if r else 1,
        bucket_mb=r.zero.bucket_mb if r else 25.0, prefetch=r.zero.prefetch if r else True,
        activation_checkpointing=r.train.activation_checkpointing if r else False, offload=offload or "all",
        offload_buffer_mb=r.zero.offload_buffer_mb if r else 64.0)
    return estimate(layout, setup)
