"""The node group protocol: what every launch backend's nodes (local: launch/runner.py ``LocalNode``, SSH:
launch/remote.py ``RemoteNode``, SLURM: launch/slurm_step.py ``SlurmNode``) give the supervisor, and the typed
messages they put on the job's queue.

Note [Node messages]: a node streams what it prints, one :class:`Line` per line (stdout and stderr merged),
and its end as one :class:`Ended` with its exit status and, when that status does not say why (its watcher
killed, the SSH connection lost, SLURM killed its task), the ``reason``; nothing else goes on the queue.
torch's ``PContext`` (torch/distributed/elastic/multiprocessing/api.py) is the model: one interface whatever
starts the processes, the supervisor never asks which kind a node is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from zerorun.launch.plan import NodeSpec


@dataclass(frozen=True)
class Line:
    """A line ``text`` (no newline) that node ``node_rank`` printed."""

    node_rank: int
    text: str


#: How a node's end reason begins where the scheduler stopped the job (SLURM's time limit or scancel,
#: launch/slurm_step.py): a stop from outside, as a SIGTERM to the launcher is, not a lost node.
SCHEDULER_STOP = "SLURM ended the job step"


@dataclass(frozen=True)
class Ended:
    """Node ``node_rank`` ended with exit ``status`` (128 + N for a signal N, as a shell reports it; 255 a lost
    SSH connection); ``reason``, one line, when the status alone does not say why (Note [Node messages])."""

    node_rank: int
    status: int
    reason: str | None = None


Message = Line | Ended


class Node(Protocol):
    """One node of a job, not started until :meth:`start`; its messages go to the queue it was made with."""

    spec: NodeSpec
    #: why teardown could not check that the node's processes are gone (an unreachable host), else None
    unverified: str | None

    def start(self) -> None:
        """Start the node's watcher (launch/node.py). Raises ZerorunError when it cannot be started."""

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the node's processes while it runs."""

    def kill_survivors(self, sig: int) -> int:
        """Send ``sig`` to every process of the job left on the node's host; return how many there were."""

    def close(self) -> None:
        """Release what the node holds (an SSH connection)."""
