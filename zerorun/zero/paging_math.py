"""The arithmetic of disk offload's paging (Note [Disk paging] in ``offload.py``, Note [Swap files] in ``offload.py``),
without torch, so that ``zerorun estimate`` counts disk offload's bytes as the runtime lays them out without
importing torch in the launcher."""

from __future__ import annotations

import mmap

#: Swap-file regions start at multiples of this many bytes (Note [Swap files]).
SWAP_ALIGN = 64


def swap_region_bytes(nbytes: int) -> int:
    """Bytes a region of ``nbytes`` bytes takes in a swap file: rounded up to :data:`SWAP_ALIGN`."""
    return (nbytes + SWAP_ALIGN - 1) // SWAP_ALIGN * SWAP_ALIGN


#: Parameter offload's regions (Note [Parameter offload] in ``param_offload.py``) are whole pages of this many
#: bytes (this host's, 4096 here), so that each buffer's pages can be dropped alone.
PAGE_BYTES = mmap.PAGESIZE


def page_region_bytes(nbytes: int) -> int:
    """Bytes a parameter-offload region of ``nbytes`` bytes takes: rounded up to :data:`PAGE_BYTES`."""
    return (nbytes + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES


def subgroup_elements(buffer_bytes: int, n_states: int) -> int:
    """Elements of one disk-offload sub-group (Note [Disk paging]): each half of a host buffer of
    ``buffer_bytes`` bytes holds that many elements of fp32 master and ``n_states`` fp32 optimizer states,
    rounded down to a multiple of 16 (0: the buffer is too small)."""
    return (buffer_bytes // 2 // (4 * (1 + n_states))) // 16 * 16
