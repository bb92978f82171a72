"""A rank's bytes sent over a run, from its step events' ``comm_bytes`` and ``comm_bytes_inter_node``
(telemetry/events.py), for the summary's means per step. Pure data, as telemetry/state.py."""

from __future__ import annotations

from dataclasses import dataclass

from zerorun.telemetry.events import number


@dataclass
class CommTotals:
    """Bytes sent (``sent``) and, of them, to ranks on other nodes (``inter_node``: Note [Nodes of a group] in
    zero/topology.py) over the steps of the step events that reported each (``sent_steps``,
    ``inter_node_steps``: a baseline reports no bytes to other nodes, an older run neither)."""

    sent: float = 0.0
    sent_steps: int = 0
    inter_node: float = 0.0
    inter_node_steps: int = 0

    def add(self, data: dict, steps: int) -> None:
        """Count one step event's fields ``data``, which cover ``steps`` steps."""
        sent, inter = number(data, "comm_bytes"), number(data, "comm_bytes_inter_node")
        if sent is not None:
            self.sent, self.sent_steps = self.sent + sent, self.sent_steps + steps
        if inter is not None:
            self.inter_node, self.inter_node_steps = self.inter_node + inter, self.inter_node_steps + steps

    @property
    def sent_per_step(self) -> float | None:
        """Mean bytes sent per step; None where no step event reported them."""
        return self.sent / self.sent_steps if self.sent_steps else None

    @property
    def inter_node_per_step(self) -> float | None:
        """Mean bytes sent to other nodes per step; None where no step event reported them."""
        return self.inter_node / self.inter_node_steps if self.inter_node_steps else None
