"""A ZeRO engine's state as world-size- and stage-independent shards, for sharded checkpoints.

Note [Checkpoint layout]: flat buffers (Note [Flat buffer layout] in ``flat.py``) depend on the world size, the
stage (stage 3 groups parameters by unit) and the bucket size, so a checkpoint cannot store them. It stores
every tensor per parameter name instead, flattened to 1-D: ``model/<name>`` (the fp32 master values of a
trainable parameter, the values of a frozen one) and ``optim/<name>/<key>`` for each optimizer state tensor
with one element per parameter element (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``, ...).
Rank r contributes the contiguous range of each parameter that lies in its flat slice, which may be empty;
the ranges of all ranks tile the parameter. Torch's distributed checkpoint (DCP) writes each range as one
chunk with its global offset (a ``ShardedTensor`` built from local shards with ``ShardMetadata``: DTensor's
even chunking cannot express ranges cut by another parameter's slice) and, on load, reads into each rank's
ranges from whichever chunks overlap them: that is the resharding to another world size or stage. A rank
that holds a whole parameter (stage 0, frozen parameters at stages 0-2, a parameter inside one slice)
reads and writes a plain tensor; DCP writes replicated tensors once. Scalar optimizer states (``step``) are
stored per parameter as plain tensors (``optim/<name>/step``); module buffers as ``model/<key>``, rank 0's: they may
differ by rank (a BatchNorm's running statistics, updated from each rank's batch, as under DDP, whose checkpoints
hold rank 0's), and DCP writes each replicated tensor from whichever rank its planner picks, so every rank
offering its own brought back a mix of ranks' values (found by review: a layer's running mean from rank 1, its
running variance from rank 0).

Model weights are stored once, as the fp32 master values (:meth:`ZeroEngine.master_slices`; a float64
parameter's master and states are float64: Note [Wide parameters] in ``precision.py``): at fp32
without offload they are the parameters themselves; under bf16/fp16 the 2-byte parameters are cast from
the masters on load, and offloaded masters and states (host memory, swap file) are read through the engine
and written back through it (:meth:`ZeroEngine.optimizer_states`, :meth:`ZeroEngine.load_master_slices`);
disk-offloaded ones are streamed through the paging buffer instead (Note [Paged checkpoints] in
``state_paging.py``).
A checkpoint is thus independent of the precision and the offload as well: a bf16 run resumes in fp32
from the same masters. Everything else (names, shapes, optimizer class and hyperparameters)
is described by the JSON-able ``layout`` of :func:`engine_state`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from zerorun.zero.state_paging import Pager, PagedState, paged_masters, placeholder


class CheckpointMismatch(ValueError):
    """A checkpoint that cannot be loaded into this engine (the message says why)."""


@dataclass(frozen=True)
class Holding:
    """This rank's part of one parameter: elements ``[lo, hi)`` of the flattened parameter (``numel`` elements
    in all), held at ``tensor[start:start + hi - lo]`` of a 1-D tensor (a master slice, a stage-3 frozen
    slice, or the parameter itself).

    Attributes:
        ranges: every rank's ``(lo, hi)`` (empty ranges have ``lo == hi``), or ``None`` when every rank holds
            the whole parameter.
        buffer_index: index into ``engine.buffers`` of the trainable flat buffer (its optimizer states are
            sliced the same way), or ``None`` for a frozen parameter.
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    lo: int
    hi: int
    start: int
    ranges: tuple[tuple[int, int], ...] | None
    buffer_index: int | None
    tensor: torch.Tensor
    k: int = 0  # the parameter's index in its flat buffer (optimizer states per parameter)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's elements in ``flat`` (a tensor laid out like ``tensor``), shape ``(hi - lo,)``."""
        return flat.detach()[self.start:self.start + self.hi - self.lo]

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.numel


def _slice_ranges(buf, slot, world_size: int) -> tuple[tuple[int, int], ...]:
    """Every rank's range of the parameter at ``slot`` in ``buf`` (rank r owns ``[r*s, (r+1)*s)`` of the buffer)."""
    s, o, n = buf.shard_numel, slot.offset, slot.numel
    out = []
    for r in range(world_size):
        lo, hi = max(o, r * s), min(o + n, (r + 1) * s)
        out.append((lo - o, hi - o) if lo < hi else (0, 0))
    return tuple(out)


