"""fp32 master slices and the user's optimizer over them, in device memory (:class:`Masters`) or in host memory
(:class:`CpuMasters`); the disk variant is ``disk.py``'s. The design notes are in ``offload.py``."""

from __future__ import annotations

from typing import Any, Sequence

import torch


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
