"""Stage 3 from a pretrained folder: each rank reads only its own slices of the safetensors files
(Note [Pretrained at stage 3] in zerorun/hf/model.py).

Note [Slice reads]: a flat buffer slice ``[lo, hi)`` of rank r covers, for each parameter, a contiguous range
``[a, b)`` of that parameter's row-major elements, which is one contiguous byte range of the safetensors file
(format: an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and
``data_offsets``, then the data). Each rank reads exactly those bytes with positioned reads into its master
slice (fp32 files: no copy; 16-bit files: through a buffer of the range, then widened). Nothing is memory-mapped,
so no file page the rank does not need becomes resident, and the slices are produced one flat buffer at a time
while the engine copies them into its masters (:class:`_Slices`), so a rank's peak is its shard plus one
buffer's slice, never the model. Tied parameters (one ``nn.Parameter`` under several names) are one slot in one
flat buffer and are read once, under whichever of their names the file has.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence

import torch
import torch.nn as nn

from zerorun.errors import ZerorunError
from zerorun.hf.model import PREFIX, safetensors_files

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class SafetensorsFile:
    """The header of one safetensors file and positioned reads of element ranges of its tensors.

    Raises:
        ZerorunError: the file is unreadable or its header is not a safetensors header.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, ValueError) as e:
            raise ZerorunError(f"{path}: not a readable safetensors file: {e}") from None
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.tensors: dict[str, dict] = header
        self.fd = os.open(path, os.O_RDONLY)

    def shape(self, key: str) -> list[int]:
        return list(self.tensors[key]["shape"])

    def read(self, key: str, a: int, b: int, out: torch.Tensor) -> int:
        """Copy elements ``[a, b)`` (row-major) of tensor ``key`` into ``out`` (1-D, ``b - a`` elements, any
        floating dtype). Returns the bytes read.

        Raises:
            ZerorunError: a dtype other than F64/F32/F16/BF16, or a short read (truncated file).
        """
        info = self.tensors[key]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ZerorunError(f"{self.path}: {key} has dtype {info['dtype']}, not a floating-point weight")
        size = dtype.itemsize
        start = self.base + info["data_offsets"][0] + a * size
        target = out if out.dtype == dtype else torch.empty(b - a, dtype=dtype)
        view = memoryview(target.view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], start + done)
            if got <= 0:
                raise ZerorunError(f"{self.path}: truncated while reading {key}")
            done += got
        if target is not out:
            out.copy_(target)
        return done

    def close(self) -> None:
        os.close(self.fd)


class _Slices(Sequence):
    """This rank's fp32 master slice of each flat buffer, read from the files when asked for (one at a time,
    the last one cached): the ``values`` of ``engine.load_master_slices``."""

    def __init__(self, buffers, index: dict[str, SafetensorsFile], key_of: dict[int, str]) -> None:
        self.buffers, self.index, self.key_of = buffers, index, key_of
        self.cached: tuple[int, torch.Tensor] | None = None
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.buffers)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.cached is not None and self.cached[0] == i:
            return self.cached[1]
        self.cached = None
        buf = self.buffers[i]
        out = torch.zeros(buf.shard_numel, dtype=torch.float64 if buf.dtype == torch.float64 else torch.float32)
        for p, slot in buf.slots.items():
            lo, hi = max(slot.offset, buf.lo), min(slot.offset + slot.numel, buf.lo + buf.shard_numel)
            if lo < hi:
                key = self.key_of[id(p)]
                self.nbytes += self.index[key].read(key, lo - slot.offset, hi - slot.offset,
                                                    out[lo - buf.lo:hi - buf.lo])
        if buf.dtype.itemsize < out.dtype.itemsize:  # the master is made from the 2-byte parameter, as at stages
            out = out.to(buf.dtype).to(out.dtype)  # 0-2 (Note [Mixed precision] in zero/precision.py)
        self.cached = (i, out)
        return out


def load_pretrained_slices(model: nn.Module, engine) -> int:
    """Fill a stage-3 ``engine``'s fp32 master slices (and so its parameters) from the safetensors files of
    ``model.pretrained``, reading only this rank's slices (Note [Slice reads]); persistent module buffers found
    in the files are copied whole. Every rank must call it (it ends with the engine's parameter refresh).

    Args:
        model: the :class:`zerorun.hf.model.CausalLM` the engine wraps, built on the meta device.
        engine: its :class:`zerorun.zero.stage3.Stage3Engine`.

    Returns:
        Bytes this rank read from the files.

    Raises:
        ZerorunError: a parameter has no tensor in the files, or one of another shape (the same on every rank,
            before any collective); a file is not safetensors or is truncated.
    """
    folder = model.pretrained
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name[len(PREFIX):] if name.startswith(PREFIX) else name)
    if getattr(engine, "frozen_buffers", None):
        raise ZerorunError("model.hf.pretrained: frozen parameters are not loaded lazily at stage 3; set "
                           "zero.meta_init false")
    files = [SafetensorsFile(path) for path in safetensors_files(folder)]
    try:
        index = {key: f for f in files for key in f.tensors}
        key_of: dict[int, str] = {}
        for buf in engine.buffers:
            for p, slot in buf.slots.items():
                key = next((k for k in names[id(p)] if k in index), None)
                if key is None:
                    raise ZerorunError(f"model.hf.pretrained: {folder} has no weights for {names[id(p)][0]}")
                if index[key].shape(key) != list(slot.shape):
                    raise ZerorunError(f"model.hf.pretrained: {key} in {folder} has shape {index[key].shape(key)}, "
                                       f"the model expects {list(slot.shape)}")
                key_of[id(p)] = key
        with torch.no_grad():
            for name, b in model.named_buffers():
                key = name[len(PREFIX):]
                if key in index:
                    index[key].read(key, 0, b.numel(), b.view(-1))
        values = _Slices(engine.buffers, index, key_of)
        engine.load_master_slices(values)
        return values.nbytes
    finally:
        for f in files:
            f.close()