def holdings(engine, masters: list[torch.Tensor] | None = None) -> list[Holding]:
    """What this rank holds of every parameter of ``engine.module`` (Note [Checkpoint layout]), trainable
    parameters first in ``engine.buffers`` order, then frozen ones.

    Trainable values come from ``masters`` (default :meth:`ZeroEngine.master_slices`); frozen values from
    the stage-3 frozen slices, or the parameters themselves at stages 0-2.
    """
    names = {p: n for n, p in engine.module.named_parameters()}
    out: list[Holding] = []
    masters = _masters(engine) if masters is None else masters
    for i, (buf, master) in enumerate(zip(engine.buffers, masters)):
        out += _buffer_holdings(engine, buf, master, engine.stage == 0, i)
    for buf in getattr(engine, "frozen_buffers", []):  # stage 3: frozen parameters are sharded too
        out += _buffer_holdings(engine, buf, buf.shard_data, False, None)
    for p in engine._frozen:
        if not any(p in buf.slots for buf in getattr(engine, "frozen_buffers", [])):
            flat = p.data.reshape(-1)
            out.append(Holding(names[p], tuple(p.shape), p.numel(), 0, p.numel(), 0, None, None, flat))
    return out


def _masters(engine) -> list[torch.Tensor]:
    """The engine's master slices; placeholders of their shapes (no memory) when they are on disk. The parameters
    written since the step are taken first (Note [Writes between steps] in param_writes.py: ``master_slices`` takes
    them; the paged path reads the swap file itself)."""
    disk = paged_masters(engine)
    if disk is not None:
        engine.take_writes()
        return [placeholder(s.numel(), d) for s, d in zip(disk.slices, disk.dtypes)]
    return engine.master_slices()


def _buffer_holdings(engine, buf, tensor: torch.Tensor, whole: bool, index: int | None) -> list[Holding]:
    out = []
    for k, (p, name) in enumerate(zip(buf.params, buf.names)):
        slot = buf.slots[p]
        if whole:
            out.append(Holding(name, tuple(slot.shape), slot.numel, 0, slot.numel, slot.offset, None, index, tensor,
                               k))
            continue
        ranges = _slice_ranges(buf, slot, engine.world_size)
        lo, hi = ranges[engine.rank]
        start = slot.offset + lo - buf.lo
        out.append(Holding(name, tuple(slot.shape), slot.numel, lo, hi, start, ranges, index, tensor, k))
    return out


def _dcp_tensor(h: Holding, flat: torch.Tensor | None, rank: int, process_group,
                local: torch.Tensor | None = None) -> torch.Tensor | None:
    """The DCP entry for this rank's part of ``flat`` (or for ``local``, that part itself: ``hi - lo``
    elements): a plain tensor when it holds the whole parameter, a ``ShardedTensor`` of one local shard (with
    every rank's shard in its global metadata) when it holds a part, ``None`` when it holds nothing."""
    if h.hi == h.lo:
        return None
    local = h.view(flat) if local is None else local
    if h.whole:
        return local
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

    mds = [ShardMetadata([lo], [hi - lo], f"rank:{r}/{local.device}") for r, (lo, hi) in enumerate(h.ranges)
           if hi > lo]
    meta = ShardedTensorMetadata(mds, torch.Size([h.numel]), TensorProperties(dtype=local.dtype))
    mine = [Shard(local, md) for md in mds if md.placement.rank() == rank]
    with warnings.catch_warnings():  # ShardedTensor is deprecated in favour of DTensor (even chunks only)
        warnings.simplefilter("ignore", FutureWarning)
        return ShardedTensor._init_from_local_shards_and_global_metadata(mine, meta, process_group=process_group)


def _check_scalar(key: str, shape: tuple) -> None:
    """A state that is not per element must be one value (Adam's ``step``) to be stored per parameter."""
    if any(d != 1 for d in shape):
        raise ValueError(f"optimizer state {key!r} of shape {list(shape)} is neither one value per parameter "
                         "element nor a scalar: it cannot be sharded")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _state_dtype(dtype: torch.dtype, master: torch.Tensor) -> torch.dtype:
    """The dtype of a per-element optimizer state of ``master`` whose spec says ``dtype``: a floating state is
    kept in the master's dtype, as torch's optimizers keep it in the parameter's (fp32, or float64 for a
    float64 parameter: Note [Wide parameters] in ``precision.py``)."""
    return master.dtype if dtype.is_floating_point else dtype


