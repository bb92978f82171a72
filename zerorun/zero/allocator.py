"""glibc's allocator, tuned from inside a rank: ``mallopt`` settings and ``malloc_trim``, through ctypes.

Everything here is a no-op (returning False) where glibc is not the C library (macOS, musl). The module does
not import torch, so a rank can call :func:`configure` before torch allocates anything.

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
noise (``benchmarks/zero_stages.py --envs``; README, "The allocator"). A node without tcmalloc (Note [Rank
allocator]) gives its ranks these two variables (:data:`ENV`, which is ``zerorun/launch/plan.py``'s
``GLIBC_ENV``); :func:`configure` sets them from inside a rank started some other way.

Note [Rank allocator]: zerorun's ranks run under gperftools' tcmalloc where their node has it (Debian/Ubuntu
package ``libtcmalloc-minimal4``; ``.ci/run`` installs it), else under Microsoft's mimalloc, whose shared library
comes with zerorun from pip (the ``cmeel-mimalloc`` wheel, a dependency: :func:`find_mimalloc`; issue 35: a fresh
install, where nobody ran apt-get, gets a fast allocator too), either preloaded by each node's watcher
(``zerorun/launch/plan.py``: :func:`zerorun.launch.plan.allocator_env`; ``ZERORUN_ALLOCATOR`` in the recipe's
``launch.env`` or the launcher's environment may name ``tcmalloc``, ``mimalloc`` or ``glibc``), and under glibc with
the tuning of Note [Returning freed memory] where a node has neither (its watcher prints one line saying what to
install: :func:`zerorun.launch.plan.fallback_note`). mimalloc is the fallback's replacement, not tcmalloc's: in one
run on a loaded machine (issue 35; 55M GPT, 2 gloo ranks, micro-batch 8; README, "What a fresh install runs"), CPU
seconds per step and rank against DDP as torchrun runs it were stage 1 1.08x, stage 2 1.11x, stage 3 1.22x under
mimalloc, 0.93x, 0.92x, 0.84x under tcmalloc and 1.15x, 1.17x, 1.22x under glibc tuned, with realized savings of
0.99, 0.98, 0.83 (tcmalloc 1.00, 1.00, 0.89; glibc tuned 1.00, 1.00, 0.99): mimalloc faults in a sixth of glibc
tuned's pages but still pays 0.9-1.4 kernel seconds a step, because it returns freed memory to the kernel after a
delay (``MIMALLOC_PURGE_DELAY``, 1 s) shorter than a step and faults it in again. So the watcher gives mimalloc
``MIMALLOC_PURGE_DELAY=-1`` (:data:`zerorun.launch.plan.MIMALLOC_KEEP`; the job's own value wins): it then keeps
and reuses what it frees, as tcmalloc does, and in a second run stage 2 took 1.00x tcmalloc's CPU time (4.45
against 4.47 s a step; 0.84x DDP's step time under torchrun), but held 1618 MiB at its peak against tcmalloc's
1443 (stage 0: 2022 against 1772, so the realized saving reads 1.29); in a third, stage 1 1.03x and stage 3
0.94x tcmalloc's CPU time, but stage 3 held 1708 MiB against tcmalloc's 1382 (0.75 of its saving): the price of
keeping, where a job that needs the memory sets ``MIMALLOC_PURGE_DELAY`` itself or asks for glibc.
torch's own CPU launcher offers the same preload (``torch.backends.xeon.run_cpu --enable-tcmalloc``). Why: the
fixed mmap threshold keeps what ZeRO frees off the peak but makes every rank fault in each large block anew on
every use, and a step of stage 3, which gathers and frees every unit twice, the most; tcmalloc keeps freed
blocks in its page heap and reuses them, so nothing is faulted in after the first step, and it does not let the
heap grow with holes the way glibc's raised threshold does. Measured side by side, 2 interleaved rounds on an
idle machine (55M GPT, 2 gloo ranks, micro-batch 4; ``benchmarks/zero_stages.py --envs default,alloc,tcmalloc``;
README, "The allocator"): step time glibc tuned -> tcmalloc, stage 1 1.56 -> 1.28 s, stage 2 1.57 -> 1.27 s,
stage 3 1.95 -> 1.45 s, DDP 1.68 -> 1.43 s (DDP under glibc's defaults, as torchrun runs it: 1.53 s); peak RSS
per rank stage 1 1248 -> 1284 MiB, stage 2 1143 -> 1254, stage 3 1094 -> 1154 (glibc defaults: 1417, 1367,
1241). Stages 2 and 3 keep less of their saving under tcmalloc (realized 0.75 and 0.80, against 1.00 and 0.87
tuned; tcmalloc's peak also moves between runs: the bytes in use are the same, but its heap grows by a 32 MiB
block, or not, at a step chosen by chance, when no free span is whole enough for it; neither gperftools'
aggressive decommit, which faults everything in again, nor its faster release rate, nor releasing free spans
between phases of the step helped: README, "The allocator"): ``ZERORUN_ALLOCATOR: glibc`` trades that speed
for memory. Those figures are from before stage 3's tails and the adopted gradients (Notes [Outer units],
[Adopted gradient]); after them, in one run of every mode (README, "Where stage 3's peak was"), tcmalloc keeps
1.02 and 0.92 of stages 2 and 3's saving (1176 and 1108 MiB, glibc tuned 1144 and 1044) at 1.358 and 1.510 s,
0.84x and 0.94x DDP as torchrun runs it; at micro-batch 8 stage 3 under tcmalloc keeps 0.90 or 0.75 by run
(each stage's peak lands on one of two values 62 MiB apart: README, "Where stage 3's peak was").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: Note [Returning freed memory]: glibc's fixed mmap threshold for ranks (bytes).
MMAP_THRESHOLD = 1 << 20
#: the environment variables that ask for the same (the launcher's ranks get these).
ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "THP_MEM_ALLOC_ENABLE": "1"}

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



#: Note [Rank allocator]: the variable that chooses each rank's malloc, and the values it may take.
ALLOCATOR_VAR = "ZERORUN_ALLOCATOR"
ALLOCATORS = ("auto", "tcmalloc", "mimalloc", "glibc")
#: what a node without a fast allocator lacks (one line, printed where ``auto`` falls back to glibc tuned).
INSTALL_HINT = "pip install cmeel-mimalloc (a zerorun dependency), or apt-get install libtcmalloc-minimal4"


def allocator_problem(value: str) -> str | None:
    """Why ``value`` is not a value of ``ZERORUN_ALLOCATOR`` (Note [Rank allocator]), or None when it is."""
    if value in ALLOCATORS:
        return None
    return (f"ZERORUN_ALLOCATOR is {value!r}: expected auto (tcmalloc where the node has it, else mimalloc, else "
            "glibc tuned), tcmalloc, mimalloc or glibc")


#: allocators that replace glibc's malloc when preloaded: name -> the library's file name prefix.
PRELOADED = {"tcmalloc": "libtcmalloc", "jemalloc": "libjemalloc", "mimalloc": "libmimalloc"}


#: the pip distribution that brings mimalloc (a zerorun dependency: Note [Rank allocator]) and its library's name.
MIMALLOC_DIST, MIMALLOC_LIB = "cmeel-mimalloc", "libmimalloc.so"


def find_mimalloc() -> str | None:
    """The absolute path of the mimalloc shared library that pip installed beside zerorun (the
    ``cmeel-mimalloc`` wheel puts it in ``site-packages/cmeel.prefix/lib``), or None where it is missing."""
    from importlib import metadata

    try:
        files = metadata.distribution(MIMALLOC_DIST).files or []
    except metadata.PackageNotFoundError:
        return None
    libs = sorted((f for f in files if f.name.startswith(MIMALLOC_LIB)), key=lambda f: len(f.name))
    return next((str(f.locate()) for f in libs if os.path.isfile(f.locate())), None)


def _mapped() -> str:
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:
        return ""


def preloaded() -> bool:
    """Whether an allocator of :data:`PRELOADED` serves this process's malloc instead of glibc (Note [Rank
    allocator]: preloaded, so mapped)."""
    return name() != "glibc"


def name() -> str:
    """This process's malloc: one of :data:`PRELOADED`'s names when that library is mapped (Note [Rank
    allocator]: preloaded by zerorun or by the job), else ``"glibc"`` (also where /proc is missing)."""
    maps = _mapped()
    return next((n for n, lib in PRELOADED.items() if lib in maps), "glibc")


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
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", ENV["THP_MEM_ALLOC_ENABLE"])
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
