"""Where the fp32 master slices and the optimizer states live, and how the optimizer step runs over them.

The engine hands over this rank's parameter slices (one per flat buffer: stage 0 the whole buffer) and, at
each step, this rank's reduced gradient slices; a :class:`Masters` steps the user's ``torch.optim`` optimizer
and writes the updated values back into the parameter slices (cast to their dtype).

- :class:`Masters` (``offload_optimizer: none``): in device memory. fp32 training aliases the master to the
  parameter slice itself (no copy); mixed precision keeps a separate fp32 copy (Note [Mixed precision]).
- :class:`CpuMasters` (``cpu``): masters and states in host memory (pinned when the device is CUDA), the step
  on the CPU (ZeRO-Offload, Ren et al., arXiv:2101.06840, §4). Note [Offload overlap]: the device-to-host
  copies of every gradient slice are issued at once (non-blocking into pinned memory); buffer i is stepped on
  the CPU as soon as its copy is done, while the copies of buffers i+1.. are still in flight, and its updated
  parameters are copied back non-blocking. On a CPU-only machine the "device" is the host and the copies are
  plain copies.
- :class:`DiskMasters` (``disk``): masters and states in a file under ``offload_path``, paged through a
  bounded host buffer (ZeRO-Infinity's NVMe offload, Rajbhandari et al., arXiv:2104.07857, §5). Note [Disk
  paging]: each master slice is cut into sub-groups of at most ``chunk`` elements, each one optimizer
  parameter; the step reads a sub-group (master + its state tensors) into one half of the host buffer while
  the previous sub-group steps in the other half (a reader thread: ``os.preadv`` releases the GIL), then
  writes it back. Host memory for optimizer states is the buffer, whatever the model size. Between steps the
  optimizer's parameters are empty tensors and ``optimizer.state`` holds nothing: the states are in the file
  (read them with :meth:`Masters.state_slices`). Note [Swap files]: one file per rank, named
  ``zerorun-offload-rank<R>-<pid>.bin``, held under an exclusive ``flock`` while the process lives; it is
  removed when the engine is closed or the process exits, and a file left by a crashed run (its lock died
  with it) is removed by the next run that uses the folder.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import glob
import os
import weakref
from typing import Any, Sequence

import torch

#: Swap-file regions start at multiples of this many bytes (Note [Swap files]).
SWAP_ALIGN = 64


def swap_region_bytes(nbytes: int) -> int:
    """Bytes a region of ``nbytes`` bytes takes in a swap file: rounded up to :data:`SWAP_ALIGN`."""
    return (nbytes + SWAP_ALIGN - 1) // SWAP_ALIGN * SWAP_ALIGN


def subgroup_elements(buffer_bytes: int, n_states: int) -> int:
    """Elements of one disk-offload sub-group (Note [Disk paging]): each half of a host buffer of
    ``buffer_bytes`` bytes holds that many elements of fp32 master and ``n_states`` fp32 optimizer states,
    rounded down to a multiple of 16 (0: the buffer is too small)."""
    return (buffer_bytes // 2 // (4 * (1 + n_states))) // 16 * 16


def _group_params(params: list[torch.Tensor], group_of: list[int], group_options: list[dict]) -> list[dict]:
    groups = [dict(opts, params=[]) for opts in group_options]
    for p, g in zip(params, group_of):
        groups[g]["params"].append(p)
    return [g for g in groups if g["params"]]


def _state_bytes(state: dict) -> int:
    return sum(v.nbytes for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _fp32_grad(grad: torch.Tensor, coef: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A new fp32 tensor on ``device``: ``grad * coef`` (``coef`` a 0-d tensor, or ``None`` for 1)."""
    g = grad.to(device=device, dtype=torch.float32, copy=True)
    if coef is not None:
        g.mul_(coef.to(device))
    return g