def dtype_of(name: str) -> torch.dtype:
    """The ``torch.dtype`` called ``name`` (``"float32"``). Raises ValueError for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def engine_state(engine) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's shards of the engine's model and optimizer state (Note [Checkpoint layout]).

    Returns:
        ``(tensors, layout)``: ``tensors`` maps DCP keys to plain tensors or ``ShardedTensor`` s (views of the
        engine's own tensors, no copies); with ``disk`` offload a :class:`PagedState` whose trainable entries
        are read piece by piece by ``tensors.pager.save_planner()`` (Note [Paged checkpoints]): pass it to
        ``dcp.save`` with ``FileSystemWriter(**state_paging.WRITER_OPTIONS)``. ``layout`` (JSON-able, equal on
        every rank) lists parameters (name, shape, trainable, dtype as stored: the master's, or a frozen
        parameter's), module buffers (key, shape, dtype), ``state_dict`` keys in order (tied parameters appear
        under every key), the optimizer class, its state keys and its param groups' options (``params``
        excluded).

    Raises:
        ValueError: an optimizer state that is neither elementwise nor scalar.
    """
    group = engine.comm.group
    disk = paged_masters(engine)
    pager = Pager(disk, engine.rank, group) if disk is not None else None
    tensors: dict[str, Any] = {} if pager is None else PagedState()
    if pager is not None:
        tensors.pager = pager
    masters = _masters(engine)
    spec = engine.masters.state_spec()  # Note [Unused parameters] in masters.py: per parameter, alike on every rank
    scalars = engine.masters.param_scalars()
    per_param = engine.masters.param_states() if pager is None else None
    for key, (each, _, shape) in spec.items():
        if not each:
            _check_scalar(key, shape)
    optim_state = {key: {"kind": "elementwise" if each else "scalar", "dtype": _dtype_name(dtype),
                         "shape": list(masters[-1].shape) if each and masters else list(shape)}
                   for key, (each, dtype, shape) in spec.items()}
    params = []
    for h in holdings(engine, masters):
        params.append({"name": h.name, "shape": list(h.shape), "trainable": h.buffer_index is not None,
                       "dtype": _dtype_name(h.tensor.dtype)})
        paged = pager is not None and h.buffer_index is not None
        entry = (pager.entry(f"model/{h.name}", h, "master", load=False) if paged
                 else _dcp_tensor(h, h.tensor, engine.rank, group))
        if entry is None:
            continue
        tensors[f"model/{h.name}"] = entry
        if h.buffer_index is None:
            continue
        mine = scalars[h.buffer_index][h.k] or {}  # a parameter never stepped: zeros, step 0
        for key, (each, dtype, shape) in spec.items():
            if not each:
                value = mine.get(key)
                tensors[f"optim/{h.name}/{key}"] = (value.detach() if value is not None else
                                                    torch.zeros(shape, dtype=dtype))
            elif paged:
                tensors[f"optim/{h.name}/{key}"] = pager.entry(f"optim/{h.name}/{key}", h, key, load=False)
            else:
                value = per_param[h.buffer_index][h.k].get(key)
                value = value if value is not None else torch.zeros(h.hi - h.lo, device=h.tensor.device,
                                                                     dtype=_state_dtype(dtype, h.tensor))
                tensors[f"optim/{h.name}/{key}"] = _dcp_tensor(h, None, engine.rank, group, local=value.detach())
    keyed = engine.module.state_dict(keep_vars=True)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    order, buffers = [], {}
    for key, t in keyed.items():
        if id(t) in names:
            order.append([key, names[id(t)]])
        else:
            order.append([key, key])
            buffers[key] = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
            if engine.rank == 0:  # Note [Checkpoint layout]: rank 0's buffers
                tensors[f"model/{key}"] = t.detach()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    layout = {"params": params, "buffers": buffers, "state_dict": order,
              "optimizer": type(engine.optimizer).__name__, "optim_state": optim_state,
              "param_groups": _jsonable(groups)}
    return tensors, layout


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def compare_layout(engine, layout: dict[str, Any]) -> str | None:
    """Why a checkpoint with ``layout`` cannot be loaded into ``engine`` (the first problem, naming the key),
    or ``None`` when it can."""
    saved = {p["name"]: p for p in layout["params"]}
    mine = {h.name: h for h in holdings(engine)}
    for name, h in mine.items():
        if name not in saved:
            return f"parameter {name!r} of the model is missing from the checkpoint"
        if list(h.shape) != saved[name]["shape"]:
            return f"parameter {name!r} has shape {saved[name]['shape']} in the checkpoint, {list(h.shape)} in the model"
        if (h.buffer_index is not None) and not saved[name]["trainable"] and layout["optim_state"]:
            return f"parameter {name!r} is trainable in the model but was frozen in the checkpoint (no optimizer state)"
    for name in saved:
        if name not in mine:
            return f"checkpoint parameter {name!r} is not a parameter of the model"
    keyed = engine.module.state_dict(keep_vars=True)
    param_ids = {id(p) for p in engine.module.parameters()}
    for key, t in keyed.items():
        if id(t) in param_ids:
            continue
        if key not in layout["buffers"]:
            return f"buffer {key!r} of the model is missing from the checkpoint"
        if layout["buffers"][key]["shape"] != list(t.shape):
            return f"buffer {key!r} has shape {layout['buffers'][key]['shape']} in the checkpoint, {list(t.shape)} in the model"
    for key in layout["buffers"]:
        if key not in keyed:
            return f"checkpoint buffer {key!r} is not a buffer of the model"
    if layout["optim_state"] and layout["optimizer"] != type(engine.optimizer).__name__:
        return f"optimizer {layout['optimizer']} in the checkpoint, {type(engine.optimizer).__name__} in the recipe"
    if len(layout["param_groups"]) != len(engine.optimizer.param_groups):
        return (f"{len(layout['param_groups'])} optimizer param groups in the checkpoint, "
                f"{len(engine.optimizer.param_groups)} in the model")
    return None


