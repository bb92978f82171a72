"""ZeRO++'s quantized weights (qwZ): stage 3's parameter all-gathers in int8 blocks.

Note [Quantized weights]: with ``zero.quantize_weights: int8`` a unit's all-gather from the primary shards (its
forward's; its backward's where no secondary shard holds it, Note [Secondary shards] in hierarchy.py) sends, for
each floating flat buffer, this rank's slice in blocks of ``zero.quantize_block`` elements: per block one fp32
scale ``s = max|x| / 127`` and the int8 values ``round(x / s)`` (symmetric, ZeRO++ §3.1, Wang et al.,
arXiv:2306.10209: blockwise quantization, a scale per block, so that one outlier costs only its block's
precision). Every rank dequantizes every slice, its own included (``q * s`` in the buffer's dtype), so all ranks
compute with the same weights; the primary shard, which the optimizer steps (the fp32 master at fp32), is never
rounded: only the forward and backward see the rounding, within ``s / 2`` of each value. A block of zeros gets
scale 1 (zeros come back exact); a block holding a NaN or an infinity comes back all NaN (a diverged weight
shows, as it would exact). A block is at most the slice (``zero.quantize_block`` above a rank's slice of a
buffer would pad the message beyond the exact bytes). Integer and bool buffers travel as they are (their
bytes). Per element of a float32 buffer the message carries ``1 + 4 / block`` bytes instead of 4 (block 256:
3.94x fewer). The secondary
shards keep the dequantized values: backward computes with the forward's weights. Not for the persistent
parameters (all-gathered after the step, exact) nor units padded to their peers' (Note [Peer units]).
"""

from __future__ import annotations

import torch

#: the largest magnitude of the values of each width (symmetric: -127..127, -7..7)
QMAX = {8: 127, 4: 7}
#: the widths a setting names
BITS = {"int8": 8, "int4": 4}


def block_size(numel: int, block: int) -> int:
    """The elements per scale for a slice of ``numel``: ``block``, at most the slice (a larger block would pad the
    message beyond the exact bytes), at least 1."""
    return max(1, min(block, numel))


