"""Stage 3 from a pretrained folder: each rank reads only its own slices of the safetensors files
(Note [Pretrained at stage 3] in zerorun/hf/model.py).

Note [Slice reads]: a flat buffer slice ``[lo, hi)`` of rank r covers, for each parameter, a contiguous range
``[a, b)`` of that parameter's row-major elements. safetensors maps the file and ``get_slice(key)[r0:r1]`` copies
rows ``r0..r1`` only (rows of ``prod(shape[1:])`` elements), so a rank reads the rows that hold ``[a, b)`` (at
most one partial row more at each end) and never the whole tensor. Tied parameters (one ``nn.Parameter`` under
several names) are one slot in one flat buffer and are read once, under whichever of their names the file has.
"""

from __future__ import annotations

import math
from contextlib import ExitStack

import torch
import torch.nn as nn

from zerorun.errors import ZerorunError
from zerorun.hf.model import PREFIX, safetensors_files


def _index(stack: ExitStack, folder: str) -> dict:
    from safetensors import safe_open

    index = {}
    for path in safetensors_files(folder):
        handle = stack.enter_context(safe_open(path, framework="pt"))
        for key in handle.keys():
            index[key] = handle
    return index


def _read_range(handle, key: str, shape: list[int], a: int, b: int) -> torch.Tensor:
    """Elements ``[a, b)`` of tensor ``key`` (row-major), flat, as read from its rows only (Note [Slice reads])."""
    sl = handle.get_slice(key)
    if len(shape) == 0:
        return handle.get_tensor(key).reshape(-1)[a:b]
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    r0, r1 = a // row, -(-b // row)
    part = sl[r0:r1].reshape(-1)
    return part[a - r0 * row:b - r0 * row]


def load_pretrained_slices(model: nn.Module, engine) -> int:
    """Fill a stage-3 ``engine``'s fp32 master slices (and so its parameters) from the safetensors files of
    ``model.pretrained``, reading only this rank's slices; persistent module buffers found in the files are
    copied whole. Every rank must call it (it ends with the engine's parameter refresh).

    Args:
        model: the :class:`zerorun.hf.model.CausalLM` the engine wraps, built on the meta device.
        engine: its :class:`zerorun.zero.stage3.Stage3Engine`.

    Returns:
        Bytes of tensor data copied out of the files by this rank.

    Raises:
        ZerorunError: a parameter has no tensor in the files, or one of another shape (the same on every rank,
            before any collective).
    """
    folder = model.pretrained
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name[len(PREFIX):] if name.startswith(PREFIX) else name)
    if getattr(engine, "frozen_buffers", None):
        raise ZerorunError("model.hf.pretrained: frozen parameters are not loaded lazily at stage 3 yet; set "
                           "zero.meta_init false")
    nbytes = 0
    with ExitStack() as stack:
        index = _index(stack, folder)
        key_of: dict[int, str] = {}
        for buf in engine.buffers:
            for p, slot in buf.slots.items():
                key = next((k for k in names[id(p)] if k in index), None)
                if key is None:
                    raise ZerorunError(f"model.hf.pretrained: {folder} has no weights for {names[id(p)][0]}")
                shape = list(index[key].get_slice(key).get_shape())
                if shape != list(slot.shape):
                    raise ZerorunError(f"model.hf.pretrained: {key} in {folder} has shape {shape}, the model "
                                       f"expects {list(slot.shape)}")
                key_of[id(p)] = key
        values = []
        for buf in engine.buffers:
            out = torch.zeros(buf.shard_numel, dtype=torch.float32)
            for p, slot in buf.slots.items():
                lo, hi = max(slot.offset, buf.lo), min(slot.offset + slot.numel, buf.lo + buf.shard_numel)
                if lo >= hi:
                    continue
                key = key_of[id(p)]
                part = _read_range(index[key], key, list(slot.shape), lo - slot.offset, hi - slot.offset)
                nbytes += part.numel() * part.element_size()
                out[lo - buf.lo:hi - buf.lo].copy_(part)
                del part
            values.append(out)
        with torch.no_grad():
            for name, b in model.named_buffers():
                key = name[len(PREFIX):]
                if key in index:
                    b.copy_(index[key].get_tensor(key))
    engine.load_master_slices(values)
    return nbytes
