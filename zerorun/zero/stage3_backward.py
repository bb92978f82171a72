"""Stage 3's backward: when a unit's gradient buckets are ready and the unit can be freed (Note [Unit
lifecycle] in ``stage3.py``), the end of a unit's backward, and the checks folded into the step's norm
all-reduce (Note [Same units on every rank] in ``stage3_checks.py``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zerorun.zero.stage3_checks import check_gather_order
from zerorun.zero.units import Unit, UnitState


class Stage3Backward:
    """Mixed into :class:`~zerorun.zero.stage3.Stage3Engine` (ahead of ``ZeroEngine``, whose backward it
    extends)."""

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        super()._on_grad_ready(p)
        buf = self._slots[p].buffer
        if self._ready_count[buf] == len(buf.params):
            unit = buf.unit
            unit.ready_buffers += 1
            # a frozen parameter's last use in backward can come after the unit's last gradient: such a unit
            # is freed at the end of backward
            if unit.ready_buffers == len(unit.trainable) and len(unit.trainable) == len(unit.buffers):
                self._free(unit)

    def _unit_backward_done(self, unit: Unit) -> None:
        """Note [End of a unit's backward]: called when autograd has the gradients of one forward call's inputs
        of ``unit``. After the last such call of the step, a bucket of the unit whose missing parameters will get
        no gradient in this backward (an expert no token reached on this rank) is ready now, with zeros for
        them, instead of at the end of backward: no rank then holds back a reduce-scatter that another rank
        waits for inside a gradient hook while this one waits for that rank's all-gathers."""
        unit.open_calls -= 1
        if unit.open_calls > 0:
            return
        for buf in unit.trainable:
            if self._ready_count[buf] == len(buf.params) or buf in self._ready:
                continue
            got = self._written.get(buf, set())
            if any(p not in got and torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(p).node)
                   for p in buf.params):
                continue  # a gradient is still coming (the parameter is also used outside the unit)
            self._ready_count[buf] = len(buf.params)
            self._ready.add(buf)
            unit.ready_buffers += 1
        self._launch_ready()
        if unit.ready_buffers == len(unit.trainable) and len(unit.trainable) == len(unit.buffers):
            self._free(unit)

    def backward(self, loss: torch.Tensor) -> None:
        """As :meth:`ZeroEngine.backward`; the root unit is gathered first, whatever structure the forward
        returned the loss in."""
        if self._root.state is UnitState.FREE and isinstance(loss, torch.Tensor) and loss.requires_grad:
            self._pre_backward(self._root, None)
        super().backward(loss)

    def _finish_backward(self) -> None:
        super()._finish_backward()
        self._end_pass("backward")
        for unit in self.units:
            unit.ready_buffers = 0
            unit.open_calls = 0
        self._free_all()

    def _all_reduce_norm(self, sq: torch.Tensor) -> torch.Tensor:
        """Note [Same units on every rank]: the squared norm is all-reduced together with a digest of the
        units this rank all-gathered since the last step; a difference between ranks raises on every rank."""
        sq = check_gather_order(self, sq, self._gather_log)
        self._gather_log = []
        return sq

    def load_master_slices(self, values, states=None) -> None:
        """As :meth:`ZeroEngine.load_master_slices`; persistent parameters (Note [Persistent parameters]),
        frozen ones included, are all-gathered again from the loaded slices."""
        super().load_master_slices(values, states)
        frozen = [b for b in self._persistent_unit.buffers if b.group_index < 0]
        if frozen:
            self._ag_comm.wait([self._ag_comm.all_gather(buf.data, buf.shard_data) for buf in frozen])
