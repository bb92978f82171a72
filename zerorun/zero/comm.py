"""The runtime's collectives on one process group, with bytes sent and time waited counted per rank.

Bytes follow the ring algorithms (ZeRO paper §7, Patarasuk & Yuan 2009): for a tensor of ``n`` bytes over
``N`` ranks, reduce-scatter and all-gather each send ``(N - 1) / N * n`` bytes per rank, all-reduce twice that.

Note [Reduce-scatter on gloo]: gloo's ``reduce_scatter_tensor`` copies its input and takes about twice as long
as an all-reduce of the same tensor (measured on 2 ranks, 25 MiB: reduce-scatter 51 ms, all-reduce 24 ms,
all-to-all 17 ms). On gloo the reduce-scatter is therefore an all-to-all (rank ``r`` receives every rank's
chunk ``r``: the same ``(N - 1) / N * n`` bytes sent per rank as the ring) into a receive buffer of the
input's size, summed locally into the output when the work is waited for. The receive buffer takes the
place of gloo's staging copy; up to ``KEEP_BUFFERS`` are kept for reuse (a fresh large block costs page
faults) until :meth:`Comm.release_buffers`. On 2 ranks a rank's own chunk is not sent to itself: each sends
the other's chunk and receives into a buffer of half the input's size (the LM head's 32 MiB gradient bucket
of a 55M GPT held 32 MiB of receive buffer, now 16), and the sum is its own chunk plus the one received (the
same bits as the sum of both rows: one addition). NCCL's reduce-scatter is used as it is.

Note [Agreements on the host]: the ranks agree on a few host values every step: which buckets got gradients
after their launch and which parameters were used (Note [Per-parameter readiness] in reducer.py), which stage-3
units reach the loss (Note [Backward on some ranks] in stage3_checks.py), a digest of the units gathered (Note
[Same units on every rank]). Each is a list of small numbers that the host holds and needs back on the host.
Made on the group's device (a CUDA tensor under NCCL), each cost a copy in and a read back: a host sync, a GPU
pipeline stall, every step. :meth:`Comm.agree` sums them on the CPU over a gloo group instead: the main group
itself where it is gloo (or has a gloo backend for CPU tensors), else a gloo group of the same ranks made
beside it once per group (``new_group(..., backend="gloo")``, as DeepSpeed and torch.distributed.checkpoint do
for their CPU coordination), which the rank's SIGTERM agreement (rank/stopsignal.py) shares. The host waits
for its peers' hosts at that point, never for a GPU stream; the gloo group runs no GPU kernel, so NCCL's rule
(every rank issues the collectives of communicators that can run concurrently in the same order) is not
touched, and every agreement sits at the same point of the program on every rank. Cost: a small TCP round
per agreement; gloo must reach every host (``GLOO_SOCKET_IFNAME`` where hosts have several interfaces).

Note [Last reference on the issuing thread] (zero/held.py): every handle a Comm issues, but those of the
gradients' reduce-scatters, is held until a few later ones are issued, and kept through the interpreter's exit.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from zerorun.zero import gloo_reduce_scatter
from zerorun.zero.streams import DeviceStreams, WaitTimer
from zerorun.zero.held import HeldWorks
from zerorun.zero.placement import Topology
from zerorun.zero.topology import topology
from zerorun.zero.torch_internals import coalesced, group_timeout


# torch >= 2.13 names them *_single and deprecates the *_tensor spellings.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device of ``group``'s collectives: the current CUDA device where its backend is NCCL (a group whose
    only backend is NCCL has none for CPU tensors), else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: The gloo group made beside each device group, by that group (one per group for the life of the process:
#: engines built one after another in a sweep share it instead of each leaving a group of TCP connections).
_CONTROL_GROUPS: dict = {}

def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group :meth:`Comm.agree` sums host values on (Note [Agreements on the host]): ``group`` where its
    backend takes CPU tensors (gloo, MPI, or a backend string naming gloo beside a device backend), else a gloo
    group of the same ranks, made once per group (by those ranks only: ``use_local_synchronization``) and
    shared by every engine over it, whose collectives wait as long as ``group``'s (``launch.collective_timeout_s``;
    before, torch's 30-minute default for a new gloo group)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "mpi":
        return group
    key = group if group is not None else dist.group.WORLD  # a new default group after a re-init: a new key
    if key not in _CONTROL_GROUPS:
        ranks = dist.get_process_group_ranks(key)
        _CONTROL_GROUPS[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True,
                                              timeout=group_timeout(key))  # as long as the group it serves
    return _CONTROL_GROUPS[key]


class _Done:
    """A finished work handle, for world size 1 where no collective is issued."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def alike(n: int, total: float, squares: float) -> bool:
    """Whether a value whose sum over ``n`` ranks is ``total`` and whose squares sum to ``squares`` is the same
    on every rank (their variance is zero)."""
    return n * squares == total ** 2