class Masters:
    """fp32 master slices in device memory and the user's optimizer over them (``offload_optimizer: none``).

    Args:
        slices: this rank's parameter slices, one per flat buffer (1-D, any float dtype); updated in place.
        group_of: the optimizer param group of each slice.
        group_options: per-group options (``lr``, ``weight_decay``, ...), as in a torch param group.
        optimizer_cls, optimizer_kwargs: the user's elementwise ``torch.optim`` optimizer.
        alias_grads: fp32 training only: the gradient slices (same shapes); the masters then are the
            parameter slices themselves and these their permanent ``.grad`` (no copy at all).
    """

    def __init__(self, slices: list[torch.Tensor], group_of: list[int], group_options: list[dict],
                 optimizer_cls: type, optimizer_kwargs: dict[str, Any],
                 alias_grads: list[torch.Tensor] | None = None) -> None:
        self.slices = slices
        self.alias = alias_grads is not None
        self.params = [self._new_master(s) for s in slices]
        if self.alias:
            for m, g in zip(self.params, alias_grads):
                m.grad = g
        self.optimizer = optimizer_cls(_group_params(self.params, group_of, group_options), **optimizer_kwargs)

    def _new_master(self, s: torch.Tensor) -> torch.Tensor:
        if self.alias:
            return s.detach().requires_grad_(True)
        return s.detach().to(torch.float32, copy=True).requires_grad_(True)

    def step(self, grads: Sequence[torch.Tensor], coef: torch.Tensor | None) -> None:
        """Step on ``grads`` (this rank's gradient slices, any float dtype) times ``coef`` (0-d fp32 tensor:
        clipping and loss-scale factor; ``None`` for 1), then write the masters into the parameter slices."""
        if self.alias:
            if coef is not None:
                torch._foreach_mul_(list(grads), coef)
            self.optimizer.step()
            return
        for m, g, s in zip(self.params, grads, self.slices):  # one buffer at a time: fp32 grads are transient
            m.grad = _fp32_grad(g, coef, m.device)
            self.optimizer.step()
            m.grad = None
            s.copy_(m.detach())

    def master_slices(self) -> list[torch.Tensor]:
        """This rank's fp32 master values, one 1-D tensor per flat buffer (views: do not modify)."""
        return [m.detach() for m in self.params]

    def state_slices(self) -> list[dict[str, torch.Tensor]]:
        """The optimizer state of each master (``{name: tensor}``, e.g. Adam's ``exp_avg``, ``exp_avg_sq``,
        ``step``); empty before the first step."""
        return [dict(self.optimizer.state.get(m, {})) for m in self.params]

    def buffer_states(self) -> list[dict[str, torch.Tensor]]:
        """The optimizer state of each flat buffer's master, in :attr:`slices` order (``{name: tensor}``: states
        with one element per master element are 1-D like the master; scalars such as ``step`` as they are);
        empty dicts before the first step. In memory: the optimizer's own tensors (do not modify)."""
        return self.state_slices()

    def load(self, values: Sequence[torch.Tensor], states: Sequence[dict[str, torch.Tensor]] | None) -> None:
        """Overwrite the masters with ``values`` (one 1-D fp32 tensor per flat buffer, shaped as
        :meth:`master_slices`; may be those very tensors) and the optimizer state with ``states`` (per buffer,
        as :meth:`buffer_states` gives them; ``None`` or empty dicts: no state, as before the first step), then
        write the masters into the parameter slices (:meth:`write_params`). Used to resume a checkpoint."""
        with torch.no_grad():
            for m, v in zip(self.params, values):
                m.copy_(v.reshape(m.shape))
        self.optimizer.state.clear()
        for m, state in zip(self.params, states or [{}] * len(self.params)):
            if state:
                self.optimizer.state[m] = {k: v.to(m.device) if v.shape == m.shape else v.clone()
                                           for k, v in state.items()}
        self.write_params()

    def write_params(self) -> None:
        """Write the masters into this rank's parameter slices, cast to the parameters' dtype (nothing to do
        when they are the same tensors: fp32 without offload)."""
        if not self.alias:
            for m, s in zip(self.params, self.slices):
                s.copy_(m.detach())

    def memory_bytes(self) -> dict[str, int]:
        """``{"optimizer": bytes of states and separate fp32 masters in device memory, "host": in host memory
        off the device, "disk": in files}``."""
        own = 0 if self.alias else sum(m.nbytes for m in self.params)
        return {"optimizer": own + _state_bytes(self.optimizer.state), "host": 0, "disk": 0}

    def close(self) -> None:
        """Release files and threads (nothing to release here)."""


