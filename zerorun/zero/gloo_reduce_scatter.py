"""Reduce-scatter on gloo as an all-to-all and a local sum (Note [Reduce-scatter on gloo] in comm.py), for one
bucket or for several as one collective (Note [One reduce-scatter per launch]).

Note [One reduce-scatter per launch]: at stage 3 a unit holds one flat buffer per optimizer param group (a GPT
block: the decayed matrices and the undecayed biases and norm weights), and the reducer launches a unit's
buckets together at the end of its backward (Note [Program order] in reducer.py), the root's, outer units' and
persistent ones together at the end of backward. Each was a collective of its own, so a unit cost two
reduce-scatters where it costs one all-gather (Note [One all-gather per unit] in units.py), and on a small,
latency-bound model each collective is a round trip between ranks (measured: benchmarks/results/history.md,
issue 38). :meth:`Comm.reduce_scatter_coalesced` issues the buckets of one launch as one collective: under NCCL
each pair in place, as one group launch (``_coalescing_manager``, as FSDP2 reduces a group's gradients in one
reduce-scatter); on gloo one all-to-all of a message holding every bucket's chunk for each rank, rank-major (a
copy of the chunks the rank sends, freed at the wait), summed into each bucket's slice at the wait with the
same additions, in the same order, as each bucket alone: the same bits. The reducer joins consecutive buckets of
one launch of one dtype while their bytes sum to at most :data:`JOIN_BYTES` (and ``zero.bucket_mb``): where a
collective's fixed cost rules, and the copy is a small heap block that the memory estimate can leave out (a
GPT block's 12 MiB of matrices go alone, as before); and only where the gradients' reduce-scatter is this
Comm's flat exact one (not in two levels or quantized: ``Comm.grad_path``). Bytes sent are the buckets' own.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


#: The most bytes of buckets reduce-scattered as one collective (Note [One reduce-scatter per launch]).
JOIN_BYTES = 1 << 20


def runs(bufs: list, dtype_of: dict, limit: int) -> list[list]:
    """``bufs`` (flat buffers, in launch order) cut into the runs issued as one collective each (Note [One
    reduce-scatter per launch]): consecutive buffers of one dtype (``dtype_of[buf]``), none empty, whose bytes sum
    to at most ``limit`` (a buffer over it alone; ``limit`` 0: every buffer alone)."""
    out: list[list] = []
    for buf in bufs:
        last = out[-1] if out else []
        if (buf.numel and last and last[0].numel and dtype_of[buf] == dtype_of[last[0]]
                and sum(b.numel * dtype_of[b].itemsize for b in last + [buf]) <= limit):
            last.append(buf)
        else:
            out.append([buf])
    return out


class SummedChunks:
    """The handle of a reduce-scatter issued as an all-to-all (Note [Reduce-scatter on gloo] in comm.py): ``wait``
    waits for it, then writes into each ``outputs[i]`` (``k_i`` elements) the sum over ranks of its chunk, read
    from ``recv`` (``N`` rows of ``K = sum(k_i)`` elements, bucket ``i`` in the columns after those of the buckets
    before it; on 2 ranks one row, the other rank's chunks, added to ``owns[i]``, this rank's own chunk of bucket
    ``i``), and frees
    ``sent`` (the packed message, or ``None``) and gives ``recv`` back to the pool."""

    def __init__(self, work, recv: torch.Tensor, outputs: list[torch.Tensor], comm, owns: list | None,
                 sent: torch.Tensor | None) -> None:
        self.work, self.recv, self.outputs, self.comm, self.owns, self.sent = work, recv, outputs, comm, owns, sent

    def is_completed(self) -> bool:
        return self.recv is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.recv is None:
            return True
        self.work.wait()
        rows, at = self.recv.view(-1, sum(o.numel() for o in self.outputs)), 0
        for i, output in enumerate(self.outputs):
            k = output.numel()
            if self.owns is not None:  # 2 ranks: a + b is b + a, bit for bit
                torch.add(self.owns[i], rows[0, at:at + k], out=output)
            else:
                torch.sum(rows[:, at:at + k], dim=0, out=output)
            at += k
        self.comm.recv_pool.give_back(self.recv)
        self.recv = self.sent = None
        return True


def issue(comm, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> SummedChunks:
    """Issue the reduce-scatter of each pair ``(outputs[i], inputs[i])`` (1-D: ``k_i`` and ``N * k_i`` elements,
    one dtype; ``outputs[i]`` may be this rank's chunk of ``inputs[i]``) over ``comm``'s gloo group as one
    all-to-all (uncounted: the caller counts). One pair sends its input as it is; several, a packed copy."""
    n, rank, ks = comm.world_size, comm.rank, [o.numel() for o in outputs]
    ranks = [1 - rank] if n == 2 else range(n)  # on 2 ranks the other rank's chunk only, both ways
    if len(inputs) == 1 and n > 2:
        sent = inputs[0]
    else:
        chunks = [i[r * k:(r + 1) * k] for r in ranks for i, k in zip(inputs, ks)]
        sent = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    recv = comm.recv_pool.take(sent.numel(), sent.dtype, sent.device)
    if n == 2:
        splits = [0, sum(ks)] if rank == 0 else [sum(ks), 0]
        work = dist.all_to_all_single(recv, sent, output_split_sizes=splits, input_split_sizes=splits,
                                      group=comm.group, async_op=True)
        owns = [i[rank * k:(rank + 1) * k] for i, k in zip(inputs, ks)]
        return SummedChunks(work, recv, list(outputs), comm, owns, sent)
    work = dist.all_to_all_single(recv, sent, group=comm.group, async_op=True)
    return SummedChunks(work, recv, list(outputs), comm, None, sent)
