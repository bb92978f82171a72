"""Step events on a rank, with the job-wide loss all-reduced in the background.

Note [Deferred loss]: a step event carries the loss averaged over all ranks, which takes one all-reduce. A
blocking all-reduce of one number costs little on a quiet machine but several milliseconds on a busy one
(every rank must be scheduled to pass it along the ring), a few percent of a step when logging every step.
So the all-reduce is started asynchronously when the step is logged and waited for after the *next* step,
by which time it is done: the event goes out one step late (its ``time`` is still when its step ended), the
training does not wait for it. Every rank
issues it at the same point of the same step, so collectives stay in the same order on every rank. A loss
that is not finite still stops the job, one step later, naming the step it came from. A rank that fails
writes the queued event if its all-reduce has completed (:meth:`StepLog.flush_if_done`), so the last step
done before the failure is in the record.

Note [Values read at log steps]: on a GPU, reading a tensor's value on the host (``.item()``, ``float()``)
waits for every kernel queued before it: a loss read per micro-step stalls the pipeline every micro-step
(DDP and FSDP2 make no such read). So the worker adds each micro-step's loss on the device
(:meth:`StepLog.add_loss`), and at a log step hands the interval's mean (a 0-dim tensor) and the step's
tensor fields (the grad norm ``engine.step()`` returns) to :meth:`StepLog.log`, which stacks them into one
fp64 vector and all-reduces it; :meth:`StepLog.flush` reads that vector once, on CUDA from pinned host
memory it was copied into right behind the all-reduce (an event waited for, not the steps queued since).
One read per step event, none in the steps between. The loss of a step event is therefore the mean over
the micro-steps of the steps since the previous step event (``interval_steps`` of them), as torchtitan and
the Hugging Face Trainer report it; the grad norm is the logged step's. Step times likewise: without a
read per step, a step's own time on the host is only the time to queue its kernels, so the worker
synchronizes the device once at each log step and reports ``step_time_s`` (and the rates derived from it)
as the mean over the interval, whose total ``interval_s`` is then the device's.
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
        # (wait for the values, whether they came, the values, step, fields, the fields that are tensors),
        # Note [Deferred loss]
        self._pending: tuple[Any, Any, Any, int, dict[str, Any], list[str]] | None = None
        self._loss_sum: Any = None  # 0-dim fp64 on ``device``: the losses added since the last step event
        self._losses = 0
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

    def add_loss(self, loss: Any) -> None:
        """Add one micro-step's loss (a scalar tensor on ``device``, any float dtype) to the interval's sum,
        on the device: no host read (Note [Values read at log steps])."""
        import torch

        if self._loss_sum is None:
            self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._loss_sum += loss.detach().reshape(())
        self._losses += 1

    def log(self, step: int, local_loss: Any, fields: dict[str, Any]) -> None:
        """Queue the step event of ``step``: ``local_loss`` is this rank's mean loss (a float, a 0-dim tensor on
        ``device``, or ``None`` for the mean of the losses given to :meth:`add_loss` since the last event);
        it is averaged over all ranks in the background. ``fields`` are the event's other fields, to which this
        adds the CPU use since the previous event and the GPU's utilization (``probes.CpuUse``,
        ``probes.GpuUtilization``); a 0-dim tensor among them (the grad norm, equal on every rank) is
        averaged over the ranks with the loss and read with it (Note [Values read at log steps]). Sends any earlier event first.

        Raises:
            ValueError: ``local_loss`` is ``None`` and no loss was added since the last event.
        """
        import torch
        import torch.distributed as dist

        self.flush()
        with self.measuring():
            if local_loss is None:
                if not self._losses:
                    raise ValueError(f"step {step}: no loss added since the last step event")
                local_loss = self._loss_sum / self._losses
                self._loss_sum, self._losses = None, 0
            tensors = [k for k, v in fields.items() if isinstance(v, torch.Tensor)]
            values = [self._scalar(local_loss)] + [self._scalar(fields[k]) for k in tensors]
            mean = torch.stack(values)
            work = dist.all_reduce(mean, async_op=True)
            wait, done, mean = _pinned_copy(work, mean) if mean.is_cuda else (work.wait, work.is_completed, mean)
            fields = {**fields, **self._cpu(), **self._gpu()}  # CPU use since the last event, GPU utilization
        fields = {**fields, "telemetry_s": self.telemetry_s, "time": round(time.time(), 3)}
        self._pending = (wait, done, mean, step, fields, tensors)
        self.telemetry_s = 0.0

    def _scalar(self, value: Any) -> Any:
        """``value`` (a float or a one-element tensor) as a 0-dim fp64 tensor on ``device``, without a host
        read (a float is filled in on the device rather than copied from the host)."""
        import torch

        if isinstance(value, torch.Tensor):
            return value.detach().reshape(()).to(device=self.device, dtype=torch.float64)
        return torch.full((), float(value), dtype=torch.float64, device=self.device)

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

        wait, _, mean, step, fields, tensors = self._pending
        self._pending = None
        with self.measuring():
            wait()
            values = [v / self.world_size for v in mean.tolist()]  # the one read (Note [Values read at log steps])
            loss = values[0]
            fields = {**fields, **dict(zip(tensors, values[1:]))}
            if not math.isfinite(loss):
                if step == 1:  # before any update: no learning rate made it (a review)
                    raise FloatingPointError(f"the loss is {loss} at step 1, before any update: the model's forward "
                                             "or the data give it (a log of 0, a division by 0, NaN in a sample)")
                hint = "lower train.optimizer.lr" + ("" if self.clipped else " or set train.grad_clip")
                raise FloatingPointError(f"the loss is {loss} at step {step} (diverged): {hint}")
            emit("step", self.rank, stream=self.stream, step=step, loss=loss, **fields)

    def flush_if_done(self, wait_s: float = 1.0) -> None:
        """At a rank's failure: write the queued event once its all-reduce has completed, waiting at most
        ``wait_s`` seconds for it (its peers issued it at the same step, a moment apart; one may be gone). The
        last step done before the failure was missing from the record and the summary (Note [Deferred loss];
        two reviews). A loss that is not finite is left out: the failure's own error stays."""
        deadline = time.monotonic() + wait_s
        while self._pending is not None and not self._pending[1]() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._pending is None or not self._pending[1]():
            return
        try:
            self.flush()
        except FloatingPointError:
            pass


def _pinned_copy(work: Any, mean: Any) -> tuple[Any, Any, Any]:
    """``mean`` (a CUDA tensor being all-reduced by ``work``) copied to pinned host memory behind the
    all-reduce: returns (a wait for that copy's event, whether it has completed, the host tensor). The flush
    then waits for that copy only, not for the kernels queued after it (``work.wait()`` on NCCL is a stream
    wait, not the host's)."""
    import torch

    work.wait()
    host = torch.empty(mean.shape, dtype=mean.dtype, pin_memory=True)
    host.copy_(mean, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return copied.synchronize, copied.query, host
