"""A rank's SIGTERM, turned into a checkpoint at a step boundary.

Note [Checkpoint on SIGTERM]: SLURM ends a job at its time limit (and on scancel or preemption) with SIGTERM to
every process of its steps, then SIGKILL ``KillWait`` seconds later (30 s by default); the launcher's own
teardown sends SIGTERM before SIGKILL too (launch/supervisor.py). With ``checkpoint.dir`` set, each rank's
SIGTERM handler only records the signal; after every optimizer step the ranks agree on it (one int32
all-reduce, MAX, so that a rank signalled a moment later stops at the same step as the others; the value also
names the lowest rank that got it, so a SIGTERM sent to one rank is named with its rank), then every
rank saves the checkpoint of that step (torch.distributed.checkpoint, written to a temporary folder and renamed
when complete: never half-written, zerorun/checkpoint/saving.py), reports a ``stopped`` event and exits with 143
(128 + SIGTERM). ``zerorun train --resume`` then continues from that step, with the same numbers as an
uninterrupted run. Without ``checkpoint.dir`` SIGTERM keeps its default action (the rank ends at once).
"""

from __future__ import annotations

import signal

#: the exit code of a rank that stopped on SIGTERM after saving (128 + SIGTERM, as a shell reports it)
STOPPED_EXIT = 128 + signal.SIGTERM


class Stopped(Exception):
    """Raised on every rank after the checkpoint of a SIGTERM was saved; the worker exits with
    :data:`STOPPED_EXIT`."""


class StopRequest:
    """Records SIGTERM (Note [Checkpoint on SIGTERM]); :meth:`agreed` says, on every rank alike, whether any
    rank got it, and sets :attr:`rank` to the lowest rank that did.

    Args:
        rank: this rank's global rank.
        world_size: ranks in the job.
    """

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.signal: int | None = None
        self.own_rank, self.world_size = rank, world_size
        self.rank: int | None = None  # the one rank that got SIGTERM, once agreed() returned True
        signal.signal(signal.SIGTERM, self._record)

    def _record(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal = signum

    def agreed(self) -> bool:
        """True on every rank when any rank got SIGTERM (one int32 all-reduce with MAX of ``[world_size - rank,
        rank]`` on a signalled rank and ``[0, -1]`` elsewhere: the first names the lowest such rank, the second the
        highest; :attr:`rank` is that rank when it is the only one, else ``None``: a signal every rank got, as when
        torchrun's agent is killed and the kernel sends its ranks SIGTERM, went to no rank in particular). Every
        rank calls it at the same step. A decision of the hosts, taken on the host, over the job's gloo group for
        such agreements (the default group on gloo; beside NCCL, the one the engine's agreements use: Note
        [Agreements on the host] in zerorun/zero/comm.py), so that the check, made every step, never waits for
        the GPU's queued work (a read of a device tensor would)."""
        import torch
        import torch.distributed as dist

        from zerorun.zero.comm import control_group

        mine = [self.world_size - self.own_rank, self.own_rank] if self.signal is not None else [0, -1]
        flag = torch.tensor(mine, dtype=torch.int32, device="cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group(None))
        got, highest = (int(v) for v in flag.tolist())
        if got:
            lowest = self.world_size - got
            self.rank = lowest if lowest == highest else None
        return bool(got)
