"""Stage 3's prefetch: the order units are gathered in, recorded per pass, and the all-gathers issued ahead of
use within a bound in bytes.

Note [Prefetch]: the order in which units are gathered is recorded in the first step, for forward and for
backward. From then on, gathering unit i issues the all-gathers of units i+1, i+2, ... of the recorded order
while their gathered bytes (with the units they gather along) fit in ``ZeroConfig.prefetch_bytes``; the first
that does not fit, and all after it, wait for their turn. The bytes gathered at once are thus at most one
unit (with its externals) plus ``prefetch_bytes`` (tests/test_stage3_peak.py). The all-gathers run (in
gloo's or NCCL's own thread) while unit i computes. Observing another order re-records it; a wrong guess
costs memory and time for one step, never correctness. All-gathers use a process group of their own, so they
never wait behind a reduce-scatter in one queue.
"""

from __future__ import annotations

from zerorun.zero.units import Unit


class Prefetcher:
    """Mixed into :class:`~zerorun.zero.stage3.Stage3Engine` (Note [Prefetch])."""

    def _note_and_prefetch(self, unit: Unit, phase: str) -> None:
        seen = self._seen[phase]
        if seen and (seen[-1] is unit or (unit.is_root and unit in seen)):  # the root's outputs: one pass
            return
        seen.append(unit)
        order = self._order[phase]
        i = len(seen) - 1
        if not self.config.prefetch or i >= len(order) or order[i] is not unit:
            return
        budget = self.config.prefetch_bytes  # Note [Prefetch]
        for ahead in order[i + 1:]:
            if ahead is unit or ahead.is_root:  # the root's own parameters are gathered per use
                continue
            budget -= self._unit_bytes(ahead)
            if budget < 0:
                return
            self._gather(ahead, wait=False)

    def _unit_bytes(self, unit: Unit) -> int:
        """Bytes of ``unit``'s parameters when gathered, with the units it gathers along (Note [External
        parameters])."""
        own = sum(b.numel * b.data.element_size() for b in unit.buffers)
        return own + sum(sum(b.numel * b.data.element_size() for b in u.buffers) for u in unit.external)

    def _end_pass(self, phase: str) -> None:
        if self._seen[phase] and self._seen[phase] != self._order[phase]:
            self._order[phase] = self._seen[phase]
        self._seen[phase] = []
