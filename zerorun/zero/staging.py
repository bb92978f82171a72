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
transient buffers).
"""

from __future__ import annotations

from typing import Sequence

import torch


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
        param_dtype: the dtype of the parameter slices written back.
        device: the slices' device (pinned buffers and events when it is CUDA).
    """

    def __init__(self, numels: Sequence[int], param_dtype: torch.dtype, device: torch.device) -> None:
        self.numels = list(numels)
        self.total = sum(self.numels)
        self.cuda = device.type == "cuda"
        self.grads: torch.Tensor | None = None  # made at the first fetch, in the gradients' dtype
        self.grad32: torch.Tensor | None = None
        self.coef = torch.ones((), dtype=torch.float32, pin_memory=self.cuda)
        self.out = (None if param_dtype == torch.float32 else
                    torch.empty(self.total, dtype=param_dtype, pin_memory=self.cuda))
        self._sent = None  # the event of the last copies out

    def fetch(self, grads: Sequence[torch.Tensor], coef: torch.Tensor | None) -> list[torch.Tensor]:
        """``grads[i] * coef`` (``coef`` 0-d fp32 on their device, ``None`` for 1) as fp32 host views, one per
        slice, valid until the next fetch. One wait for all the copies."""
        dtype = grads[0].dtype
        if self.grads is None or self.grads.dtype != dtype:
            self.grads = torch.empty(self.total, dtype=dtype, pin_memory=self.cuda)
            self.grad32 = self.grads if dtype == torch.float32 else torch.empty(self.total, dtype=torch.float32)
        torch._foreach_copy_(list(self.grads.split(self.numels)), [g.reshape(-1) for g in grads],
                             non_blocking=self.cuda)
        if coef is not None:
            self.coef.copy_(coef, non_blocking=self.cuda)
        event = _record(self.cuda)
        if event is not None:
            event.synchronize()  # the one host wait of the step: the CPU step needs the gradients
        if self.grad32 is not self.grads:
            self.grad32.copy_(self.grads)
        if coef is not None:
            self.grad32.mul_(self.coef)
        return list(self.grad32.split(self.numels))

    def send(self, values: Sequence[torch.Tensor], slices: Sequence[torch.Tensor]) -> None:
        """Copy ``values`` (fp32 host tensors, one per slice, shaped as it) into the device ``slices`` (cast to
        their dtype), non-blocking; ``values`` must not be written before :meth:`settle`."""
        self.settle()
        src = list(values)
        if self.out is not None:
            src = list(self.out.split(self.numels))
            torch._foreach_copy_(src, list(values))
        torch._foreach_copy_(list(slices), src, non_blocking=self.cuda)
        self._sent = _record(self.cuda)

    def settle(self) -> None:
        """Wait until the copies of the last :meth:`send` are done (their sources may then be written)."""
        if self._sent is not None:
            self._sent.synchronize()
            self._sent = None


class ChunkStaging:
    """Disk offload's copies (Note [Offload copies], Note [Disk paging]): two halves of ``chunk`` elements each
    for gradients in (``grad_dtype``) and parameters out (``param_dtype``), pinned on CUDA, reused every step;
    sub-group ``k`` uses half ``k % 2``, so one sub-group's copies run while its neighbour steps. Each copy is
    non-blocking and ordered by an event, waited for only before its half is read or written again."""

    def __init__(self, chunk: int, grad_dtype: torch.dtype, param_dtype: torch.dtype, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.dtype = grad_dtype
        self.ins = [torch.empty(chunk, dtype=grad_dtype, pin_memory=self.cuda) for _ in range(2)]
        self.outs = [torch.empty(chunk, dtype=param_dtype, pin_memory=self.cuda) for _ in range(2)]
        self.grad32 = torch.empty(chunk if grad_dtype != torch.float32 else 0, dtype=torch.float32)
        self.coef = torch.ones((), dtype=torch.float32, pin_memory=self.cuda)
        self._in_events: list = [None, None]
        self._out_events: list = [None, None]

    def take(self, grad: torch.Tensor, lo: int, numel: int, half: int, coef: torch.Tensor | None) -> None:
        """Start copying ``grad[lo:lo + numel]`` (1-D device slice) into half ``half`` (and ``coef``, the step's
        0-d factor, with the first sub-group's copy)."""
        self.ins[half][:numel].copy_(grad[lo:lo + numel], non_blocking=self.cuda)
        if coef is not None:
            self.coef.copy_(coef, non_blocking=self.cuda)
        self._in_events[half] = _record(self.cuda)

    def grad(self, half: int, numel: int, scaled: bool) -> torch.Tensor:
        """The fp32 gradient copied into half ``half`` (times the factor when ``scaled``): a reused buffer, valid
        until the next call."""
        if self._in_events[half] is not None:
            self._in_events[half].synchronize()
            self._in_events[half] = None
        g = self.ins[half][:numel]
        if g.dtype != torch.float32:  # 2-byte gradients: cast on the host (fp32 ones are used in place)
            g = self.grad32[:numel]
            g.copy_(self.ins[half][:numel])
        if scaled:
            g.mul_(self.coef)
        return g

    def give(self, values: torch.Tensor, dest: torch.Tensor, half: int) -> None:
        """Copy the fp32 host ``values`` into the device slice ``dest`` (cast), non-blocking, through half
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