def load_engine_state(engine, layout: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> None:
    """Fill ``engine``'s masters, frozen parameters, module buffers and optimizer states from a checkpoint
    saved by :func:`engine_state` with ``layout`` (any world size, stage, precision and offload), then
    refresh the parameters from the masters (:meth:`ZeroEngine.load_master_slices`). Check :func:`compare_layout` first.

    Args:
        load: called once with the DCP state dict of this rank's targets (views of the engine's tensors and of
            newly allocated optimizer states); it must fill them in place (``dcp.load``). Collective. With
            ``disk`` offload the targets are a :class:`PagedState`: ``load`` must use a load planner that
            defers to ``targets.pager``'s ``resolve_tensor``/``commit_tensor`` (Note [Paged checkpoints]).

    Raises:
        CheckpointMismatch: ``disk`` offload and a per-element optimizer state this optimizer does not have.
    """
    group = engine.comm.group
    disk = paged_masters(engine)
    pager = Pager(disk, engine.rank, group) if disk is not None else None
    masters = _masters(engine)
    targets: dict[str, Any] = {} if pager is None else PagedState()
    if pager is not None:
        targets.pager = pager
        unknown = [k for k, spec in layout["optim_state"].items()
                   if spec["kind"] == "elementwise" and k not in disk.state_names]
        if unknown:
            raise CheckpointMismatch(f"optimizer state {unknown[0]!r} in the checkpoint is not one of this optimizer's "
                             f"per-element states ({', '.join(disk.state_names) or 'none'})")
    states: dict[int, dict[str, torch.Tensor]] = {}
    for i, master in enumerate(masters):
        state = states[i] = {}
        for key, spec in layout["optim_state"].items():
            if spec["kind"] == "elementwise" and pager is None:
                state[key] = torch.zeros_like(master, dtype=_state_dtype(dtype_of(spec["dtype"]), master),
                                              requires_grad=False)
    # Note [Unused parameters] in masters.py: scalar states (step) per parameter
    scalars: list[list[dict[str, torch.Tensor] | None]] = [[None] * len(b.params) for b in engine.buffers]
    for h in holdings(engine, masters):
        paged = pager is not None and h.buffer_index is not None
        entry = (pager.entry(f"model/{h.name}", h, "master", load=True) if paged
                 else _dcp_tensor(h, h.tensor, engine.rank, group))
        if entry is None:
            continue
        targets[f"model/{h.name}"] = entry
        if h.buffer_index is not None:
            mine = scalars[h.buffer_index][h.k] = {}
            for key, spec in layout["optim_state"].items():
                if spec["kind"] != "elementwise":  # Note [Scalar states on the CPU] in masters.py
                    mine[key] = targets[f"optim/{h.name}/{key}"] = torch.zeros(
                        spec["shape"], dtype=dtype_of(spec["dtype"]), device="cpu")
                    continue
                targets[f"optim/{h.name}/{key}"] = (
                    pager.entry(f"optim/{h.name}/{key}", h, key, load=True) if paged
                    else _dcp_tensor(h, states[h.buffer_index][key], engine.rank, group))
    param_ids = {id(p) for p in engine.module.parameters()}
    for key, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) not in param_ids:
            targets[f"model/{key}"] = t.detach()
    load(targets)
    for group_options, saved in zip(engine.optimizer.param_groups, layout["param_groups"]):
        for k, v in saved.items():
            old = group_options.get(k)
            group_options[k] = tuple(v) if isinstance(old, tuple) and isinstance(v, list) else v
    loaded = [states[i] for i in range(len(masters))] if layout["optim_state"] else None
    for per_buffer in scalars:  # a parameter saved before any step of it (step 0) has no state
        for k, mine in enumerate(per_buffer):
            step = (mine or {}).get("step")
            if step is not None and not engine.masters.eager and float(step) == 0:
                per_buffer[k] = None
    # disk: the masters and per-element states are in the swap file already; ``loaded`` holds no tensors
    engine.load_master_slices(None if pager is not None else masters, loaded, scalars if loaded else None)