class CpuMasters(Masters):
    """Masters and optimizer states in host memory, pinned when the parameters are on CUDA, the step on the
    CPU (Note [Offload overlap]). Arguments as :class:`Masters` (never aliased)."""

    def __init__(self, slices, group_of, group_options, optimizer_cls, optimizer_kwargs) -> None:
        self.device = slices[0].device
        self.pin = self.device.type == "cuda"
        super().__init__(slices, group_of, group_options, optimizer_cls, optimizer_kwargs)

    def _new_master(self, s: torch.Tensor) -> torch.Tensor:
        m = torch.empty(s.numel(), dtype=torch.float32, pin_memory=self.pin)
        m.copy_(s.detach().reshape(-1))
        return m.requires_grad_(True)

    def step(self, grads, coef) -> None:
        cpu = torch.device("cpu")
        if not self.pin:  # host-only: the copies are plain copies, one buffer at a time
            super().step(grads, coef)
            return
        staged, events = [], []
        for g in grads:  # every copy in flight at once; buffer i steps when its copy is done
            h = torch.empty(g.numel(), dtype=g.dtype, pin_memory=True)
            h.copy_(g.reshape(-1), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            staged.append(h)
            events.append(ev)
        coef_cpu = None if coef is None else coef.to(cpu)
        back = []
        for m, h, ev, s in zip(self.params, staged, events, self.slices):
            ev.synchronize()
            m.grad = _fp32_grad(h, coef_cpu, cpu)
            self.optimizer.step()
            m.grad = None
            out = m.detach().to(s.dtype).pin_memory()
            s.copy_(out, non_blocking=True)
            back.append(out)
        torch.cuda.current_stream().synchronize()

    def memory_bytes(self) -> dict[str, int]:
        held = sum(m.nbytes for m in self.params) + _state_bytes(self.optimizer.state)
        if self.pin:
            return {"optimizer": 0, "host": held, "disk": 0}
        return {"optimizer": held, "host": 0, "disk": 0}  # a CPU-only machine: the host is the device


# ------------------------------------------------------------------------------------------------- disk
_PREFIX = "zerorun-offload-"


def remove_stale_swap_files(folder: str) -> list[str]:
    """Remove swap files in ``folder`` whose owner is gone (no process holds their ``flock``: Note [Swap
    files]). Returns the removed paths."""
    removed = []
    for path in sorted(glob.glob(os.path.join(folder, _PREFIX + "*.bin"))):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live run owns it
        finally:
            os.close(fd)
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _close_and_remove(fd: int, path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)


class SwapFile:
    """One rank's swap file under ``folder`` (Note [Swap files]): fixed regions allocated by
    :meth:`allocate`, read and written with positional I/O (``os.preadv``/``os.pwrite``), so the page cache,
    not this process's resident memory, holds what was written.

    Raises:
        OSError: ``folder`` cannot be created or written.
    """

    def __init__(self, folder: str, rank: int) -> None:
        os.makedirs(folder, exist_ok=True)
        # The scan and the creation of our locked file happen under one folder lock, so a rank starting at
        # the same moment never takes our new file for a stale one.
        lock = os.open(os.path.join(folder, f".{_PREFIX}lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.removed_stale = remove_stale_swap_files(folder)
            self.path = os.path.join(folder, f"{_PREFIX}rank{rank}-{os.getpid()}.bin")
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(lock)
        self.size = 0
        self._finalizer = weakref.finalize(self, _close_and_remove, self.fd, self.path)

    def allocate(self, nbytes: int) -> int:
        """A new region of ``nbytes`` bytes; returns its offset (64-byte aligned)."""
        offset = self.size
        self.size += swap_region_bytes(nbytes)
        os.ftruncate(self.fd, self.size)
        return offset

    def write(self, offset: int, t: torch.Tensor) -> None:
        """Write the bytes of ``t`` (contiguous, CPU) at ``offset``."""
        view = memoryview(t.detach().contiguous().view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def read_into(self, offset: int, t: torch.Tensor) -> None:
        """Fill ``t`` (contiguous, CPU) with the bytes at ``offset``."""
        view = memoryview(t.view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"{self.path}: unexpected end of file at byte {offset + done}")
            done += n

    def close(self) -> None:
        """Close and remove the file (also done at process exit)."""
        self._finalizer()


def tensor_state_names(optimizer_cls: type, optimizer_kwargs: dict[str, Any]) -> list[str]:
    """Names of the optimizer's per-element state tensors (shaped like the parameter), found by stepping the
    optimizer once on a 3-element probe: e.g. ``["exp_avg", "exp_avg_sq"]`` for Adam (its ``step`` is 0-d)."""
    p = torch.zeros(3, requires_grad=True)
    opt = optimizer_cls([p], **optimizer_kwargs)
    p.grad = torch.zeros(3)
    opt.step()
    return [k for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.shape == p.shape]


class _Chunk:
    """One sub-group: elements ``[lo, lo + numel)`` of master ``index``; its file regions and small state."""

    def __init__(self, index: int, lo: int, numel: int, param: torch.Tensor, offsets: dict[str, int]) -> None:
        self.index, self.lo, self.numel, self.param, self.offsets = index, lo, numel, param, offsets
        self.small: dict[str, Any] | None = None  # state that is not per element (Adam's step); None: no state yet


class DiskMasters(Masters):
    """Masters and optimizer states in a swap file under ``folder``, paged through a host buffer of
    ``buffer_bytes`` bytes in sub-groups (Note [Disk paging]). Other arguments as :class:`Masters`.

    Raises:
        ValueError: ``buffer_bytes`` too small to hold one element's master and states twice, or the swap
            file cannot be created in ``folder`` (message names ``zero.offload_path``).
    """

    def __init__(self, slices, group_of, group_options, optimizer_cls, optimizer_kwargs, *, folder: str,
                 buffer_bytes: int, rank: int) -> None:
        self.slices = slices
        self.alias = False
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
        empty = torch.empty(0, dtype=torch.float32)
        for i, s in enumerate(slices):
            for lo in range(0, s.numel(), self.chunk):
                n = min(self.chunk, s.numel() - lo)
                offsets = {name: self.file.allocate(4 * n) for name in ["master", *self.state_names]}
                self.file.write(offsets["master"], s.detach()[lo:lo + n].to("cpu", torch.float32))
                self.chunks.append(_Chunk(i, lo, n, empty.clone().requires_grad_(True), offsets))
        self.params = [c.param for c in self.chunks]
        self.optimizer = optimizer_cls(_group_params(self.params, [group_of[c.index] for c in self.chunks],
                                                     group_options), **optimizer_kwargs)
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerorun-swap")

    def _read(self, c: _Chunk, half: int) -> dict[str, torch.Tensor]:
        """Page chunk ``c`` into host-buffer half ``half``: ``{"master": ..., state name: ...}`` fp32 views."""
        arena, out = self.halves[half], {}
        names = ["master", *self.state_names] if c.small is not None else ["master"]
        for k, name in enumerate(names):
            out[name] = arena[k * 4 * self.chunk:k * 4 * self.chunk + 4 * c.numel].view(torch.float32)
            self.file.read_into(c.offsets[name], out[name])
        return out

    def step(self, grads, coef) -> None:
        cpu = torch.device("cpu")
        coef_cpu = None if coef is None else coef.to(cpu)
        pending = self._reader.submit(self._read, self.chunks[0], 0)
        for k, c in enumerate(self.chunks):
            views = pending.result()
            if k + 1 < len(self.chunks):  # Note [Disk paging]: read the next sub-group while this one steps
                pending = self._reader.submit(self._read, self.chunks[k + 1], (k + 1) % 2)
            p = c.param
            p.data = views["master"]
            if c.small is not None:
                self.optimizer.state[p] = {**c.small, **{n: views[n] for n in self.state_names}}
            p.grad = _fp32_grad(grads[c.index][c.lo:c.lo + c.numel], coef_cpu, cpu)
            self.optimizer.step()
            p.grad = None
            state = self.optimizer.state.pop(p, {})  # a stateless optimizer (SGD without momentum) keeps none
            self.file.write(c.offsets["master"], p.data)
            for n in self.state_names:
                self.file.write(c.offsets[n], state[n])
            c.small = {n: v for n, v in state.items() if n not in self.state_names}
            # blocking: the host-buffer half is paged over two sub-groups later
            self.slices[c.index][c.lo:c.lo + c.numel].copy_(p.data)
            p.data = torch.empty(0, dtype=torch.float32)

    def master_slices(self) -> list[torch.Tensor]:
        """Read from the swap file: new fp32 CPU tensors, one per flat buffer."""
        out = [torch.empty(s.numel(), dtype=torch.float32) for s in self.slices]
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
                    state[n] = torch.empty(c.numel, dtype=torch.float32)
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
            if not state:  # every sub-group of a buffer steps together: the first one's scalars stand for all
                state.update({k: v.clone() for k, v in c.small.items()})
                state.update({n: torch.empty(self.slices[c.index].numel(), dtype=torch.float32)
                              for n in self.state_names})
            for n in self.state_names:
                self.file.read_into(c.offsets[n], state[n][c.lo:c.lo + c.numel])
        return out

    def load(self, values, states) -> None:
        """As :meth:`Masters.load`, written to the swap file sub-group by sub-group."""
        for c in self.chunks:
            master = values[c.index].reshape(-1)[c.lo:c.lo + c.numel].to("cpu", torch.float32).contiguous()
            self.file.write(c.offsets["master"], master)
            state = states[c.index] if states else None
            c.small = None
            if state:
                for n in self.state_names:
                    self.file.write(c.offsets[n], state[n][c.lo:c.lo + c.numel].to("cpu", torch.float32).contiguous())
                # scalars (Adam's step) are incremented in place: one tensor per sub-group
                c.small = {k: v.detach().clone() for k, v in state.items() if k not in self.state_names}
            self.slices[c.index][c.lo:c.lo + c.numel].copy_(master)

    def write_params(self) -> None:
        for s, master in zip(self.slices, self.master_slices()):
            s.copy_(master)

    def memory_bytes(self) -> dict[str, int]:
        return {"optimizer": 0, "host": self.arena.nbytes, "disk": self.file.size}

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self.file.close()
