"""Checkpoints of a disk-offloaded engine, streamed through its host buffer (Note [Paged checkpoints]).

Note [Paged checkpoints]: with ``offload_optimizer: disk`` the fp32 masters and optimizer states live in the
swap file and host memory holds only the paging buffer (Note [Disk paging] in ``offload.py``); saving or
loading a checkpoint must not read them into memory either. The DCP entries of this rank's trainable ranges
(``model/<name>``, ``optim/<name>/<key>``: Note [Checkpoint layout] in ``state.py``, same keys, shapes and
dtypes) are therefore ``ShardedTensor`` s cut into pieces of at most :attr:`DiskMasters.chunk` elements (one
half of the buffer), whose local tensors are placeholders without memory of their own (views of the host
buffer; only their shapes are used). DCP asks the planner for each piece's data one at a time: on save,
:meth:`Pager.resolve_data` reads the piece from the swap file into a half of the host buffer and hands DCP a
tensor whose storage is exactly those bytes (``torch.frombuffer``: DCP's writer neither copies it nor keeps
memory alive with it); on load, :meth:`Pager.resolve_tensor` gives DCP a half of the buffer to copy the saved
piece into and :meth:`Pager.commit_tensor` writes it to the swap file. Extra host memory is thus the tensor
DCP reads a saved piece into on load (at most one piece for checkpoints saved this way, a whole saved chunk
for others), plus, on save and load, DCP's own plans and metadata, which grow with the number of pieces (under
1 KiB each: 44 KiB on save for 1.5 MiB of states and a 0.25 MiB buffer; negligible at the default 64 MiB,
whose pieces are 10 MiB).

Two assumptions about DCP, both checked by the tests (the resume test with a 1.5 KiB buffer and the
peak-memory test fail if they break): the writer writes an item before it resolves the next one (pinned by
``per_thread_copy_ahead=0``, which selects DCP's serial loader even with CUDA; the two halves leave one item of
slack), and the reader commits a read item before it resolves the next. A checkpoint saved this way differs from
one saved without offload only in how its entries are chunked; either loads into any engine (Note
[Checkpoint layout]: DCP reads each target from whichever chunks overlap it).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from zerorun.zero.disk import DiskMasters

#: ``FileSystemWriter`` options for a paged save (Note [Paged checkpoints]).
WRITER_OPTIONS = {"thread_count": 1, "per_thread_copy_ahead": 0}


class PagedState(dict):
    """A DCP state dict some of whose entries are paged through :attr:`pager` (Note [Paged checkpoints])."""

    pager: "Pager"


def paged_masters(engine) -> DiskMasters | None:
    """The engine's :class:`DiskMasters` when it offloads to disk, else ``None``."""
    masters = getattr(engine, "masters", None)
    return masters if isinstance(masters, DiskMasters) else None


def placeholder(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements of ``dtype`` that holds one element (stride 0): shapes only."""
    return torch.zeros(1, dtype=dtype).expand(numel)


class Pager:
    """Maps the pieces of paged DCP entries to ranges of the swap file of ``masters`` (one instance per save or
    load). ``rank``/``process_group``: the engine's."""

    def __init__(self, masters: DiskMasters, rank: int, process_group) -> None:
        self.masters, self.rank, self.group = masters, rank, process_group
        self.pieces: dict[tuple[str, int], tuple[int, str, int]] = {}  # (key, offset) -> (buffer, region, position)

    def entry(self, key: str, h, region: str, *, load: bool):
        """The DCP entry ``key`` for this rank's part of holding ``h`` (a ``state.Holding`` of a trainable
        parameter) in swap-file region ``region`` (``"master"`` or a state name): a ``ShardedTensor`` of
        placeholder pieces, or ``None`` when this rank has nothing to save. A parameter every rank holds whole
        (stage 0) is saved by rank 0 and loaded by every rank."""
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import (Shard, ShardedTensor, ShardedTensorMetadata,
                                                             TensorProperties)

        if h.ranges is None:
            ranges = {self.rank if load else 0: (0, h.numel)}
        else:
            ranges = {r: lo_hi for r, lo_hi in enumerate(h.ranges) if lo_hi[1] > lo_hi[0]}
        if self.rank not in ranges:
            return None
        step, dtype = self.masters.chunk_of(h.buffer_index), self.masters.dtypes[h.buffer_index]
        mds, mine = [], []
        for r, (lo, hi) in sorted(ranges.items()):
            for a in range(lo, hi, step):
                md = ShardMetadata([a], [min(a + step, hi) - a], f"rank:{r}/cpu")
                mds.append(md)
                if r == self.rank:
                    mine.append(Shard(self._view(md.shard_sizes[0], dtype), md))
                    self.pieces[(key, a)] = (h.buffer_index, region, h.start + a - h.lo)
        props = TensorProperties(dtype=dtype, pin_memory=self.masters.arena.is_pinned())
        meta = ShardedTensorMetadata(mds, torch.Size([h.numel]), props)
        with warnings.catch_warnings():  # ShardedTensor is deprecated in favour of DTensor (even chunks only)
            warnings.simplefilter("ignore", FutureWarning)
            return ShardedTensor._init_from_local_shards_and_global_metadata(mine, meta, process_group=self.group)

    def _view(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous view of ``numel`` elements of ``dtype`` of the host buffer: a placeholder (only its shape
        is used)."""
        return self.masters.arena[:dtype.itemsize * numel].view(dtype)

    def _find(self, index) -> tuple[int, str, int] | None:
        if index.offset is None or len(index.offset) != 1:  # paged entries are 1-D
            return None
        return self.pieces.get((index.fqn, int(index.offset[0])))

    def resolve_data(self, write_item) -> torch.Tensor | None:
        """Save: the data of ``write_item`` read from the swap file into the host buffer, or ``None`` when it is
        not paged."""
        found = self._find(write_item.index)
        if found is None:
            return None
        buffer, region, position = found
        page = self.masters.page(int(write_item.tensor_data.chunk.sizes[0]), self.masters.dtypes[buffer])
        self.masters.read_range(buffer, region, position, page)
        return page

    def resolve_tensor(self, read_item) -> torch.Tensor | None:
        """Load: where DCP copies the data of ``read_item`` (a half of the host buffer), or ``None``."""
        found = self._find(read_item.dest_index)
        if found is None:
            return None
        return self.masters.page(int(read_item.lengths[0]), self.masters.dtypes[found[0]])

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        """Load: write the data DCP copied into ``tensor`` to the swap file (nothing when not paged)."""
        found = self._find(read_item.dest_index)
        if found is not None:
            buffer, region, position = found
            self.masters.write_range(buffer, region, position + int(read_item.dest_offsets[0]), tensor)

    def save_planner(self):
        """A DCP ``SavePlanner`` that reads paged entries through :meth:`resolve_data`."""
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        pager = self

        class _PagedSavePlanner(DefaultSavePlanner):
            def resolve_data(self, write_item) -> Any:
                data = pager.resolve_data(write_item)
                return super().resolve_data(write_item) if data is None else data

        return _PagedSavePlanner()
