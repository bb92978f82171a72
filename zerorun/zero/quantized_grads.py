"""ZeRO++'s quantized gradients (qgZ): the gradients' reduce-scatter as an all-to-all of int8 or int4 blocks.

Note [Quantized gradients]: with ``zero.quantize_grads: int8`` (or ``int4``) the reduce-scatter of a gradient
bucket of ``N * k`` elements (stages 1-3) becomes an all-to-all: the bucket is cut in ``N`` chunks of ``k``,
each quantized in blocks of ``zero.quantize_block`` elements (at most ``k``) with an fp32 scale per block
(Note [Quantized weights] in quantize.py: symmetric, ``s = max|x| / 127``, or ``/ 7`` at 4 bits, two values to
a byte); rank ``r`` receives every other rank's chunk ``r``, dequantizes each and adds them to its own chunk in
fp32, as ZeRO++ §3.3 describes (Wang et al., arXiv:2306.10209: quantize, all-to-all, dequantize, reduce). A
rank's own chunk never travels and is never rounded. Per element a rank sends ``1 + 4 / block`` bytes at int8,
``1 / 2 + 4 / block`` at int4, where the exact reduce-scatter sends the gradients' bytes (4 in fp32): at
block 256, 3.9x and 7.8x fewer (at bf16, 2.0x and 3.9x; a block below 4 would send more than bf16). Float64
buckets (Note [Wide parameters] in precision.py: kept for a range and precision that int8 blocks with fp32 scales would
lose; a float64 value beyond fp32's range would come back NaN) are reduce-scattered exactly, in float64. Memory:
the quantization works on an fp32 copy of the bucket (transient), and each pending reduction holds its two
messages (``(N - 1) / N`` of the bucket's elements at ``1 + 4 / block`` bytes each, int8).

Hierarchically (§3.3's two hops): where the ranks run on several nodes of the same number of consecutive ranks,
or ``zero.hierarchy`` names a group, the reduce-scatter runs in the two levels of Note [Two-level reduce-scatter]
in hierarchy.py, each of them so: within the node first, then across nodes among the ranks of the same place,
whose all-to-all carries ``1 / G`` of the gradients, quantized again from the node's sums. Between nodes a
bucket then costs ``(M - 1) / M / G`` of its elements in quantized bytes, where the flat exact reduce-scatter
sends ``(N - G) / N`` in full bytes: with 2 nodes of 2 ranks in fp32 at int8, 2x fewer from the levels and
3.9x from the bytes, 7.9x in all.

Rounding: each received element is within ``s / 2`` of the value sent, ``s`` the scale of its block, so a sum
over ``N`` ranks is within the sum of ``N - 1`` half steps of the exact one (two levels: the inner sums are
rounded again before they cross). Lossy by choice: not DDP's numbers. tests/test_quantized_grads.py bounds the
error of one reduce-scatter exactly and the per-step difference of training against DDP. Everything else about
the reduction is unchanged: the readiness of buckets, their order, fp16's division before the sum, the late
gradients' second reduction (Note [Per-parameter readiness] in reducer.py), and the norm is the reduced
gradients'. On a GPU the quantization runs on the compute stream, the all-to-all on the reduce-scatter stream,
the dequantization where the handle is waited for: no host sync (Note [Streams] in streams.py).
"""

from __future__ import annotations

import torch

from zerorun.zero.precision import is_wide
from zerorun.zero.quantize import dequantize_rows, message_bytes, quantize_rows


class QuantizedReduceScatter:
    """The gradients' reduce-scatter over ``comm``'s ``N`` ranks as an all-to-all of blocks of ``bits`` (8 or 4)
    with ``block`` elements per scale (Note [Quantized gradients])."""

    def __init__(self, comm, bits: int, block: int) -> None:
        self.comm, self.bits, self.block = comm, bits, block
        self.comms: list = []  # the Comms beside the engine's that count bytes: none (it is ``comm``'s own)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor):
        """As :meth:`Comm.reduce_scatter`: ``input`` 1-D floating of ``N * k`` elements summed over the ranks
        (within the rounding), elements ``[r*k, (r+1)*k)`` into ``output`` (``k`` elements, may be that slice of
        ``input``) on rank ``r``; a handle whose ``wait`` sums. ``N >= 2`` and ``k >= 1``: Comm.reduce_scatter
        does the rest itself. A float64 input is reduced exactly (Note [Quantized gradients])."""
        if is_wide(input.dtype):
            return self.comm.reduce_scatter_exact(output, input)
        n, rank, k = self.comm.world_size, self.comm.rank, output.numel()
        chunks = input.view(n, k)
        m = message_bytes([(k, torch.float32)], self.block, self.bits)
        messages = quantize_rows(chunks, self.block, self.bits)  # [N, m]; the own row is not sent
        send = torch.cat([messages[:rank], messages[rank + 1:]]).view(-1)
        recv = torch.empty((n - 1) * m, dtype=torch.uint8, device=input.device)
        splits = [0 if j == rank else m for j in range(n)]
        work = self.comm.all_to_all(recv, send, splits)
        return _Summed(work, send, recv, chunks[rank], output, self)

    def release_buffers(self) -> None:
        """Nothing kept: each message lives from its issue to its wait."""


class _Summed:
    """A quantized reduce-scatter's handle: ``wait`` waits, then writes this rank's chunk plus the other ranks'
    dequantized ones (summed in fp32) into the output and frees the messages."""

    def __init__(self, work, send: torch.Tensor, recv: torch.Tensor, own: torch.Tensor, output: torch.Tensor,
                 path: QuantizedReduceScatter) -> None:
        self.work, self.send, self.recv, self.own, self.output, self.path = work, send, recv, own, output, path

    def wait(self) -> bool:
        if self.recv is not None:
            self.work.wait()
            k, path = self.own.numel(), self.path
            others = dequantize_rows(self.recv.view(path.comm.world_size - 1, -1), k, path.block, path.bits)
            total = others.sum(dim=0).add_(self.own)  # fp32; own read before the output is written (may alias)
            self.output.copy_(total)
            for t in (self.send, self.recv):  # after the wait (Note [Streams])
                t.untyped_storage().resize_(0)
            self.send = self.recv = self.own = None
        return True
