"""The environments benchmarks/zero_stages.py can run a mode in (``--envs``): name -> (variables for the ranks,
what each rank does itself after every step: None, ``"trim"`` or ``"collect"``). Note [Returning freed memory]
in zerorun/zero/allocator.py and Note [Rank allocator] in zerorun/allocator.py say why each exists.

``alloc`` is glibc tuned as zerorun's launcher gives it to ranks on a node without tcmalloc or mimalloc
(MALLOC_MMAP_THRESHOLD_=1 MiB, THP_MEM_ALLOC_ENABLE=1), ``default`` none (as plain torchrun runs DDP and FSDP2),
``trim`` none but ``malloc_trim(0)`` after every step, ``mmap4``/``mmap16`` fixed 4/16 MiB thresholds, ``nothp``
1 MiB without THP, ``tcmalloc`` gperftools' tcmalloc preloaded (what zerorun's launcher gives ranks where the
node has it; Debian package libtcmalloc-minimal4), ``jemalloc`` jemalloc preloaded (libjemalloc2),
``tcmalloc-decommit`` tcmalloc returning freed memory to the kernel at once (``TCMALLOC_AGGRESSIVE_DECOMMIT=1``),
``tcmalloc-release`` tcmalloc releasing 10x faster than its default (``TCMALLOC_RELEASE_RATE=10``), ``mimalloc``
mimalloc from its pip wheel (cmeel-mimalloc) as zerorun's launcher gives it where a node has no tcmalloc (a purge
delay no step outlasts; zerorun's engine calls ``mi_collect(true)`` after each optimizer step:
:func:`zerorun.zero.allocator.collect`, called by the engine at the end of each step), ``mimalloc-keep`` never returning freed memory
(``MIMALLOC_PURGE_DELAY=-1``, the launcher's choice before), ``mimalloc-purgeMS`` returning it MS ms after the
free (0, 100, 1000: mimalloc's default, 10000; -1: never), ``mimalloc-collect`` the same as ``mimalloc`` with the
rank calling ``collect()`` itself after each step too (measured before the engine did), ``mimalloc-reset``
``MADV_FREE`` at once instead of decommitting, and ``mimalloc-keep-X`` / ``mimalloc-collect-eager0`` one more
mimalloc option (:data:`MIMALLOC_OPTIONS`). Under every ``mimalloc*`` environment zerorun's engine collects after
each step (without a purge delay, as in ``mimalloc-keep``, collecting returns nothing to the kernel).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zerorun.allocator import MIMALLOC_ENV, TCMALLOC_QUIET, TCMALLOC_SONAMES, find_mimalloc  # noqa: E402 - torch-free

#: tcmalloc preloaded as zerorun's launcher preloads it (zerorun.allocator.allocator_env), by its preferred soname.
TCMALLOC = {"LD_PRELOAD": TCMALLOC_SONAMES[0], **TCMALLOC_QUIET}
#: mimalloc preloaded by path, as zerorun's launcher preloads it.
MIMALLOC = {"LD_PRELOAD": find_mimalloc() or "libmimalloc.so"}
#: a purge delay (ms) no step outlasts: mimalloc then purges only when asked (``mi_collect(true)``).
PURGE_NEVER_BY_TIME = MIMALLOC_ENV
#: mimalloc's options tried on top of keeping (issue 35), by the suffix of their environment's name.
MIMALLOC_OPTIONS = {
    "nothp": {"MIMALLOC_ALLOW_THP": "0"},
    "eager0": {"MIMALLOC_ARENA_EAGER_COMMIT": "0"},
    "large": {"MIMALLOC_ALLOW_LARGE_OS_PAGES": "1"},
    "ondemand": {"MIMALLOC_PAGE_COMMIT_ON_DEMAND": "1"},
    "reserve64": {"MIMALLOC_ARENA_RESERVE": "64MiB"},
}

ENVS = {
    "alloc": ({"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "THP_MEM_ALLOC_ENABLE": "1"}, None),
    "default": ({}, None),
    "trim": ({}, "trim"),
    "mmap4": ({"MALLOC_MMAP_THRESHOLD_": str(4 << 20), "THP_MEM_ALLOC_ENABLE": "1"}, None),
    "mmap16": ({"MALLOC_MMAP_THRESHOLD_": str(16 << 20), "THP_MEM_ALLOC_ENABLE": "1"}, None),
    "nothp": ({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}, None),
    "tcmalloc": (TCMALLOC, None),
    "jemalloc": ({"LD_PRELOAD": "libjemalloc.so.2"}, None),
    "mimalloc": ({**MIMALLOC, **MIMALLOC_ENV}, None),  # zerorun's engine collects after each optimizer step
    "mimalloc-keep": ({**MIMALLOC, "MIMALLOC_PURGE_DELAY": "-1"}, None),
    **{f"mimalloc-purge{ms}": ({**MIMALLOC, "MIMALLOC_PURGE_DELAY": str(ms)}, None)
       for ms in (0, 100, 1000, 10000, -1)},
    "mimalloc-collect": ({**MIMALLOC, **PURGE_NEVER_BY_TIME}, "collect"),
    "mimalloc-collect-eager0": ({**MIMALLOC, **PURGE_NEVER_BY_TIME, **MIMALLOC_OPTIONS["eager0"]}, "collect"),
    "mimalloc-reset": ({**MIMALLOC, "MIMALLOC_PURGE_DELAY": "0", "MIMALLOC_PURGE_DECOMMITS": "0"}, None),
    **{f"mimalloc-keep-{k}": ({**MIMALLOC, "MIMALLOC_PURGE_DELAY": "-1", **v}, None)
       for k, v in MIMALLOC_OPTIONS.items()},
    "tbbmalloc": ({"LD_PRELOAD": ":".join(os.path.join(sys.prefix, "lib", f"libtbbmalloc{s}.so.2")
                                          for s in ("", "_proxy"))}, None),
    "tcmalloc-decommit": ({**TCMALLOC, "TCMALLOC_AGGRESSIVE_DECOMMIT": "1"}, None),
    "tcmalloc-release": ({**TCMALLOC, "TCMALLOC_RELEASE_RATE": "10"}, None),
}


if __name__ == "__main__":  # python benchmarks/rank_envs.py: the environments and their variables
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for name, (env, how) in ENVS.items():
        print(f"{name}: {' '.join(f'{k}={v}' for k, v in env.items()) or 'none set'}"
              f"{', rank calls ' + how if how else ''}")
