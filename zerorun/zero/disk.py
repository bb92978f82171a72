"""Disk offload: masters and optimizer states in a swap file, paged through a bounded host buffer (Note [Disk
paging] in ``offload.py``, Note [Paged checkpoints] in ``state_paging.py``)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch

from zerorun.zero.masters import Masters, _group_params, multi_tensor_kwargs, probe_spec
from zerorun.zero.paging_math import subgroup_elements
from zerorun.zero.precision import wide_or
from zerorun.zero.staging import ChunkStaging
from zerorun.zero.swap import SwapFile


def tensor_state_names(optimizer_cls: type, optimizer_kwargs: dict[str, Any]) -> list[str]:
    """Names of the optimizer's per-element state tensors (shaped like the parameter), found by stepping the
    optimizer once on a 3-element probe: e.g. ``["exp_avg", "exp_avg_sq"]`` for Adam (its ``step`` is 0-d)."""
    p = torch.zeros(3, requires_grad=True)
    opt = optimizer_cls([p], **optimizer_kwargs)
    p.grad = torch.zeros(3)
    opt.step()
    return [k for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.shape == p.shape]


class _Chunk:
    """One sub-group: elements ``[lo, lo + numel)`` of master ``index`` (of ``dtype``); its file regions and
    small state."""

    def __init__(self, index: int, lo: int, numel: int, param: torch.Tensor, offsets: dict[str, int],
                 k: int = 0) -> None:
        self.index, self.lo, self.numel, self.param, self.offsets = index, lo, numel, param, offsets
        self.dtype = param.dtype
        self.k = k  # the parameter of the flat buffer it is a part of (Note [Unused parameters] in masters.py)
        self.small: dict[str, Any] | None = None  # state that is not per element (Adam's step); None: no state yet


class DiskMasters(Masters):
    """Masters and optimizer states in a swap file under ``folder``, paged through a host buffer of
    ``buffer_bytes`` bytes in sub-groups (Note [Disk paging]), each within one parameter's segment (Note
    [Unused parameters] in ``masters.py``; the padding is in none). Other arguments as :class:`Masters`. A
    float64 slice's master and states are float64 (Note [Wide parameters] in ``precision.py``), in sub-groups
    of half as many elements (:meth:`chunk_of`), so that a sub-group takes the same bytes of the buffer.

    Raises:
        ValueError: ``buffer_bytes`` too small to hold one element's master and states twice, or the swap
            file cannot be created in ``folder`` (message names ``zero.offload_path``).
    """

    def __init__(self, slices, group_of, group_options, optimizer_cls, optimizer_kwargs, *, folder: str,
                 buffer_bytes: int, rank: int, segments: list[list[tuple[int, int]]] | None = None) -> None:
        self.slices = slices
        self.alias = False
        self.eager = False
        self.stepped = False
        self.bounds = segments if segments is not None else [[(0, s.numel())] for s in slices]
        self.dtypes = [wide_or(s.dtype, torch.float32) for s in slices]
        self._stages: dict[tuple, ChunkStaging] = {}  # (gradient, parameter, master dtype) -> its staging
        self.state_names = tensor_state_names(optimizer_cls, optimizer_kwargs)
        per_element = 4 * (1 + len(self.state_names))
        self.chunk = subgroup_elements(buffer_bytes, len(self.state_names))
        if self.chunk < 16:
            raise ValueError(f"zero.offload_buffer_mb: {buffer_bytes} bytes cannot page even 16 elements of master "
                             f"and {len(self.state_names)} optimizer state tensors twice")
        self.pin = slices[0].device.type == "cuda"
        half = self.chunk * per_element
        self.arena = torch.empty(2 * half, dtype=torch.uint8, pin_memory=self.pin)
        self.halves = [self.arena[:half], self.arena[half:]]
        try:
            self.file = SwapFile(folder, rank)
        except OSError as e:
            raise ValueError(f"zero.offload_path: cannot create a swap file in {folder}: "
                             f"{e.strerror or e}") from None
        self.chunks: list[_Chunk] = []
        for i, (s, dtype) in enumerate(zip(slices, self.dtypes)):
            for k, (a, b) in enumerate(self.bounds[i]):
                for lo in range(a, b, self.chunk_of(i)):
                    n = min(self.chunk_of(i), b - lo)
                    offsets = {name: self.file.allocate(dtype.itemsize * n) for name in ["master", *self.state_names]}
                    self.file.write(offsets["master"], s.detach()[lo:lo + n].to("cpu", dtype))
                    self.chunks.append(_Chunk(i, lo, n, torch.empty(0, dtype=dtype).requires_grad_(True), offsets, k))
        self.params = [c.param for c in self.chunks]
        self._chunks_of: list[list[_Chunk]] = [[] for _ in slices]
        for c in self.chunks:
            self._chunks_of[c.index].append(c)
        self._arena_np = self.arena.numpy()
        self._next_half = 0
        self.optimizer = optimizer_cls(_group_params(self.params, [group_of[c.index] for c in self.chunks],
                                                     group_options),
                                       **multi_tensor_kwargs(optimizer_cls, optimizer_kwargs, host=True))
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerorun-swap")

    def chunk_of(self, index: int) -> int:
        """Elements of a sub-group of master ``index``: :attr:`chunk` fp32 ones, half as many float64 ones."""
        return self.chunk * 4 // self.dtypes[index].itemsize

    def _read(self, c: _Chunk, half: int) -> dict[str, torch.Tensor]:
        """Page chunk ``c`` into host-buffer half ``half``: ``{"master": ..., state name: ...}`` views of its
        dtype."""
        arena, out = self.halves[half], {}
        names = ["master", *self.state_names] if c.small is not None else ["master"]
        for k, name in enumerate(names):
            at = k * 4 * self.chunk
            out[name] = arena[at:at + c.dtype.itemsize * c.numel].view(c.dtype)
            self.file.read_into(c.offsets[name], out[name])
        return out

    def step(self, grads, coef, used=None) -> None:
        todo = [c for c in self.chunks if used is None or used[c.index][c.k]]  # Note [Unused parameters]
        if not todo:
            return
        self.stepped = True
        stages = [self._staging(grads[c.index].dtype, c.index) for c in todo]
        for stage in {id(s): s for s in stages}.values():
            stage.set_factor(coef)
        stages[0].take(grads[todo[0].index], todo[0].lo, todo[0].numel, 0)
        pending = self._reader.submit(self._read, todo[0], 0)
        for k, c in enumerate(todo):
            views = pending.result()
            if k + 1 < len(todo):  # Note [Disk paging]: read (and copy in) the next sub-group while this one steps
                pending = self._reader.submit(self._read, todo[k + 1], (k + 1) % 2)
                stages[k + 1].take(grads[todo[k + 1].index], todo[k + 1].lo, todo[k + 1].numel, (k + 1) % 2)
            p, stage = c.param, stages[k]
            p.data = views["master"]
            if c.small is not None:
                self.optimizer.state[p] = {**c.small, **{n: views[n] for n in self.state_names}}
            p.grad = stage.grad(k % 2, c.numel, coef is not None)
            self.optimizer.step()
            p.grad = None
            state = self.optimizer.state.pop(p, {})  # a stateless optimizer (SGD without momentum) keeps none
            self.file.write(c.offsets["master"], p.data)
            for n in self.state_names:
                self.file.write(c.offsets[n], state[n])
            c.small = {n: v for n, v in state.items() if n not in self.state_names}
            stage.give(p.data, self.slices[c.index][c.lo:c.lo + c.numel], k % 2)
            p.data = torch.empty(0, dtype=c.dtype)
        for stage in {id(s): s for s in stages}.values():
            stage.settle()

    def _staging(self, grad_dtype: torch.dtype, index: int) -> "ChunkStaging":
        """The reused staging for gradients of ``grad_dtype`` into master ``index`` (one per dtype triple)."""
        key = (grad_dtype, self.slices[index].dtype, self.dtypes[index])
        if key not in self._stages:
            self._stages[key] = ChunkStaging(self.chunk, *key[:2], self.slices[index].device, key[2])
        return self._stages[key]

    def master_slices(self) -> list[torch.Tensor]:
        """Read from the swap file: new CPU tensors (fp32, float64 for a float64 buffer), one per flat buffer."""
        out = [torch.zeros(s.numel(), dtype=d) for s, d in zip(self.slices, self.dtypes)]  # padding: in no chunk
        for c in self.chunks:
            self.file.read_into(c.offsets["master"], out[c.index][c.lo:c.lo + c.numel])
        return out

    def state_slices(self) -> list[dict[str, torch.Tensor]]:
        """Read from the swap file: the state of each sub-group (new CPU tensors), in ``optimizer`` order."""
        out = []
        for c in self.chunks:
            state = {}
            if c.small is not None:
                state = dict(c.small)
                for n in self.state_names:
                    state[n] = torch.empty(c.numel, dtype=c.dtype)
                    self.file.read_into(c.offsets[n], state[n])
            out.append(state)
        return out

    def buffer_states(self) -> list[dict[str, torch.Tensor]]:
        """Read from the swap file: the state of each flat buffer (new CPU tensors; sub-groups joined)."""
        out: list[dict[str, torch.Tensor]] = [{} for _ in self.slices]
        for c in self.chunks:
            if c.small is None:
                continue
            state = out[c.index]
            if not state:  # the first stepped sub-group's scalars (param_scalars: each parameter's)
                state.update({k: v.clone() for k, v in c.small.items()})
                state.update({n: torch.zeros(self.slices[c.index].numel(), dtype=c.dtype) for n in self.state_names})
            for n in self.state_names:
                self.file.read_into(c.offsets[n], state[n][c.lo:c.lo + c.numel])
        return out

    def load(self, values, states, param_scalars=None) -> None:
        """As :meth:`Masters.load`, written to the swap file sub-group by sub-group. ``values=None``: the masters
        and per-element states are in the swap file already (written by :meth:`write_range`, Note [Paged
        checkpoints]); ``states`` then holds each buffer's scalar states only (``None``: no state)."""
        self.stepped = False
        for c in self.chunks:  # scalars (Adam's step) are incremented in place: one tensor per sub-group
            state = states[c.index] if states else None
            scalars = {k: v for k, v in state.items() if k not in self.state_names} if state else None
            if states is not None and param_scalars is not None:  # each parameter's own (Note [Unused parameters])
                scalars = param_scalars[c.index][c.k]
            # Note [Scalar states on the CPU] in masters.py: the host step's parameters are on the CPU
            c.small = None if scalars is None else {k: v.detach().to("cpu", copy=True) for k, v in scalars.items()}
            self.stepped |= c.small is not None
            if values is None:
                continue
            master = values[c.index].reshape(-1)[c.lo:c.lo + c.numel].to("cpu", c.dtype).contiguous()
            self.file.write(c.offsets["master"], master)
            if c.small is not None:
                for n in self.state_names:
                    self.file.write(c.offsets[n], state[n][c.lo:c.lo + c.numel].to("cpu", c.dtype).contiguous())
            self.slices[c.index][c.lo:c.lo + c.numel].copy_(master)
        if values is None:
            self.write_params()

    def set_values(self, values) -> None:
        """Overwrite the masters in the swap file with ``values`` (as :meth:`load`), keeping the optimizer
        state, and write them into the parameter slices."""
        for c in self.chunks:
            master = values[c.index].reshape(-1)[c.lo:c.lo + c.numel].to("cpu", c.dtype).contiguous()
            self.file.write(c.offsets["master"], master)
            self.slices[c.index][c.lo:c.lo + c.numel].copy_(master)

    def write_params(self) -> None:
        """Write the masters into the parameter slices sub-group by sub-group, through the host buffer."""
        for c in self.chunks:
            master = self.page(c.numel, c.dtype)
            self.file.read_into(c.offsets["master"], master)
            self.slices[c.index][c.lo:c.lo + c.numel].copy_(master)

    # ------------------------------------------------------------- Note [Paged checkpoints]: ranges of a buffer
    def page(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``numel`` elements of ``dtype`` of the host buffer (at most :attr:`chunk` fp32 ones' bytes),
        alternately in its two halves, as a tensor whose storage is exactly those bytes (``torch.frombuffer``:
        no allocation). Its content is valid until the next call but one."""
        if numel * dtype.itemsize > 4 * self.chunk:
            raise ValueError(f"a page holds at most {4 * self.chunk // dtype.itemsize} elements, not {numel}")
        start = self._next_half * (self.arena.numel() // 2)
        self._next_half ^= 1
        return torch.frombuffer(memoryview(self._arena_np[start:start + dtype.itemsize * numel]), dtype=dtype)

    def has_state(self) -> bool:
        """Whether the optimizer has stepped (its per-element states are in the swap file)."""
        return self.stepped

    def state_spec(self) -> dict[str, tuple[bool, torch.dtype, tuple]]:
        """As :meth:`Masters.state_spec`: the per-element states are fp32 in the swap file (float64 for a float64
        buffer's: the checkpoint takes each buffer's from its master, ``state.py``)."""
        if not self.stepped:
            return {}
        small = next((c.small for c in self.chunks if c.small is not None), None)
        if small is None:
            return probe_spec(self.optimizer)
        return {**{k: (False, v.dtype, tuple(v.shape)) for k, v in small.items() if isinstance(v, torch.Tensor)},
                **{n: (True, torch.float32, (3,)) for n in self.state_names}}

    def param_scalars(self) -> list[list[dict[str, torch.Tensor] | None]]:
        """Per flat buffer, per parameter of it: the states that are not per element (Adam's ``step``) of
        this rank's range of the parameter, copies; ``None`` where it has none (never stepped, or no range)."""
        out: list[list[dict[str, torch.Tensor] | None]] = [[None] * len(b) for b in self.bounds]
        for c in self.chunks:
            if c.small is not None and out[c.index][c.k] is None:
                out[c.index][c.k] = {k: v.clone() for k, v in c.small.items()}
        return out

    def _regions(self, index: int, name: str, lo: int, numel: int):
        """``(file offset, position in the range, elements)`` of elements ``[lo, lo + numel)`` of buffer
        ``index``'s master (``name="master"``) or per-element state ``name``, sub-group by sub-group."""
        for c in self._chunks_of[index]:
            a, b = max(lo, c.lo), min(lo + numel, c.lo + c.numel)
            if a < b:
                yield c.offsets[name] + c.dtype.itemsize * (a - c.lo), a - lo, b - a

    def read_range(self, index: int, name: str, lo: int, out: torch.Tensor) -> None:
        """Fill ``out`` (1-D of the master's dtype, contiguous CPU) with elements ``[lo, lo + out.numel())`` of
        buffer ``index``'s master or state ``name``, read from the swap file."""
        for offset, at, n in self._regions(index, name, lo, out.numel()):
            self.file.read_into(offset, out[at:at + n])

    def write_range(self, index: int, name: str, lo: int, values: torch.Tensor) -> None:
        """Write ``values`` (1-D, any float dtype) as elements ``[lo, lo + values.numel())`` of buffer ``index``'s
        master or state ``name`` in the swap file."""
        values = values.to("cpu", self.dtypes[index]).contiguous()
        for offset, at, n in self._regions(index, name, lo, values.numel()):
            self.file.write(offset, values[at:at + n])

    def memory_bytes(self) -> dict[str, int]:
        return {"optimizer": 0, "host": self.arena.nbytes, "disk": self.file.size}

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self.file.close()
