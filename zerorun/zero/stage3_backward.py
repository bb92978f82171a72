"""Stage 3's backward: when a unit's gradient buckets are ready and the unit can be freed (Note [Unit
lifecycle] in ``stage3.py``), the end of a unit's backward, and the checks made beside the step's norm
all-reduce (Note [Same units on every rank] in ``stage3_checks.py``).
"""

from __future__ import annotations

import torch

from zerorun.zero.stage3_checks import check_backward_units, check_gather_order
from zerorun.zero.torch_internals import in_backward
from zerorun.zero.units import Unit, UnitState


class Stage3Backward:
    """Mixed into :class:`~zerorun.zero.stage3.Stage3Engine` (ahead of ``ZeroEngine``, whose backward it
    extends)."""

    def _on_bucket_ready(self, buf) -> None:
        """The reducer found ``buf``'s gradient complete: once every trainable bucket of its unit is, and the
        unit's backward has begun on this rank (a bucket known unused is complete before backward starts; the
        unit must not be freed and gathered again, on this rank only), the unit is freed (a unit holding frozen
        parameters, whose last use in backward no gradient signals, is freed at the end of backward)."""
        unit = buf.unit
        unit.ready_buffers += 1
        self._free_if_done(unit)

    def _free_if_done(self, unit: Unit) -> None:
        if (unit.ready_buffers == len(unit.trainable) and len(unit.trainable) == len(unit.buffers)
                and in_backward() and (unit in self._seen["backward"] or unit.outer)):
            self._outer_free_if_done(unit) if unit.outer else self._free(unit)

    def _unit_backward_done(self, unit: Unit) -> None:
        """Note [End of a unit's backward]: called when autograd has the gradients of one forward call's inputs
        of ``unit``. After the last such call of the step, a bucket of the unit whose missing parameters will get
        no gradient in this backward (an expert no token reached on this rank) is complete now, with zeros for
        them, instead of at the end of backward (``GradReducer.force_ready``)."""
        unit.open_calls -= 1
        if unit.open_calls > 0:
            return
        for buf in unit.trainable:
            self.reducer.force_ready(buf)
        if unit.ends_agreed:  # Note [Program order] in reducer.py: reached on every rank (else at the end)
            self.reducer.launch(unit.trainable)
        self._free_if_done(unit)

    def backward(self, loss: torch.Tensor) -> None:
        """As :meth:`ZeroEngine.backward`; the root unit is gathered first, whatever structure the forward
        returned the loss in. What :meth:`_check_backward` refuses raises before any gather or check."""
        self._check_backward(loss)
        if isinstance(loss, torch.Tensor):
            check_backward_units(self, loss)
        if self._root.state is UnitState.FREE and isinstance(loss, torch.Tensor) and loss.requires_grad:
            self._pre_backward(self._root, None)
        self._outer_backward_start()  # Note [Outer units]
        super().backward(loss)

    def _finish_backward(self) -> None:
        super()._finish_backward()
        self._end_pass("backward")
        for unit in self.units:
            unit.ready_buffers = 0
            unit.open_calls = 0
            unit.ends_agreed = False
            unit.deferred = False
        self._free_all()

    def _all_reduce_norm(self, sq: torch.Tensor) -> torch.Tensor:
        """Note [Same units on every rank]: with the squared norm's all-reduce, the ranks agree on a digest of
        the units each all-gathered since the last step (on the host: Note [Agreements on the host] in comm.py);
        a difference between ranks raises on every rank."""
        codes = self._outer_codes() if self._learning else []  # Note [Outer units]: the first step's windows
        sq, sums, squares = check_gather_order(self, sq, self._gather_log, codes)
        self._gather_log = []
        if self._learning:
            self._outer_agree(sums, squares)
        return sq

    def load_master_slices(self, values, states=None, param_scalars=None) -> None:
        """As :meth:`ZeroEngine.load_master_slices`; persistent parameters (Note [Persistent parameters]),
        frozen ones included, are all-gathered again from the loaded slices."""
        super().load_master_slices(values, states, param_scalars)
        frozen = [b for b in self._persistent_unit.buffers if b.group_index < 0]
        if frozen:
            self.comm.wait([self.comm.all_gather(buf.data, buf.shard_data) for buf in frozen])
