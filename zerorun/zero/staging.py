"""Reused host buffers for the optimizer step's copies between the device and host memory (offload).

Note [Offload copies]: with ``offload_optimizer: cpu`` the optimizer steps in host memory on this rank's
gradient slices and writes the parameter slices back. Per step, through buffers made once and reused (pinned
when the slices are on CUDA, so the copies are real DMA that does not block the host; on a CPU-only machine
the same buffers and calls, plain copies):

- in: every gradient slice copied into one host buffer of the gradients' dtype (non-blocking, all issued at
  once), the step's factor (clipping, loss scale) with them, then one event waited for: a single host wait
  per step, where the data is needed, not a synchronize per buffer; 2-byte gradients are then cast into a
  reused fp32 buffer on the host (one host copy) and multiplied by the factor there.
- out: the fp32 masters cast into one host buffer of the parameters' dtype (one host copy; fp32 parameters:
  the masters themselves, no copy) and copied to the device slices non-blocking. The copies' event is waited
  for before that buffer or the masters are written again (:meth:`HostStaging.settle`: at the next step or
  load), so they run behind the next forward instead of stalling this step.

Host memory: (gradient bytes + 4 if the gradients are 2-byte + parameter bytes if 2-byte) per element of this
rank's slices, besides the masters and optimizer states (not counted in ``memory_bytes``, like the reducer's
transient buffers). A float64 slice's gradient, master and parameter are all float64 (Note [Wide parameters]
in ``precision.py``): it is used in place and written back without a cast, in its own part of the buffers
(:func:`typed_views`).
"""

from __future__ import annotations

from typing import Sequence

import torch


