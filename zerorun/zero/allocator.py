"""The rank's malloc from inside, through ctypes: glibc's ``mallopt`` settings and ``malloc_trim``, and
mimalloc's per-step ``mi_collect`` (:func:`collect`, Note [Rank allocator] in zerorun/allocator.py).

Each is a no-op (returning False) where its allocator does not serve the process (glibc: macOS, musl). The module
does not import torch, so a rank can call :func:`configure` before torch allocates anything.

Note [Returning freed memory]: glibc serves a block below its mmap threshold from a heap (an arena) and,
by default, raises that threshold to the size of every mmapped block freed (up to 32 MiB) and the trim
threshold to twice that. After the first step, then, every tensor of 32 MiB or less lives in the heap: a
freed one stays resident, and a later request of another size (the next unit's gather, an optimizer
state, a gradient bucket) cannot always reuse the hole and grows the heap. Peak RSS then holds the garbage
of the earlier phases of the step, and most of what ZeRO frees never shows. A fixed threshold
(``M_MMAP_THRESHOLD`` = :data:`MMAP_THRESHOLD`, which also stops glibc from raising it) makes every block of
1 MiB or more its own mapping, returned to the OS when freed; torch's ``THP_MEM_ALLOC_ENABLE=1`` backs
blocks of 2 MiB or more with 2 MiB pages, so re-acquiring them faults 512x less often.

Measured (issue 21; 55M GPT, 2 gloo ranks, micro-batch 4, peak RSS per rank in MiB, default environment ->
this one): DDP 1756 -> 1657, FSDP2 1773 -> 1188, stage 0 1506 -> 1449, stage 1 1402 -> 1240, stage 2
1390-1396 -> 1142-1143, stage 3 1254-1291 -> 1084-1090 (realized saving against stage 0: stage 1 0.50 ->
1.00, stage 2 0.37 -> 0.98, stage 3 0.52 -> 0.86). The alternatives kept less of it: ``malloc_trim(0)`` after
every step (:func:`trim`) returns the garbage between steps but not within one (stage 2 1354, stage 3 1245,
FSDP2 1654); ``MALLOC_ARENA_MAX=1`` (stage 2 1331, stage 3 1334); a fixed threshold of 4 MiB (stage 2 1284,
stage 3 1149) or 16 MiB (1386, 1319). The price is kernel time: every block of 1 MiB or more is mapped,
faulted in and unmapped again on each use: 0.35 -> 0.53 kernel CPU seconds per step per rank at stage 2, 0.38
-> 0.69 at stage 3 (of 2.4-2.8 CPU seconds), which a busy machine's step time could not separate from its
noise (``benchmarks/zero_stages.py --envs``; docs/benchmarks.md, "The allocator"). A node without tcmalloc (Note [Rank
allocator] in zerorun/allocator.py) gives its ranks these two variables (:data:`zerorun.allocator.GLIBC_ENV`);
:func:`configure` sets them from inside a rank started some other way.
"""


from __future__ import annotations

import ctypes
import ctypes.util
import os

from zerorun.allocator import GLIBC_ENV, MMAP_THRESHOLD, name, preloaded

#: mallopt parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

_libc = None


