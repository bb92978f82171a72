"""Flat buffers: a group of parameters laid out in one contiguous 1-D tensor, padded to the world size.

Note [Flat buffer layout]: parameters ``p_0 .. p_k`` (one optimizer param group, one dtype) are placed end to
end at offsets ``o_i``; the buffer's numel is rounded up to a multiple of the world size ``N`` with zeros, so
rank ``r`` owns the contiguous slice ``[r * n / N, (r + 1) * n / N)``. The padding is never read by a model,
its gradient is zero, so optimizer updates leave it at zero (weight decay of zero is zero). A flat buffer is
one dtype: :func:`pack` groups a param group's parameters by dtype before cutting runs (float64 parameters
among fp32 ones: Note [Wide parameters] in ``precision.py``), so a model of one dtype is laid out as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its :class:`FlatBuffer`: elements ``[offset, offset + numel)``."""

    buffer: "FlatBuffer"
    offset: int
    numel: int
    shape: torch.Size


class FlatBuffer:
    """A padded flat buffer of the params' one dtype for ``params``, of which this rank owns one slice.

    Attributes:
        params: the parameters, in layout order.
        names: their qualified names in the model (first name of a shared parameter).
        group_index: index of the optimizer param group the parameters belong to.
        numel: padded length in elements (divisible by ``world_size``).
        shard_numel: ``numel // world_size``; this rank's slice is ``[lo, lo + shard_numel)``.
        data: the full flat parameter tensor, shape ``(numel,)``, or ``None`` while freed (stage 3).
        grad: the full flat gradient, shape ``(numel,)``, or ``None`` when not held.
        shard_grad: this rank's reduced gradient slice, shape ``(shard_numel,)``, or ``None``.
        order: registration index of the first parameter, used to order collectives identically on all ranks.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], group_index: int, world_size: int,
                 rank: int, order: int) -> None:
        if not named_params:
            raise ValueError("a flat buffer needs at least one parameter")
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group_index = group_index
        self.order = order
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"parameters of one flat buffer must share dtype and device, got {dtypes}, {devices}")
        self.dtype = dtypes.pop()
        self.device = devices.pop()
        self.slots: dict[nn.Parameter, Slot] = {}
        offset = 0
        for p in self.params:
            self.slots[p] = Slot(self, offset, p.numel(), p.shape)
            offset += p.numel()
        self.unpadded_numel = offset
        self.world_size, self.rank = world_size, rank
        self.numel = math.ceil(offset / world_size) * world_size
        self.shard_numel = self.numel // world_size
        self.lo = rank * self.shard_numel
        self.data: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None

    def flatten_params(self) -> None:
        """Copy the parameters into a new ``data`` tensor and make each parameter a view of it (in place, so
        ``Parameter`` objects, ties and references held elsewhere stay valid)."""
        self.data = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p in self.params:
                s = self.slots[p]
                self.data[s.offset:s.offset + s.numel].copy_(p.data.reshape(-1))
                p.data = self.data[s.offset:s.offset + s.numel].view(s.shape)

    def keep_slice(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Copy the part of ``value`` (``p``'s full values, any shape of ``p.numel()`` elements) that falls in this
        rank's slice into ``shard_data`` (stage 3: shape ``(shard_numel,)``)."""
        slot = self.slots[p]
        lo = max(slot.offset, self.lo)
        hi = min(slot.offset + slot.numel, self.lo + self.shard_numel)
        if lo < hi:
            self.shard_data[lo - self.lo:hi - self.lo].copy_(value.reshape(-1)[lo - slot.offset:hi - slot.offset])

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full flat tensor ``flat`` (shape ``(numel,)``): a view, ``(shard_numel,)``."""
        return flat[self.lo:self.lo + self.shard_numel]

    def segments(self, lo: int, n: int) -> list[tuple[int, int]]:
        """Each parameter's range ``(start, end)`` within elements ``[lo, lo + n)`` of the buffer, relative to
        ``lo`` (``start == end``: none of it there), in layout order."""
        out = []
        for p in self.params:
            a, b = max(self.slots[p].offset, lo), min(self.slots[p].offset + self.slots[p].numel, lo + n)
            out.append((a - lo, b - lo) if a < b else (0, 0))
        return out

    def view_of(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        """The part of ``flat`` (shape ``(numel,)``) that belongs to ``p``, viewed with ``p``'s shape."""
        s = self.slots[p]
        return flat[s.offset:s.offset + s.numel].view(s.shape)

    def zero_all_but(self, flat: torch.Tensor, written: set) -> None:
        """Zero the padding of ``flat`` (shape ``(numel,)``) and the parts of the parameters not in ``written``."""
        flat[self.unpadded_numel:].zero_()
        for p in self.params:
            if p not in written:
                self.view_of(flat, p).zero_()


def pack(named_params: list[tuple[str, nn.Parameter]], bucket_bytes: float) -> list[list[tuple[str, nn.Parameter]]]:
    """Split ``named_params`` into runs of one dtype each (Note [Flat buffer layout]): the parameters of each
    dtype (dtypes in order of first appearance), in order, in consecutive runs of at most ``bucket_bytes``
    bytes; a parameter larger than ``bucket_bytes`` gets a run of its own."""
    by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
    for name, p in named_params:
        by_dtype.setdefault(p.dtype, []).append((name, p))
    runs: list[list[tuple[str, nn.Parameter]]] = []
    for params in by_dtype.values():
        size, first = 0, len(runs)
        for name, p in params:
            nbytes = p.numel() * p.element_size()
            if len(runs) == first or size + nbytes > bucket_bytes:
                runs.append([])
                size = 0
            runs[-1].append((name, p))
            size += nbytes
    return runs
