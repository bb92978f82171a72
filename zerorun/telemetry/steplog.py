"""Step events on a rank, with the job-wide loss all-reduced in the background.

Note [Deferred loss]: a step event carries the loss averaged over all ranks, which takes one all-reduce. A
blocking all-reduce of one number costs little on a quiet machine but several milliseconds on a busy one
(every rank must be scheduled to pass it along the ring), a few percent of a step when logging every step.
So the all-reduce is started asynchronously when the step is logged and waited for after the *next* step,
by which time it is done: the event goes out one step late (its ``time`` is still when its step ended), the
training does not wait for it. Every rank
issues it at the same point of the same step, so collectives stay in the same order on every rank. A loss
that is not finite still stops the job, one step later, naming the step it came from.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Iterator, TextIO

PROGRESS_EVERY_S = 0.1  # at most ten progress events a second: the dashboard redraws once a second


class StepLog:
    """Queues one rank's step events (Note [Deferred loss]) and counts the seconds spent on telemetry.

    Args:
        rank: this rank's global rank.
        world_size: ranks in the job.
        device: where the loss all-reduce runs (a ``torch.device``: CPU for gloo, CUDA for NCCL).
        stream: where events are written (default: the real stdout, see ``events.emit``).
        clipped: whether the job clips gradients (``train.grad_clip``): the divergence message suggests it
            only when it does not.
    """

    def __init__(self, rank: int, world_size: int, device: Any, stream: TextIO | None = None,
                 clipped: bool = False) -> None:
        self.rank, self.world_size, self.device, self.stream = rank, world_size, device, stream
        self.clipped = clipped
        self.telemetry_s = 0.0  # seconds spent measuring and sending since the last queued event
        self._pending: tuple[Any, Any, int, dict[str, Any]] | None = None
        self._last_progress = float("-inf")  # time.monotonic() of the last progress event
        from zerorun.telemetry.probes import CpuUse, GpuUtilization

        self._cpu, self._gpu = CpuUse(), GpuUtilization(device)

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Count the time of the block as telemetry (reported as ``telemetry_s`` in the next event)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.telemetry_s += time.perf_counter() - t0

    def log(self, step: int, local_loss: float, fields: dict[str, Any]) -> None:
        """Queue the step event of ``step``: ``local_loss`` (this rank's mean loss, a float) is averaged over
        all ranks in the background; ``fields`` are the event's other fields, to which this adds the CPU use
        since the previous event and the GPU's utilization (``probes.CpuUse``, ``probes.GpuUtilization``).
        Sends any earlier one first."""
        import torch
        import torch.distributed as dist

        self.flush()
        with self.measuring():
            mean = torch.tensor([local_loss], dtype=torch.float64, device=self.device)
            work = dist.all_reduce(mean, async_op=True)
            fields = {**fields, **self._cpu(), **self._gpu()}  # CPU use since the last event, GPU utilization
        fields = {**fields, "telemetry_s": self.telemetry_s, "time": round(time.time(), 3)}
        self._pending = (work, mean, step, fields)
        self.telemetry_s = 0.0

    def progress(self, step: int, steps: int) -> None:
        """On rank 0, send a ``progress`` event (telemetry/events.py) for ``step`` of ``steps`` when
        :data:`PROGRESS_EVERY_S` have passed since the last one, and for the last step; other ranks send
        nothing. Costs a clock read per step (0.15 us), and 13 us when it writes to a pipe (counted as telemetry)."""
        if self.rank != 0:
            return
        now = time.monotonic()
        if now - self._last_progress < PROGRESS_EVERY_S and step != steps:
            return
        from zerorun.telemetry.events import emit

        with self.measuring():
            self._last_progress = now
            emit("progress", self.rank, stream=self.stream, step=step, steps=steps)

    def flush(self) -> None:
        """Wait for the queued event's loss and write the event.

        Raises:
            FloatingPointError: the job-wide loss is not finite (the training diverged).
        """
        if self._pending is None:
            return
        from zerorun.telemetry.events import emit

        work, mean, step, fields = self._pending
        self._pending = None
        with self.measuring():
            work.wait()
            loss = float(mean) / self.world_size
            if not math.isfinite(loss):
                hint = "lower train.optimizer.lr" + ("" if self.clipped else " or set train.grad_clip")
                raise FloatingPointError(f"the loss is {loss} at step {step} (diverged): {hint}")
            emit("step", self.rank, stream=self.stream, step=step, loss=loss, **fields)
