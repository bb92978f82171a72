"""Stage 3's parameter offload to disk (``zero.offload_params: disk``): this rank's parameter slices live in a
file and are in memory only while a unit is all-gathered or the optimizer steps them.

Note [Parameter offload]: ZeRO-Infinity (Rajbhandari et al., arXiv:2104.07857, §5.1 "infinity offload
engine") keeps the partitioned parameters of stage 3 in NVMe and brings a unit's slices in just before its
all-gather. Here the slices of every sharded unit (trainable and frozen; not the persistent parameters, which
stay whole on every rank) are views of one shared, file-backed mapping of a per-rank swap file under
``zero.offload_path`` (the same naming, ``flock`` and removal rules as the optimizer's: Note [Swap files] in
``offload.py``). Every reader and writer of a slice (the all-gather, the optimizer step, checkpoints, the
replay of a deferred model's construction) works on them unchanged; the kernel pages them in on use. After a
unit's all-gather is done and after the optimizer step, the slices' pages are dropped from this process
(``madvise(MADV_DONTNEED)``; written data stays in the file through the page cache, which the kernel writes
back and reclaims under memory pressure, as for the optimizer's swap file); a unit all-gathered ahead by
the prefetcher (Note [Prefetch] in ``stage3.py``) is paged in by that all-gather. Resident memory for
parameter slices is then what the units in flight hold (the unit in use and those prefetched), whatever the model size: at rest
stage 3 holds 4Ψ/N (fp32 gradient slices) with ``offload_optimizer: disk`` instead of 8Ψ/N
(``zerorun estimate`` counts it). CPU devices only: on CUDA the slices would need a pinned host staging
buffer (not built; the engine raises).
"""

from __future__ import annotations

import mmap

import torch

from zerorun.zero.flat import FlatBuffer
from zerorun.zero.paging_math import page_region_bytes
from zerorun.zero.swap import SwapFile


class ParamStore:
    """This rank's parameter slices of ``buffers`` in a file-backed mapping (Note [Parameter offload]).

    Sets each buffer's ``shard_data`` (1-D, ``shard_numel`` elements of the buffer's dtype, zeros) to a view of
    the mapping; regions are page-aligned so that each buffer's pages can be dropped alone.

    Raises:
        ValueError: a buffer is not on the CPU, or the swap file cannot be created in ``folder`` (the message
            names ``zero.offload_params`` or ``zero.offload_path``).
    """

    def __init__(self, buffers: list[FlatBuffer], folder: str, rank: int) -> None:
        for buf in buffers:
            if buf.device.type != "cpu":
                raise ValueError(f"zero.offload_params: disk offload of parameters runs on CPU devices only (a "
                                 f"parameter is on {buf.device})")
        try:
            self.file = SwapFile(folder, rank, tag="params-")
        except OSError as e:
            raise ValueError(f"zero.offload_path: cannot create a parameter swap file in {folder}: "
                             f"{e.strerror or e}") from None
        self.regions: dict[int, tuple[int, int]] = {}  # id(buffer) -> (offset, bytes), page-aligned
        for buf in buffers:  # each a whole number of pages, so every offset is page-aligned too
            length = page_region_bytes(buf.shard_numel * torch.empty((), dtype=buf.dtype).element_size())
            self.regions[id(buf)] = (self.file.allocate(length), length)
        self.size = self.file.size
        self.map = None
        if self.size == 0:
            return
        self.map = mmap.mmap(self.file.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        for buf in buffers:
            offset, _ = self.regions[id(buf)]
            buf.shard_data = torch.frombuffer(self.map, dtype=buf.dtype, count=buf.shard_numel, offset=offset)

    def release(self, buffers) -> None:
        """Drop the pages of ``buffers``' slices from this process (their values stay in the file)."""
        for buf in buffers:
            region = self.regions.get(id(buf))
            if region is not None and region[1]:
                self.map.madvise(mmap.MADV_DONTNEED, *region)

    def release_all(self) -> None:
        """Drop every slice's pages from this process."""
        if self.map is not None:
            self.map.madvise(mmap.MADV_DONTNEED, 0, self.size)

    def close(self) -> None:
        """Remove the swap file (also done at process exit); the mapping stays valid until the process ends."""
        self.file.close()