# Note [Gradient buffer pool]: at stages 2-3 a bucket's full gradient exists only from its first parameter's
# gradient until its reduce-scatter is done. It comes from the reducer's pool (this class) that keeps at most
# ``MAX_INFLIGHT + 1`` buffers, allocated in the first backward of a step and reused by every bucket and
# micro-step (why: ``BufferPool``), dropped when the optimizer step begins. The reduce-scatter runs in place and
# this rank's slice is added, divided by N, to the slice it keeps (fp16 divides first, for its range, as DDP).
class BufferPool:
    """1-D scratch tensors kept for reuse, because a fresh large block costs a page fault per page on every
    use on CPU (blocks of 1 MiB or more are mmapped and returned at free: Note [Returning freed memory] in
    zero/allocator.py). Tensors below ``SMALL_BYTES`` come from the heap and are neither kept nor counted. At
    most ``keep`` free tensors are kept; :meth:`clear` drops them.

    Attributes:
        taken: tensors of ``SMALL_BYTES`` or more handed out and not given back.
        max_taken: the most ``taken`` has been.
        allocated: tensors of ``SMALL_BYTES`` or more allocated (not served from the kept ones), in all.
    """

    SMALL_BYTES = 1 << 20

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.taken = self.max_taken = self.allocated = 0
        self._free: list[torch.Tensor] = []

    def _small(self, numel: int, dtype: torch.dtype) -> bool:
        return numel * dtype.itemsize < self.SMALL_BYTES

    def _fitting(self, numel: int, dtype: torch.dtype, device: torch.device) -> list[int]:
        return [i for i, t in enumerate(self._free) if t.numel() >= numel and t.dtype == dtype and t.device == device]

    def fits(self, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether :meth:`take` would hand out a kept tensor (or a small one) rather than allocate."""
        return self._small(numel, dtype) or bool(self._fitting(numel, dtype, device))

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (uninitialized): a view of the smallest kept tensor that fits,
        else a new one."""
        if self._small(numel, dtype):
            return torch.empty(numel, dtype=dtype, device=device)
        self.taken += 1
        self.max_taken = max(self.max_taken, self.taken)
        fits = self._fitting(numel, dtype, device)
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))[:numel]
        self.allocated += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, t: torch.Tensor) -> None:
        """Return a tensor from :meth:`take`; kept if fewer than ``keep`` are free (else the smallest free
        one, in bytes, is dropped)."""
        if self._small(t.numel(), t.dtype):
            return
        self.taken -= 1
        self._free.append(t if t._base is None else t._base)
        if len(self._free) > self.keep:
            self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].nbytes))

    @property
    def free(self) -> int:
        """Kept tensors ready for :meth:`take`."""
        return len(self._free)

    def clear(self) -> None:
        """Drop the kept tensors (their memory is returned once nothing else uses them)."""
        self._free.clear()