def blocks(numel: int, block: int) -> int:
    """The blocks of ``block`` elements covering ``numel`` (the last one padded with zeros)."""
    return -(-numel // block)


def value_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` quantized values: one each at 8 bits, two to a byte at 4 (an odd count padded)."""
    return numel if bits == 8 else (numel + 1) // 2


def message_bytes(buffers_numel_dtype: list[tuple[int, torch.dtype]], block: int, bits: int = 8) -> int:
    """Bytes of one rank's quantized message for slices of ``(numel, dtype)``: per floating slice its values
    (``bits`` each) padded to whole blocks plus an fp32 scale per block; other slices their own bytes."""
    total = 0
    for numel, dtype in buffers_numel_dtype:
        b = block_size(numel, block)
        nb = blocks(numel, b)
        total += value_bytes(nb * b, bits) + 4 * nb if dtype.is_floating_point else numel * dtype.itemsize
    return total


def quantize_rows(x: torch.Tensor, block: int, bits: int = 8) -> torch.Tensor:
    """Quantize each row of ``x`` (``[R, numel]`` floating) in blocks of ``block`` elements (at most ``numel``):
    ``uint8`` ``[R, message_bytes([(numel, ...)], block, bits)]``, per row the values of its blocks (int8; at 4
    bits ``q + 8`` two to a byte, the first in the low half), then their fp32 scales ``max|x| / QMAX``. A block
    of zeros gets scale 1 (zeros come back exact); a block holding a NaN or an infinity a non-finite scale, so
    that it comes back as NaN: a diverged value shows as it would exact."""
    rows_n, numel = x.shape
    block = block_size(numel, block)
    nb = blocks(numel, block)
    padded = torch.zeros(rows_n, nb * block, dtype=torch.float32, device=x.device)
    padded[:, :numel] = x
    rows = padded.view(rows_n, nb, block)  # the one full-size scratch: what follows works in place
    scales = torch.linalg.vector_norm(rows, float("inf"), dim=2) / QMAX[bits]  # max |x| per block, NaN kept
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)  # zeros exact; NaN and inf kept
    q = rows.div_(scales[:, :, None]).round_().clamp_(-QMAX[bits], QMAX[bits]).to(torch.int8).view(rows_n, -1)
    values = q.view(torch.uint8) if bits == 8 else _pack4(q)
    return torch.cat([values, scales.view(torch.uint8).view(rows_n, -1)], dim=1)


def dequantize_rows(message: torch.Tensor, numel: int, block: int, bits: int = 8) -> torch.Tensor:
    """The values of :func:`quantize_rows`'s ``message`` (``uint8`` ``[R, bytes]``) for rows of ``numel``
    elements: float32 ``[R, numel]`` (each within half its block's scale of the value quantized)."""
    rows_n = message.shape[0]
    block = block_size(numel, block)
    nb = blocks(numel, block)
    vb = value_bytes(nb * block, bits)
    values = message[:, :vb]
    q = values.contiguous().view(torch.int8) if bits == 8 else _unpack4(values)[:, :nb * block]
    scales = message[:, vb:vb + 4 * nb].reshape(-1).clone().view(torch.float32).view(rows_n, nb)
    return q.view(rows_n, nb, block).to(torch.float32).mul_(scales[:, :, None]).view(rows_n, -1)[:, :numel]


def quantize_into(out: torch.Tensor, x: torch.Tensor, block: int, bits: int = 8) -> None:
    """Write ``x`` (1-D floating) quantized into ``out`` (``uint8``, its :func:`message_bytes`): one row of
    :func:`quantize_rows`."""
    out.copy_(quantize_rows(x.view(1, -1), block, bits).view(-1))


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 ``[R, n]`` in -7..7 -> uint8 ``[R, ceil(n / 2)]``: ``q + 8`` two to a byte (an odd ``n`` padded
    with a zero)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.shape[1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    """:func:`_pack4`'s inverse: uint8 ``[R, m]`` -> int8 ``[R, 2 m]``."""
    low, high = packed & 15, packed >> 4
    return (torch.stack([low, high], dim=2).view(packed.shape[0], -1).to(torch.int16) - 8).to(torch.int8)


class WeightQuantizer:
    """A stage-3 engine's quantized all-gathers (Note [Quantized weights]), ``block`` elements per scale."""

    def __init__(self, block: int) -> None:
        self.block = block

    def all_gather(self, comm, outputs: list[torch.Tensor], inputs: list[torch.Tensor]):
        """All-gather each ``inputs[i]`` (this rank's slice, ``k_i`` elements) into ``outputs[i]`` (``N * k_i``)
        through one all-gather of quantized messages; returns a handle whose ``wait`` dequantizes. Pairs of no
        elements are skipped (a root unit left without parameters gathers nothing)."""
        pairs = [(o, i) for o, i in zip(outputs, inputs) if i.numel()]
        if not pairs:
            return comm.all_gather_coalesced([], [])
        outputs, inputs = [o for o, _ in pairs], [i for _, i in pairs]
        sizes = [self._size(i) for i in inputs]
        message = torch.empty(sum(sizes), dtype=torch.uint8, device=inputs[0].device)
        at = 0
        for x, n in zip(inputs, sizes):
            if x.dtype.is_floating_point:
                quantize_into(message[at:at + n], x, self.block)
            else:
                message[at:at + n].copy_(x.reshape(-1).view(torch.uint8))
            at += n
        gathered = torch.empty(comm.world_size * message.numel(), dtype=torch.uint8, device=message.device)
        return _Dequantized(comm.all_gather(gathered, message), gathered, outputs, sizes, self.block)

    def _size(self, x: torch.Tensor) -> int:
        return message_bytes([(x.numel(), x.dtype)], self.block)


class _Dequantized:
    """A quantized all-gather's handle: ``wait`` waits, then writes every rank's dequantized slices into the
    outputs (rank ``r``'s into row ``r`` of each output viewed as ``N`` rows) and frees the messages."""

    def __init__(self, work, gathered: torch.Tensor, outputs: list[torch.Tensor], sizes: list[int],
                 block: int) -> None:
        self.work, self.gathered, self.outputs, self.sizes, self.block = work, gathered, outputs, sizes, block

    def wait(self) -> bool:
        if self.gathered is not None:
            self.work.wait()
            rows = self.gathered.view(-1, sum(self.sizes))  # one row per rank
            at = 0
            for output, n in zip(self.outputs, self.sizes):
                out_rows = output.view(rows.shape[0], -1)
                if output.dtype.is_floating_point:
                    out_rows.copy_(dequantize_rows(rows[:, at:at + n], out_rows.shape[1], self.block))
                else:
                    out_rows.view(torch.uint8).copy_(rows[:, at:at + n])
                at += n
            self.gathered.untyped_storage().resize_(0)  # after the wait (Note [Streams])
            self.gathered = None
        return True
