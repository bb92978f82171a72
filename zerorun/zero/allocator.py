"""glibc's allocator, tuned from inside a rank: ``mallopt`` settings and ``malloc_trim``, through ctypes.

Note [Returning freed memory] is in this module's docstring of :func:`configure`; the launcher's environment
(``zerorun/launch/plan.py``) follows what is decided here. Everything is a no-op (returning False) where
glibc is not the C library (macOS, musl): the functions are looked up once and missing ones are skipped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

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


def configure_rank() -> None:
    """(experiment) mallopt settings from ZERORUN_MALLOPT="trim=N,mmap=N,arena=N"."""
    spec = os.environ.get("ZERORUN_MALLOPT", "")
    names = {"trim": M_TRIM_THRESHOLD, "mmap": M_MMAP_THRESHOLD, "arena": M_ARENA_MAX}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=")
        mallopt(names[k], int(v))
