"""Side streams and events for the runtime's collectives: CUDA streams and events on a GPU, no-ops on the CPU
through the same calls.

Note [Streams]: as FSDP2 does (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py ``FSDPCommContext
.lazy_init``; _fsdp_collectives.py ``foreach_all_gather`` and ``foreach_reduce``), all-gathers and
reduce-scatters are issued from streams of their own, so NCCL's stream, which waits for the stream current
at the issue, does not wait for compute queued after the collective's inputs were written:

- issue (:meth:`DeviceStreams.issue`): the side stream first waits for the current (compute) stream, so
  the input written there (a gathered unit's slice, a bucket's gradient) and the output's memory
  (allocated there by the caching allocator) are ready; the collective is then issued with the side stream
  current (all-gather: ``all_gather``; reduce-scatter and all-reduce: ``reduce_scatter``; the copy-in of
  FSDP2's ``all_gather_copy_in_stream`` is zerorun's resize of the unit's flat storage, made on the compute
  stream where the memory is allocated).
- use: ``work.wait()`` (``Comm.wait``) makes the current stream wait for the collective, on the device;
  the host does not block.
- free: every buffer is freed or handed back (``resize_(0)`` of a unit's storage, ``BufferPool.give_back``
  of a bucket's gradient) only after that wait, so its memory returns to the compute stream's pool after
  every use queued there; nothing is freed while only a side stream is ordered after its last use, and no
  ``record_stream`` is needed (the lifetime FSDP2 keeps with ``AllGatherState``/``ReduceScatterState``).
- the bound (Note [Waiting in hooks] in ``reducer.py``): waiting for the oldest reduction is the compute
  stream waiting for its event, as FSDP2's ``reduce_scatter_max_input_buffers`` does: no host sync.
- timing (:class:`WaitTimer`): on a GPU ``work.wait()`` returns at once, so the wait is measured on the
  device, between events recorded on the current stream before and after the wait (the time that stream
  stood still for the collective), read only when the total is asked for (at log intervals).

On the CPU (gloo) there are no streams: every call here is a no-op (``issue`` runs the block as it is,
events are ``None``) and the wait is timed with ``time.perf_counter``, as before.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch


class DeviceStreams:
    """The all-gather and reduce-scatter streams of ``device`` (Note [Streams]); ``None`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.all_gather = self.reduce_scatter = None
        if device.type == "cuda":
            self.all_gather = torch.cuda.Stream(device, priority=-1)
            self.reduce_scatter = torch.cuda.Stream(device, priority=-1)

    @contextlib.contextmanager
    def issue(self, stream) -> Iterator[None]:
        """Run the block with ``stream`` current, after it waits for the current stream (no-op: ``None``)."""
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield


class WaitTimer:
    """Seconds the current stream waited for collectives (Note [Streams]): ``perf_counter`` around the wait on
    the CPU, CUDA events on a GPU (summed when :attr:`seconds` is read)."""

    #: event pairs kept before the oldest finished ones are summed (bounds their number between reads)
    KEEP = 256

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds = 0.0
        self._pairs: list = []

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - t0
            return
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pairs.append((start, end))
        if len(self._pairs) > self.KEEP:
            self._fold(lambda e: e.query())

    def _fold(self, done) -> None:
        while self._pairs and done(self._pairs[0][1]):
            start, end = self._pairs.pop(0)
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000.0

    @property
    def seconds(self) -> float:
        """The total so far (on a GPU: waits for the recorded events; read it at log intervals)."""
        self._fold(lambda e: True)
        return self._seconds