class _Unpacked:
    """A packed all-gather (:meth:`Comm.all_gather_coalesced`): ``wait`` waits for it, then copies rank ``r``'s
    bytes ``[at, at + sizes[i])`` of the result into row ``r`` of ``outputs[i]`` (viewed as ``N`` rows of
    ``sizes[i]`` bytes) and frees both messages' memory (after the wait: Note [Streams])."""

    def __init__(self, work, send: torch.Tensor, staged: torch.Tensor, outputs: list[torch.Tensor],
                 sizes: list[int], comm: "Comm") -> None:
        self.work, self.send, self.staged = work, send, staged
        self.outputs, self.sizes, self.comm = outputs, sizes, comm

    def is_completed(self) -> bool:
        return self.staged is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.staged is not None:
            self.work.wait()
            rows, at = self.staged.view(self.comm.world_size, -1), 0
            for output, n in zip(self.outputs, self.sizes):
                output.view(torch.uint8).view(rows.shape[0], n).copy_(rows[:, at:at + n])
                at += n
            for t in (self.send, self.staged):  # their memory goes now; the held handle keeps empty tensors
                t.untyped_storage().resize_(0)
            self.send = self.staged = None
        return True


class Comm:
    """Asynchronous collectives on ``group`` that count ``bytes_sent`` (bytes) and ``wait_s`` (seconds).

    Every method returns a work handle; pass handles to :meth:`wait` so the wait is timed. :attr:`device` is
    the group's device (:func:`group_device`): control tensors are made there.
    """

    #: Receive buffers of reduce-scatters on gloo kept for reuse (Note [Reduce-scatter on gloo]).
    KEEP_BUFFERS = 3
    #: handles kept after they are issued (Note [Last reference on the issuing thread] in held.py)
    HELD = 4

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = group_device(group)
        self.control = control_group(group) if self.world_size > 1 else group  # Note [Agreements on the host]
        self.streams = DeviceStreams(self.device)  # Note [Streams] in streams.py
        self._timer = WaitTimer(self.device)
        self.bytes_sent = 0
        self.bytes_sent_inter_node = 0  # of bytes_sent, to ranks on other nodes (Note [Nodes of a group])
        self.topology = topology(group, self.control) if self.world_size > 1 else Topology((0,), 0)
        # Note [Reduce-scatter on gloo]
        self.reduce_scatter_via_all_to_all = dist.get_backend(group) == "gloo"
        # Note [One all-gather per unit] in units.py: torch's coalesced all-gather under NCCL only
        self.native_coalescing = "nccl" in str(dist.get_backend(group))
        self.recv_pool = BufferPool(keep=self.KEEP_BUFFERS)
        self.held = HeldWorks(self.HELD)
        # the gradients' reduce-scatter where it is not this Comm's flat exact one: in two levels (zero.hierarchy)
        # and/or quantized (zero.quantize_grads): hierarchy.gradient_path
        self.grad_path = None

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting in :meth:`wait` (on a GPU: the current stream's wait, read from events)."""
        return self._timer.seconds

    def _count(self, nbytes: float) -> None:
        """Count ``nbytes`` sent by this rank (ring accounting), ``R / (N - 1)`` of them to the ``R`` ranks on
        other nodes (direct accounting, Note [Nodes of a group] in topology.py: the same ratio for every kind)."""
        self.bytes_sent += int(round(nbytes))
        self.bytes_sent_inter_node += int(round(nbytes * self.topology.remote / (self.world_size - 1)))

    def all_reduce(self, tensor: torch.Tensor, control: bool = False):
        """Sum ``tensor`` (any shape) over all ranks, in place. ``control``: a few bytes of agreement between
        ranks, not step traffic (not counted in ``bytes_sent``, as broadcasts)."""
        if self.world_size == 1 or tensor.numel() == 0:
            return _Done()
        if not control:
            self._count(2 * (self.world_size - 1) / self.world_size * tensor.nbytes)
        with self.streams.issue(self.streams.reduce_scatter):
            return self.held.hold(dist.all_reduce(tensor, group=self.group, async_op=True))

    def all_reduce_now(self, tensor: torch.Tensor) -> None:
        """:meth:`all_reduce` of a few control values (not counted), waited for: a synchronous all-reduce whose
        handle is still held (Note [Last reference on the issuing thread] in held.py), for the collectives a
        script may end on (a checkpoint's flags)."""
        self.wait([self.all_reduce(tensor, control=True)])

    def agree(self, values: Sequence[int | float], dtype: torch.dtype = torch.int64) -> list:
        """The sums over ranks of ``values`` (host numbers, as ``dtype``), summed on the host over the control
        group (Note [Agreements on the host]): no GPU stream is waited for. Not step traffic (not counted)."""
        if self.world_size == 1 or not values:
            return list(values)
        sums = torch.tensor(values, dtype=dtype, device="cpu")  # the control group's device
        self.held.hold(dist.all_reduce(sums, group=self.control, async_op=True)).wait()
        return sums.tolist()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor):
        """Sum ``input`` (1-D, ``N * k`` elements) over ranks; rank r receives elements ``[r*k, (r+1)*k)`` in
        ``output`` (1-D, ``k`` elements). ``output`` may be that slice of ``input`` (in place)."""
        if self.world_size == 1 or input.numel() == 0:  # nothing to send: a flat buffer of zero elements
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _Done()
        if self.grad_path is not None:  # Notes [Two-level reduce-scatter], [Quantized gradients] (they count)
            return self.grad_path.reduce_scatter(output, input)
        return self.reduce_scatter_exact(output, input)

    def reduce_scatter_exact(self, output: torch.Tensor, input: torch.Tensor):
        """:meth:`reduce_scatter` over this Comm's ranks in one level, in ``input``'s dtype, whatever
        :attr:`grad_path` says (float64 gradients under quantized ones: Note [Quantized gradients]). ``N >= 2``
        and ``k >= 1``."""
        return self.reduce_scatter_coalesced([output], [input])

    def reduce_scatter_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]):
        """:meth:`reduce_scatter_exact` of each pair ``(outputs[i], inputs[i])`` (one dtype) as one collective with one
        handle (Note [One reduce-scatter per launch] in gloo_reduce_scatter.py)."""
        self._count((self.world_size - 1) * sum(o.nbytes for o in outputs))
        with self.streams.issue(self.streams.reduce_scatter):
            if self.reduce_scatter_via_all_to_all:
                return gloo_reduce_scatter.issue(self, outputs, inputs)
            if len(outputs) == 1:
                return _reduce_scatter(outputs[0], inputs[0], group=self.group, async_op=True)

            def issue() -> None:
                for o, i in zip(outputs, inputs):
                    _reduce_scatter(o, i, group=self.group)

            return coalesced(self.group, issue)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, splits: list[int]):
        """Send part ``j`` of ``input`` (1-D, ``splits[j]`` elements, in order) to rank ``j``, and receive rank
        ``j``'s part for this rank into part ``j`` of ``output`` (the same ``splits``: every rank sends as many
        elements to each rank as it receives from it). Counted as the bytes sent to other ranks; not held (a
        gradient reduction's, Note [Quantized gradients] in quantized_grads.py: never a step's last)."""
        self._count(sum(n for j, n in enumerate(splits) if j != self.rank) * input.element_size())
        with self.streams.issue(self.streams.reduce_scatter):
            return dist.all_to_all_single(output, input, output_split_sizes=splits, input_split_sizes=splits,
                                          group=self.group, async_op=True)

    def release_buffers(self) -> None:
        """Drop the kept receive buffers; their memory is returned once no collective uses them. The held
        handles stay (Note [Last reference on the issuing thread] in held.py): a few later collectives drop them."""
        self.recv_pool.clear()
        if self.grad_path is not None:
            self.grad_path.release_buffers()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor):
        """Concatenate every rank's ``input`` (1-D, ``k`` elements) into ``output`` (1-D, ``N * k``) in rank
        order. ``input`` may be rank r's slice of ``output`` (in place)."""
        if self.world_size == 1 or output.numel() == 0:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _Done()
        self._count((self.world_size - 1) * input.nbytes)
        with self.streams.issue(self.streams.all_gather):
            return self.held.hold(_all_gather(output, input, group=self.group, async_op=True))

    def all_gather_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                             message_bytes: int = 0):
        """:meth:`all_gather` of each pair ``(outputs[i], inputs[i])`` (1-D, any dtypes; pairs of zero elements
        skipped) as one collective with one handle (Note [One all-gather per unit] in units.py). Under NCCL each
        pair is gathered in place, as one group launch; elsewhere (gloo), and wherever ``message_bytes`` is
        given, as one all-gather of a message of this rank's inputs' bytes end to end, zeros after them up to
        ``message_bytes`` (0: no padding; else at least their sum: Note [Peer units] in unit_plan.py), copied
        out into the outputs when the handle is waited for.

        Raises:
            ValueError: ``message_bytes`` is below this rank's inputs' bytes.
        """
        if 0 < message_bytes < sum(i.nbytes for i in inputs):
            raise ValueError(f"all_gather_coalesced: message_bytes={message_bytes} is below the inputs' "
                             f"{sum(i.nbytes for i in inputs)} bytes")
        device = inputs[0].device if len(inputs) else self.device  # before the empty pairs are dropped
        pairs = [(o, i) for o, i in zip(outputs, inputs) if o.numel()]
        if self.world_size == 1 or (len(pairs) < 2 and not message_bytes):
            works = [self.all_gather(o, i) for o, i in pairs] or [_Done()]
            return works[0]
        if len({o.dtype for o, _ in pairs}) > 1:  # Note [One all-gather per unit]: mixed dtypes travel as bytes
            pairs = [(o.view(torch.uint8), i.view(torch.uint8)) for o, i in pairs]
        if self.native_coalescing and not message_bytes:
            self._count((self.world_size - 1) * sum(i.nbytes for _, i in pairs))

            def issue() -> None:
                for o, i in pairs:
                    _all_gather(o, i, group=self.group)

            with self.streams.issue(self.streams.all_gather):
                return self.held.hold(coalesced(self.group, issue))
        return self._all_gather_packed([o for o, _ in pairs], [i for _, i in pairs], message_bytes, device)

    def _all_gather_packed(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], message_bytes: int,
                           device: torch.device):
        """One all-gather of ``uint8`` messages on ``device`` (Note [One all-gather per unit]): made and filled
        on the current stream, issued on the all-gather stream; :class:`_Unpacked` copies them out at the wait."""
        sizes = [i.nbytes for i in inputs]
        length = max(message_bytes, sum(sizes))
        send = torch.empty(length, dtype=torch.uint8, device=device)
        if inputs:  # a peer unit's member may hold nothing on this rank: zeros only
            torch.cat([i.view(torch.uint8) for i in inputs], out=send[:sum(sizes)])
        send[sum(sizes):].zero_()
        staged = torch.empty(self.world_size * length, dtype=torch.uint8, device=device)
        self._count((self.world_size - 1) * length)
        with self.streams.issue(self.streams.all_gather):
            work = self.held.hold(_all_gather(staged, send, group=self.group, async_op=True))
        return _Unpacked(work, send, staged, outputs, sizes, self)

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Copy rank ``src``'s ``tensor`` to every rank, in place (not counted as step traffic)."""
        if self.world_size == 1:
            return _Done()
        return self.held.hold(dist.broadcast(tensor, src=self.global_rank(src), group=self.group, async_op=True))

    def global_rank(self, rank: int) -> int:
        """The rank in the default group of this group's ``rank`` (what a user's logs and messages call it)."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def wait(self, works: Sequence) -> None:
        """Wait for every handle in ``works`` (on a GPU the current stream waits, not the host: Note [Streams]);
        the time spent is added to :attr:`wait_s`."""
        with self._timer.timing():
            for work in works:
                work.wait()