def _glibc():
    """The C library through ctypes if it has glibc's ``malloc_trim`` and ``mallopt``, else None."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
            lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _libc = lib
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def trim() -> bool:
    """Return the free memory of every malloc arena to the OS (glibc ``malloc_trim(0)``: the free top of each
    heap is released and whole free pages inside it are ``MADV_DONTNEED``-ed).

    Returns:
        True if glibc released some memory, False if none or not glibc.
    """
    lib = _glibc()
    return bool(lib and lib.malloc_trim(0))


# Note [Trimmed before backward]: under glibc's own defaults (a library user's ranks under torchrun: no preloaded
# allocator, no fixed mmap threshold) stage 3's peak grew across issue 38's rebuild: each unit's packed all-gather
# allocates messages of other sizes than its gathered buffers, so a hole a step leaves seldom fits the next request
# and the heap's free bytes grow step after step (benchmarks/results/history.md, "The same, diagnosed (stop 54)"):
# 1500-1620 MiB per rank on the 55M GPT, about stage 0's. A fixed mmap threshold set that late (after torch read
# THP_MEM_ALLOC_ENABLE) costs a quarter of the step in page faults. ``malloc_trim(0)`` before each backward, once the
# forward has freed its units, gives the freed pages back instead: 1362 MiB for 0.13 kernel seconds more a step
# (2.4 CPU s); at the step's end as well, 1325-1353 MiB but 0.27 more. Only on CPU: on a GPU the units are device
# memory, which glibc never holds.
_dynamic: bool | None = None


#: glibc's settings that fix its mmap threshold (glibc's malloc.c: setting any of them turns the dynamic one off),
#: as environment variables and as ``GLIBC_TUNABLES`` names (``glibc.malloc.<name>``).
FIXING = {"MALLOC_MMAP_THRESHOLD_": "mmap_threshold", "MALLOC_TRIM_THRESHOLD_": "trim_threshold",
          "MALLOC_TOP_PAD_": "top_pad", "MALLOC_MMAP_MAX_": "mmap_max"}


def dynamic_glibc() -> bool:
    """Whether this process's malloc is glibc with its default, dynamic mmap threshold: no preloaded allocator, none
    of :data:`FIXING`'s variables or tunables set, :func:`configure` not called (Note [Trimmed before backward]).
    Decided at the first call; :func:`configure` makes it False."""
    global _dynamic
    if _dynamic is None:
        tunables = os.environ.get("GLIBC_TUNABLES", "")
        fixed = any(var in os.environ or f"glibc.malloc.{name}" in tunables for var, name in FIXING.items())
        _dynamic = not preloaded() and _glibc() is not None and not fixed
    return _dynamic


def trim_dynamic() -> bool:
    """Note [Trimmed before backward]: :func:`trim` where :func:`dynamic_glibc`, else nothing. Host-only.

    Returns:
        True if glibc released some memory, else False.
    """
    return dynamic_glibc() and trim()


_mi_collect = None


def collect() -> bool:
    """Return the free memory mimalloc holds to the kernel now (``mi_collect(true)``: every free page of this
    thread's heap back to the arenas, and every range the arenas were keeping for their purge delay decommitted;
    Note [Rank allocator]); the engine calls it at the end of every step, and at stage 3 before each backward.
    Host-only: no device sync. A no-op under any other malloc.

    Returns:
        True if mimalloc serves this process's malloc and was asked to collect, else False.
    """
    global _mi_collect
    if _mi_collect is None:
        _mi_collect = False
        if name() == "mimalloc":
            try:
                fn = ctypes.CDLL(None).mi_collect  # the preloaded library's symbols are the process's
                fn.argtypes, fn.restype = [ctypes.c_bool], None
                _mi_collect = fn
            except (OSError, AttributeError):
                pass
    if not _mi_collect:
        return False
    _mi_collect(True)
    return True


def mallopt(param: int, value: int) -> bool:
    """Set one glibc malloc parameter (``M_TRIM_THRESHOLD``, ``M_MMAP_THRESHOLD`` in bytes, ``M_ARENA_MAX``).

    Returns:
        True on success, False if glibc refused it or is not the C library.
    """
    lib = _glibc()
    return bool(lib and lib.mallopt(param, value))


def rss_bytes() -> int:
    """This process's resident set size now (bytes, from ``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def configure() -> bool:
    """Note [Returning freed memory] from inside a rank: fix glibc's mmap threshold at :data:`MMAP_THRESHOLD`
    unless ``MALLOC_MMAP_THRESHOLD_`` is set (the launcher sets it; a user's own value wins), and set
    ``THP_MEM_ALLOC_ENABLE=1`` unless set (torch reads it at its first allocation: it takes effect only when
    this runs before torch allocates). Blocks allocated before the call keep their placement.

    Nothing is set under a preloaded allocator (tcmalloc, mimalloc, jemalloc: Note [Rank allocator]).

    Returns:
        True if this call set the mmap threshold, False if the environment already does, under a preloaded
        allocator, or not glibc.
    """
    if preloaded():
        return False
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", GLIBC_ENV["THP_MEM_ALLOC_ENABLE"])
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    fixed = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    if fixed:
        global _dynamic
        _dynamic = False  # Note [Trimmed before backward]: no longer glibc's default
    return fixed