def typed_views(numels: Sequence[int], dtypes: Sequence[torch.dtype], device: torch.device | str = "cpu",
                pin: bool = False) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """New 1-D tensors of ``numels[i]`` elements of ``dtypes[i]`` in one allocation, grouped by dtype (in order
    of first appearance), each group contiguous. Returns ``(storage, views, flats)``: the allocation (the one
    flat tensor itself when there is one dtype, else a uint8 tensor whose groups start at multiples of 8
    bytes), a view per tensor, a flat view per dtype group."""
    groups = list(dict.fromkeys(dtypes))
    sizes = {d: sum(n for n, e in zip(numels, dtypes) if e == d) for d in groups}
    if len(groups) <= 1:
        storage = torch.empty(sum(numels), dtype=groups[0] if groups else torch.float32, device=device,
                              pin_memory=pin)
        flats = {d: storage for d in groups}
    else:
        starts, at = {}, 0
        for d in groups:
            starts[d], at = at, at + -(-sizes[d] * d.itemsize // 8) * 8
        storage = torch.empty(at, dtype=torch.uint8, device=device, pin_memory=pin)
        flats = {d: storage[starts[d]:starts[d] + sizes[d] * d.itemsize].view(d) for d in groups}
    views, used = [], dict.fromkeys(groups, 0)
    for n, d in zip(numels, dtypes):
        views.append(flats[d][used[d]:used[d] + n])
        used[d] += n
    return storage, views, list(flats.values())


def _record(cuda: bool):
    """An event recorded on the current CUDA stream (``None`` off CUDA: copies there are synchronous)."""
    if not cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class HostStaging:
    """Host buffers for ``numels`` slices (1-D, in order) whose device is ``device`` (Note [Offload copies]).

    Args:
        numels: elements of each slice.
        param_dtypes: the dtype of each parameter slice written back.
        device: the slices' device (pinned buffers and events when it is CUDA).
        master_dtypes: the dtype of each slice's master (fp32, or float64 for a float64 slice).
    """

    def __init__(self, numels: Sequence[int], param_dtypes: Sequence[torch.dtype], device: torch.device,
                 master_dtypes: Sequence[torch.dtype]) -> None:
        self.numels, self.masters = list(numels), list(master_dtypes)
        self.cuda = device.type == "cuda"
        self.grads: torch.Tensor | None = None  # made at the first fetch, in the gradients' dtypes
        self.grad32: torch.Tensor | None = None
        self._dtypes: list[torch.dtype] = []
        self.coef = torch.ones((), dtype=torch.float64, pin_memory=self.cuda)
        casts = [i for i, (p, m) in enumerate(zip(param_dtypes, self.masters)) if p != m]
        self.out, views, _ = (typed_views([self.numels[i] for i in casts], [param_dtypes[i] for i in casts],
                                          pin=self.cuda) if casts else (None, [], []))
        self._outs = dict(zip(casts, views))  # slice index -> its host buffer in the parameter's dtype
        self._sent = None  # the event of the last copies out

    def _make(self, dtypes: list[torch.dtype]) -> None:
        """The gradients' buffers (in ``dtypes``) and, for those not in their master's dtype, the cast ones."""
        self._dtypes = dtypes
        self.grads, self._in, flats = typed_views(self.numels, dtypes, pin=self.cuda)
        self._casts = [i for i, d in enumerate(dtypes) if d != self.masters[i]]
        self.grad32, views, cast_flats = (typed_views([self.numels[i] for i in self._casts],
                                                      [self.masters[i] for i in self._casts])
                                          if self._casts else (self.grads, [], []))
        self._fp = list(self._in)
        for i, v in zip(self._casts, views):
            self._fp[i] = v
        self._scaled = cast_flats + [f for f in flats if f.dtype in self.masters]  # each master element once

    def fetch(self, grads: Sequence[torch.Tensor], coef: torch.Tensor | None) -> list[torch.Tensor]:
        """``grads[i] * coef`` (``coef`` 0-d on their device, ``None`` for 1) as host views in the masters'
        dtypes, one per slice, valid until the next fetch. One wait for all the copies."""
        dtypes = [g.dtype for g in grads]
        if self.grads is None or self._dtypes != dtypes:
            self._make(dtypes)
        torch._foreach_copy_(self._in, [g.reshape(-1) for g in grads], non_blocking=self.cuda)
        if coef is not None:
            self.coef.copy_(coef, non_blocking=self.cuda)
        event = _record(self.cuda)
        if event is not None:
            event.synchronize()  # the one host wait of the step: the CPU step needs the gradients
        if self._casts:
            torch._foreach_copy_([self._fp[i] for i in self._casts], [self._in[i] for i in self._casts])
        if coef is not None:
            for flat in self._scaled:
                flat.mul_(self.coef)
        return list(self._fp)

    def send(self, values: Sequence[torch.Tensor], slices: Sequence[torch.Tensor]) -> None:
        """Copy ``values`` (the host masters, one per slice, shaped as it) into the device ``slices`` (cast to
        their dtype), non-blocking; ``values`` must not be written before :meth:`settle`."""
        self.settle()
        src = list(values)
        if self._outs:
            torch._foreach_copy_(list(self._outs.values()), [values[i] for i in self._outs])
            for i, out in self._outs.items():
                src[i] = out
        torch._foreach_copy_(list(slices), src, non_blocking=self.cuda)
        self._sent = _record(self.cuda)

    def settle(self) -> None:
        """Wait until the copies of the last :meth:`send` are done (their sources may then be written)."""
        if self._sent is not None:
            self._sent.synchronize()
            self._sent = None


class ChunkStaging:
    """Disk offload's copies (Note [Offload copies], Note [Disk paging]): two halves of ``chunk`` elements each
    for gradients in (``grad_dtype``) and parameters out (``param_dtype``), pinned on CUDA, reused every step
    (gradients cast on the host to ``master_dtype``, fp32 or a float64 master's own);
    sub-group ``k`` uses half ``k % 2``, so one sub-group's copies run while its neighbour steps. Each copy is
    non-blocking and ordered by an event, waited for only before its half is read or written again."""

    def __init__(self, chunk: int, grad_dtype: torch.dtype, param_dtype: torch.dtype, device: torch.device,
                 master_dtype: torch.dtype = torch.float32) -> None:
        self.cuda = device.type == "cuda"
        self.dtype, self.master_dtype = grad_dtype, master_dtype
        self.ins = [torch.empty(chunk, dtype=grad_dtype, pin_memory=self.cuda) for _ in range(2)]
        self.outs = [torch.empty(chunk, dtype=param_dtype, pin_memory=self.cuda) for _ in range(2)]
        self.grad32 = torch.empty(chunk if grad_dtype != master_dtype else 0, dtype=master_dtype)
        self.coef = torch.ones((), dtype=torch.float64, pin_memory=self.cuda)
        self._in_events: list = [None, None]
        self._out_events: list = [None, None]

    def set_factor(self, coef: torch.Tensor | None) -> None:
        """Start copying ``coef``, the step's 0-d factor (``None``: none), before the step's first :meth:`take`
        (whose event then covers it)."""
        if coef is not None:
            self.coef.copy_(coef, non_blocking=self.cuda)

    def take(self, grad: torch.Tensor, lo: int, numel: int, half: int) -> None:
        """Start copying ``grad[lo:lo + numel]`` (1-D device slice) into half ``half``."""
        self.ins[half][:numel].copy_(grad[lo:lo + numel], non_blocking=self.cuda)
        self._in_events[half] = _record(self.cuda)

    def grad(self, half: int, numel: int, scaled: bool) -> torch.Tensor:
        """The gradient copied into half ``half`` in the master's dtype (times the factor when ``scaled``): a
        reused buffer, valid until the next call."""
        if self._in_events[half] is not None:
            self._in_events[half].synchronize()
            self._in_events[half] = None
        g = self.ins[half][:numel]
        if g.dtype != self.master_dtype:  # 2-byte gradients: cast on the host (fp32, fp64 ones used in place)
            g = self.grad32[:numel]
            g.copy_(self.ins[half][:numel])
        if scaled:
            g.mul_(self.coef)
        return g

    def give(self, values: torch.Tensor, dest: torch.Tensor, half: int) -> None:
        """Copy the host master ``values`` into the device slice ``dest`` (cast), non-blocking, through half
        ``half`` (waiting first for that half's previous copy)."""
        if self._out_events[half] is not None:
            self._out_events[half].synchronize()
        out = self.outs[half][:values.numel()]
        out.copy_(values)
        dest.copy_(out, non_blocking=self.cuda)
        self._out_events[half] = _record(self.cuda)

    def settle(self) -> None:
        """Wait for every copy out (the end of a step: the parameters are then in place)."""
        for half, event in enumerate(self._out_events):
            if event is not None:
                event.synchronize()
                self._out_events[half] = None
